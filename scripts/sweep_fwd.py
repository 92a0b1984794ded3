"""Measure a block of the forward search space exhaustively on one problem, next to cuDNN.

The tuner samples a few points of a large space per problem; this script answers "is there
a better point the tuner did not reach?" by measuring every valid non-persistent fa2 point
with the given tile sizes and warps (each one checked against the reference first, as in
tuning), plus the fastest of them compiled with a register cap (`--maxnreg`, a Triton compile
option) so two programs fit on one SM. It prints the points fastest first with their ratio
to SDPA's cuDNN backend and the dispatched variant, and writes a CSV.

  python3 scripts/sweep_fwd.py 1,16,16,16384,16384,128 --causal --csv $OUT/sweep.csv
"""

from __future__ import annotations

import argparse
import csv
import itertools
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen.kernels.fwd_space import why_invalid
from flashgen.kernels.hardware import device_info
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import load_kernel
from flashgen.kernels.variant import Variant
from flashgen.runtime.forward import default_scale, fa2_grid
from flashgen.tune.check import compare, make_inputs
from flashgen.tune.fwd_bench import KernelBench, Measurement
from flashgen.tune.timing import tflops, time_cuda


def candidates(problem: Problem, blocks_m: list[int], blocks_n: list[int],
               warps: list[int]) -> list[Variant]:
    dev = device_info(torch.device("cuda:0"))
    out = []
    for bm, bn, w, s, ws, tma in itertools.product(
            blocks_m, blocks_n, warps, (2, 3, 4), (False, True), (False, True)):
        v = Variant("fa2", bm, bn, w, s, True, ws, tma, 0)
        if why_invalid(v, problem, dev) is None:
            out.append(v)
    return out


def capped(bench: KernelBench, variant: Variant, maxnreg: int) -> Measurement:
    """`variant` (no TMA) compiled with a register cap, gated on the bench's gate problem."""
    kernels: dict[Problem, object] = {}

    def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Problem):
        kernel = kernels.setdefault(p, load_kernel(variant, p))
        b, hq, nq, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
        kernel[fa2_grid(variant, nq, b * hq, q.device)](
            q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            *lse.stride()[:2], default_scale(p.head_dim), nq, k.shape[2], hq, p.group,
            num_warps=variant.num_warps, num_stages=variant.num_stages, maxnreg=maxnreg,
        )  # fmt: skip
        return out, lse

    gq, gk, gv = make_inputs(
        bench.gate.batch, bench.gate.heads_q, bench.gate.heads_kv, bench.gate.seq_q,
        bench.gate.seq_k, bench.gate.head_dim, bench.gate.torch_dtype, bench.device, 7)
    try:
        out, lse = launch(gq, gk, gv, bench.gate)
    except Exception as exc:  # a failed point is data
        return Measurement.failed(f"{type(exc).__name__}: {exc}"[:200])
    check = compare(out, gq, gk, gv, bench.problem.causal, None, lse)
    if not check.ok:
        return Measurement.failed(f"wrong answer: {check.reason}")
    q, k, v = bench.inputs
    timing = time_cuda(lambda: launch(q, k, v, bench.problem), bench.device)
    return Measurement("ok", timing=timing,
                       tflops=tflops(bench.problem.flops(), timing.median_ms))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--block-m", default="64,128,256")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--maxnreg", default="", help="register caps to try on non-TMA points")
    ap.add_argument("--maxnreg-top", type=int, default=6,
                    help="how many of the fastest uncapped non-TMA points get each cap")
    ap.add_argument("--csv", default="")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]
    b, hq, hkv, nq, nk, d = ints(a.shape)
    problem = Problem(b, hq, hkv, nq, nk, d, a.dtype, a.causal)
    bench = KernelBench(problem, "cuda:0")
    q, k, v = bench.inputs
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn_ms = time_cuda(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=a.causal), bench.device
        ).median_ms
    cudnn = tflops(problem.flops(), cudnn_ms)
    choice = flashgen.explain(q, k, v, causal=a.causal)
    points = candidates(problem, ints(a.block_m), ints(a.block_n), ints(a.warps))
    t0 = time.time()
    failures = bench.compile(points)
    print(f"{problem}: {len(points)} points compiled in {time.time() - t0:.0f} s, "
          f"{len(failures)} failed; cuDNN {cudnn:.0f} TFLOP/s; dispatch: {choice.variant}",
          flush=True)
    rows: list[tuple[Variant, str, Measurement]] = []

    def keep(v: Variant, cap: str, m: Measurement) -> None:
        rows.append((v, cap, m))
        print(f"    {v}{f' maxnreg={cap}' if cap else ''}: {m.status} {m.tflops or 0:.0f} "
              f"{m.reason[:80]}", flush=True)

    for v in points:
        keep(v, "", Measurement.failed(failures[v]) if v in failures else bench.measure(v))
    ranked = sorted((r for r in rows if r[2].status == "ok" and not r[0].use_tma),
                    key=lambda r: -(r[2].tflops or 0))
    for cap in ints(a.maxnreg):
        for v, _, _ in ranked[:a.maxnreg_top]:
            keep(v, str(cap), capped(bench, v, cap))
    rows.sort(key=lambda r: -(r[2].tflops or 0))
    with open(a.csv or "/dev/null", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["problem", "variant", "maxnreg", "status", "tflops", "ratio_cudnn",
                    "reason", "dispatched"])
        for v, cap, m in rows:
            w.writerow([str(problem), str(v), cap, m.status, f"{m.tflops or 0:.1f}",
                        f"{(m.tflops or 0) / cudnn:.3f}", m.reason[:120],
                        v == choice.variant])
    for v, cap, m in rows[:15]:
        flag = " <- dispatched" if v == choice.variant and not cap else ""
        print(f"  {v!s:38s} {cap:>4s} {m.status:6s} {m.tflops or 0:6.0f} TFLOP/s "
              f"{(m.tflops or 0) / cudnn:5.2f}x cuDNN{flag}", flush=True)

if __name__ == "__main__":
    main()
