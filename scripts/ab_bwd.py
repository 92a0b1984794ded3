"""Time backward variants against each other and cuDNN's backward, in one process.

Every variant first runs a fa-bench-like problem once and its gradients are checked against
the float64 reference (`compare_grads`, the tuner's gate); one that fails is reported, not
timed. Then, round by round, each variant's backward alone (`torch.autograd.grad` of a saved
forward, wall timer: back-to-back calls, L2 flushed, median) runs right after a timing of
cuDNN's, and the table gives the median of each round's ratio (cuDNN's time over the
variant's: above 1 is faster). Interleaving rounds, and turning the variants' order each
round, keeps drift between variants out of the comparison.

`--alt NAME=DIR` also times every variant with its kernels rendered from another set of
templates (a folder of template files replacing the working tree's by name, as in
`scripts/ab_templates.py`), in the same process and rounds, as columns "VARIANT@NAME": a
template edit judged without the spread between two processes (the same kernel has read
0.83 and 0.96 of cuDNN in one run's neighbouring columns).

    python3 scripts/ab_bwd.py --dims 64,128 --lens 2048,8192 --causal yes,no \\
        --variant 'sep={"block_streamed": 64, "fa3": "both", "num_warps": 4}' \\
        --variant 'atomic={"block_streamed": 64, "fa3": "both", "num_warps": 4, \\
                           "dq_mode": "atomic"}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Iterator
from typing import Any

import torch
from ab_templates import template_set
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen import serve
from flashgen.kernels.bwd_render import BwdKernel, render_bwd_with
from flashgen.kernels.bwd_space import why_invalid_bwd
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.presets import TOKENS_PER_BATCH
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import _load_module, source_hash
from flashgen.tune.check import make_inputs
from flashgen.tune.grads import compare_grads
from flashgen.tune.timing import time_cuda

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON of BwdVariant fields (repeat); 'served' is always timed")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--lens", default="2048,8192")
    ap.add_argument("--causal", default="yes,no")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--alt", action="append", default=[], metavar="NAME=DIR",
                    help="also time every variant with the templates of DIR (repeat)")
    a = ap.parse_args()
    named: dict[str, Timed] = {"served": (None, "")}
    for item in a.variant:
        name, _, spec = item.partition("=")
        named[name] = (BwdVariant(**json.loads(spec)), "")
    for item in a.alt:
        alt, _, where = item.partition("=")
        ALTERNATES[alt] = template_set(where)
        named.update({f"{name}@{alt}": (variant, alt)
                      for name, (variant, tree) in list(named.items()) if not tree})
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}")
    print("| problem | " + " | ".join(named) + " |")
    print("|---" * (len(named) + 1) + "|")
    for dtype in a.dtypes.split(","):
        for d in (int(x) for x in a.dims.split(",")):
            for n in (int(x) for x in a.lens.split(",")):
                for causal in (c == "yes" for c in a.causal.split(",")):
                    row = _case(named, dtype, d, n, causal, a.rounds, dev)
                    label = f"{dtype} D{d} N{n} {'causal' if causal else 'full'}"
                    print(f"| {label} | " + " | ".join(row) + " |", flush=True)


#: A column: its variant (None: the served one) and the alternate templates it renders from
#: ("": the working tree's).
Timed = tuple[BwdVariant | None, str]
#: --alt's template sets by name, and the dispatcher each renders its kernels for.
ALTERNATES: dict[str, dict[str, str]] = {}
DISPATCHERS: dict[str, serve.Dispatcher] = {}


@contextlib.contextmanager
def _rendered_from(alt: str) -> Iterator[serve.Dispatcher]:
    """A dispatcher of its own (backward plans are kept per dispatcher) whose kernels, while
    this lasts, render from alternate template set `alt` ("": the working tree's)."""
    if not alt:
        yield serve.default_dispatcher()
        return
    real = serve.load_bwd_kernel

    def load(kernel: BwdKernel, variant: BwdVariant, problem: Problem) -> Any:
        source = render_bwd_with(ALTERNATES[alt], kernel, variant, problem)
        return getattr(_load_module(source_hash(source), source), f"attn_bwd_{kernel}")

    serve.load_bwd_kernel = load  # type: ignore[assignment]
    try:
        yield DISPATCHERS.setdefault(alt, serve.Dispatcher())
    finally:
        serve.load_bwd_kernel = real  # type: ignore[assignment]


def _case(named: dict[str, Timed], dtype: str, d: int, n: int, causal: bool,
          rounds: int, dev: torch.device) -> list[str]:
    """One problem: each variant's median ratio to cuDNN's backward (or why not)."""
    b, h = max(1, TOKENS_PER_BATCH // n), 2048 // d
    problem = flashgen.Problem(b, h, h, n, n, d, dtype, causal)
    q, k, v = make_inputs(b, h, h, n, n, d, DTYPES[dtype], dev, seed=0)
    do = torch.randn_like(q)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    runs, cells = {}, {}
    for name, (variant, alt) in named.items():
        if variant is not None and (why := why_invalid_bwd(variant, problem, dev)):
            cells[name] = f"invalid: {why[:40]}"
            continue
        # The backward's kernels load when it first runs: this first call, in the context.
        with _rendered_from(alt) as dispatcher:
            out = flashgen.attention(*leaves, causal=causal, bwd_variant=variant,
                                     dispatcher=dispatcher)
            grads = torch.autograd.grad(out, leaves, do, retain_graph=True)
        # The reference on a slice keeps float64 within memory at N8k.
        check = compare_grads(tuple(g[:1, :2] for g in grads), q[:1, :2].detach(),
                              k[:1, :2].detach(), v[:1, :2].detach(), do[:1, :2], causal)
        if not check.ok:
            cells[name] = f"WRONG {check.reason[:40]}"
            continue
        runs[name] = (lambda o=out: torch.autograd.grad(o, leaves, do, retain_graph=True))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    cudnn = lambda: torch.autograd.grad(ref, leaves, do, retain_graph=True)
    ratios: dict[str, list[float]] = {name: [] for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        # Each variant right after a cuDNN timing of its own, and the order turned every round:
        # with one cuDNN timing a round and a fixed order, the same kernel read 0.83 and 0.96
        # in two columns of one run (H100, 2026-11-27).
        for name in order[r % len(order):] + order[:r % len(order)]:
            base = time_cuda(cudnn, dev, timer="wall").median_ms
            ms = time_cuda(runs[name], dev, timer="wall").median_ms
            ratios[name].append(base / ms)
            times[name].append(ms)
    for name in runs:
        cells[name] = (f"{statistics.median(ratios[name]):.3f} "
                       f"({statistics.median(times[name]):.3f} ms)")
    return [cells[name] for name in named]


if __name__ == "__main__":
    main()
