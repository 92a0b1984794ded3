"""Where does a backward case spend its time? Compile vs run, kernel by kernel.

Debug aid for GPU sessions (not part of the test suite): runs one backward problem with every
kernel compiled first (`warmup`) and then launched and synchronised, printing timestamps, so a
stall shows up as the last line printed. Run each case under `timeout`.
  python3 scripts/diag_bwd.py --d 128 --causal --dtype fp32 --tile 32,64,4,1
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import flashgen
import flashgen.serve as backward
from flashgen.kernels.bwd_variant import BwdVariant

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.2f}s] {msg}", flush=True)


class _Timed:
    """Stands in for a JIT kernel: compile (warmup), then launch and synchronise, timed."""

    def __init__(self, name: str, kernel: Any) -> None:
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            log(f"{self.name}: compile start (grid {grid})")
            self.kernel.warmup(*args, grid=grid, **kwargs)
            log(f"{self.name}: compiled; launch")
            self.kernel[grid](*args, **kwargs)
            torch.cuda.synchronize()
            log(f"{self.name}: finished")

        return launch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tile", default="32,64,4,1", help="block_m,block_n,warps,stages")
    a = ap.parse_args()
    bm, bn, w, s = (int(x) for x in a.tile.split(","))
    variant = BwdVariant(bm, bn, w, s)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    problem = flashgen.Problem(1, 8, 2, a.n, a.n, a.d, a.dtype, a.causal)
    log(f"{problem} {variant}")
    real = backward.load_bwd_kernel
    backward.load_bwd_kernel = lambda kind, v, p: _Timed(kind, real(kind, v, p))  # type: ignore[assignment]
    backward.check_supported = lambda *_: None  # type: ignore[assignment]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, a.n, a.d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, 2, a.n, a.d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(1, 2, a.n, a.d, device="cuda", dtype=dtype, generator=g)
    do = torch.randn_like(q)
    log("forward")
    o, lse = flashgen.attention(q, k, v, causal=a.causal, return_lse=True)
    torch.cuda.synchronize()
    log("forward done")
    dq, dk, dv = backward.run_backward(do, q, k, v, o, lse, variant, problem)
    torch.cuda.synchronize()
    log(f"backward done: |dq| {dq.abs().max().item():.3g} |dk| {dk.abs().max().item():.3g}")
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    kr = ref[1].repeat_interleave(4, 1)
    vr = ref[2].repeat_interleave(4, 1)
    out = torch.nn.functional.scaled_dot_product_attention(ref[0], kr, vr, is_causal=a.causal)
    out.backward(do.double())
    for name, mine, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, strict=True):
        log(f"{name} max err vs float64 {(mine.double() - r.grad).abs().max().item():.3g}")
    sys.exit(0)


if __name__ == "__main__":
    main()
