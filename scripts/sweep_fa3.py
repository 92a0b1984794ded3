"""Measure fa3 points on fa-bench cells next to cuDNN and the dispatched variant, in one process.

For each cell (fa-bench shapes at the given lengths and head dims, fp16 and bf16, causal and
not) every fa3 point is checked against the float64 reference on the gate shape and then
timed, exactly as the tuner does (`KernelBench.measure`), and printed as its ratio to SDPA's
cuDNN backend measured in the same run.

  python3 scripts/sweep_fa3.py --lens 512,2048,16384 --dims 128,64 --csv $OUT/fa3.csv
  python3 scripts/sweep_fa3.py --match 'p1,m128 n128 w4 s3' ...   (those points only)
"""

from __future__ import annotations

import argparse
import csv
import time

import torch

import flashgen
from flashgen.bench.competitors import COMPETITORS
from flashgen.kernels.fwd_space import why_invalid
from flashgen.kernels.presets import TOKENS_PER_BATCH
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import Variant
from flashgen.tune.fwd_bench import KernelBench, Measurement
from flashgen.tune.timing import tflops, time_cuda

POINTS = [Variant("fa3", 128, 128, 4, 3), Variant("fa3", 128, 128, 4, 2),
          Variant("fa3", 128, 64, 4, 3), Variant("fa3", 128, 64, 4, 4),
          Variant("fa3", 64, 64, 4, 2), Variant("fa3", 64, 128, 4, 2),
          Variant("fa3", 128, 128, 8, 2),
          # one program per SM, two consumers
          *(Variant("fa3", m, n, 4, s, programs_per_sm=1)
            for m, n, s in ((128, 128, 2), (128, 64, 3), (128, 128, 3), (128, 64, 4),
                            (64, 64, 3), (64, 64, 4), (64, 128, 2), (64, 128, 3), (128, 64, 2))),
          # one consumer of 128 rows (8 warps)
          *(Variant("fa3", 128, n, 8, s, programs_per_sm=1)
            for n, s in ((64, 2), (64, 3), (128, 2))),
          # three consumers (192 rows)
          *(Variant("fa3", 192, n, 4, s, programs_per_sm=1) for n in (128, 64) for s in (2, 3, 4)),
          # consumers taking turns at the tensor cores
          *(Variant("fa3", m, n, 4, s, programs_per_sm=1, pingpong=True)
            for m, n, s in ((128, 128, 2), (128, 64, 3), (192, 128, 3), (192, 64, 3))),
          # whole heads per program under the causal mask (head_units)
          *(Variant("fa3", 128, 128, 4, s, programs_per_sm=1, head_units=True) for s in (3, 2)),
          # head dim 256: 64-key tiles on a 2-stage ring, one-tile and persistent
          Variant("fa3", 128, 64, 4, 2),
          Variant("fa3", 128, 64, 4, 2, programs_per_sm=1, pingpong=True)]


def cudnn_ms(problem: Problem, bench: KernelBench) -> float:
    cudnn = COMPETITORS["sdpa-cudnn"].prepare(problem, bench.device).fn
    return time_cuda(lambda: cudnn(*bench.inputs), bench.device).median_ms


def finish(path: str, rows: list[dict[str, object]]) -> None:
    """Write `rows` as CSV to `path` (if given), then the line that dates the run."""
    if path and rows:
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"device {torch.cuda.get_device_name()} "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="512,2048,16384")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--csv", default="")
    ap.add_argument("--match", default="",
                    help="comma-separated substrings: only points whose name holds one, "
                         "e.g. 'p1,m128 n128 w4 s3'")
    a = ap.parse_args()
    wanted = [m for m in a.match.split(",") if m]
    points = [p for p in POINTS if not wanted or any(m in str(p) for m in wanted)]
    rows = []
    for d in (int(x) for x in a.dims.split(",")):
        for n in (int(x) for x in a.lens.split(",")):
            for dtype in a.dtypes.split(","):
                for causal in (False, True):
                    h = 2048 // d
                    problem = Problem(TOKENS_PER_BATCH // n, h, h, n, n, d, dtype, causal)
                    bench = KernelBench(problem, "cuda:0")
                    base = tflops(problem.flops(), cudnn_ms(problem, bench))
                    q, k, v = bench.inputs
                    dispatched = flashgen.explain(q, k, v, causal=causal).variant
                    t0 = time.time()
                    valid = [p for p in points if why_invalid(p, problem) is None]
                    failed = bench.compile([dispatched, *valid])  # on parallel threads
                    measured: list[tuple[str, Measurement]] = [
                        (f"dispatch {dispatched}", bench.measure(dispatched))]
                    measured += [(str(p), Measurement.failed(f"compile: {failed[p]}")
                                  if p in failed else bench.measure(p)) for p in valid]
                    cells = " ".join(
                        f"{name.replace('fa3 ', '')}:{(m.tflops or 0) / base:.2f}"
                        if m.status == "ok" else f"{name}:{m.status}({m.reason[:60]})"
                        for name, m in measured)
                    print(f"{problem} cuDNN {base:.0f} [{time.time() - t0:.0f}s] {cells}",
                          flush=True)
                    rows += [{"problem": str(problem), "variant": name, "status": m.status,
                              "tflops": round(m.tflops or 0, 1), "cudnn_tflops": round(base, 1),
                              "ratio_cudnn": round((m.tflops or 0) / base, 3),
                              "reason": m.reason[:200]} for name, m in measured]
    finish(a.csv, rows)


if __name__ == "__main__":
    main()
