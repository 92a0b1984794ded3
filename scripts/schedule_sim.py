"""Simulate the causal backward's program schedule: grid order against `lpt` (heaviest first).

Under the causal mask the Gluon backward kernels' programs differ in work: in dK/dV key
block b sees every query block from its diagonal on, in dQ query block b sees the key tiles
up to its diagonal. The GPU starts programs roughly in launch order, each on the first SM
that frees up. This script replays that greedily (`sms` SMs, one program each, every
streamed step costing the same and each program one step of set-up) for the fa-bench shapes
and prints each order's finish time over an even spread of all steps on all SMs:

- grid order: x the block, y the head (the kernels without `lpt`);
- lpt, every head at once: all heads' heaviest blocks first (L2 no longer holds their rows);
- lpt as the templates do it: heads in groups of max(32768 // N, 1), heaviest first within
  a group (`attn_bwd_dkdv_fa3.py.jinja`, `attn_bwd_dq_fa3.py.jinja`).

    python scripts/schedule_sim.py --dim 128

The numbers are the model's, not measurements (docs/backward-kernels.md has both).
"""

from __future__ import annotations

import argparse
import heapq
from collections.abc import Callable, Sequence

from flashgen.kernels.presets import TOKENS_PER_BATCH

#: The templates' streamed rows of the heads that run together (LPT_ROWS).
LPT_ROWS = 32768


def makespan(works: Sequence[float], sms: int, setup: float = 1.0) -> float:
    """When the last program ends if each starts, in order, on the first free SM."""
    free = [0.0] * sms
    for work in works:
        heapq.heappush(free, heapq.heappop(free) + work + setup)
    return max(free)


def order(heads: int, blocks: int, group: int, work: Callable[[int], float]) -> list[float]:
    """The programs' work in launch order: `group` heads at a time, within a group the
    `blocks` places one after another (`work` of the i-th place), heads fastest."""
    out: list[float] = []
    for g0 in range(0, heads, group):
        for i in range(blocks):
            out += [work(i)] * min(group, heads - g0)
    return out


def work(kernel: str, blocks: int, per: int) -> tuple[Callable[[int], float],
                                                     Callable[[int], float]]:
    """The steps of the i-th program of a head in grid order and in lpt order. dK/dV's key
    block b sees query blocks b .. end, so grid order already runs the heaviest first; dQ's
    query block b sees key tiles 0 .. b, so grid order runs the lightest first."""
    def heaviest_first(i: int) -> float:
        return (blocks - i) * per

    def lightest_first(i: int) -> float:
        return (i + 1) * per

    return (heaviest_first if kernel == "dK/dV" else lightest_first), heaviest_first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=128, help="head dim (fa-bench: 64 or 128)")
    ap.add_argument("--sms", type=int, default=132, help="SMs (H100 SXM and H200: 132)")
    ap.add_argument("--owned", type=int, default=128, help="rows a program owns")
    ap.add_argument("--streamed", type=int, default=64, help="rows a step streams")
    a = ap.parse_args()
    print(f"finish time over an even spread, D{a.dim}, {a.sms} SMs, programs of {a.owned} "
          f"rows streaming {a.streamed} a step")
    print(f"{'N':>6} {'kernel':>6} {'grid':>7} {'lpt, all':>9} {'lpt, groups':>12}")
    for n in (1024, 2048, 4096, 8192, 16384):
        heads, blocks = TOKENS_PER_BATCH // n * (2048 // a.dim), n // a.owned
        per = a.owned // a.streamed
        group = max(LPT_ROWS // n, 1)
        for name in ("dK/dV", "dQ"):
            grid_work, lpt_work = work(name, blocks, per)
            even = sum(grid_work(b) for b in range(blocks)) * heads / a.sms
            grid = makespan(order(heads, blocks, 1, grid_work), a.sms) / even
            every = makespan(order(heads, blocks, heads, lpt_work), a.sms) / even
            grouped = makespan(order(heads, blocks, group, lpt_work), a.sms) / even
            print(f"{n:>6} {name:>6} {grid:>7.3f} {every:>9.3f} {grouped:>8.3f} (x{group})")


if __name__ == "__main__":
    main()
