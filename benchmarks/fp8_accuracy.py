"""Issue 32's accuracy table: RMSE of fp8 attention against the float64 reference on
FlashAttention 3's outlier inputs (q, k, v ~ N(0, 1) + N(0, 100) * Bernoulli(0.001)).

Three quantizations (per-tensor, block of 128 rows, block + random Hadamard rotation of Q
and K), each followed by attention of the dequantized values in fp32 (`tune/emulation.py`),
with P kept in fp32 and with P rounded to fp8 as FA3 does. One row per (D, N) shape, the RMSE
averaged over the seeds; the last columns are per-tensor over block + incoherent. A bf16 row
(inputs rounded to bf16, fp32 products) shows where 16-bit inputs land. CPU only:

    python3 benchmarks/fp8_accuracy.py                     # the table in docs/fp8.md
    python3 benchmarks/fp8_accuracy.py --seq 1024 --dim 128 --seeds 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flashgen.tune import reference
from flashgen.tune.emulation import SCHEMES, outlier_inputs, rmse, scheme_error


def bf16_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, truth: torch.Tensor
               ) -> float:
    """RMSE of fp32 attention on inputs rounded to bf16: the 16-bit baseline."""
    rounded = [t.bfloat16().float() for t in (q, k, v)]
    return rmse(reference.attention(*rounded)[0], truth)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    parser.add_argument("--dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()

    names = [s.name for s in SCHEMES]
    head = ["D", "N", "bf16", *(f"{n}, P fp32" for n in names), *(f"{n}, P fp8" for n in names),
            "ratio, P fp32", "ratio, P fp8"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for d in args.dim:
        for n in args.seq:
            cells: dict[str, list[float]] = {}
            for seed in range(args.seeds):
                q, k, v = outlier_inputs(args.batch, args.heads, n, d, seed=seed)
                truth = reference.attention(q, k, v, dtype=torch.float64)[0]
                cells.setdefault("bf16", []).append(bf16_error(q, k, v, truth))
                for p_fp8 in (False, True):
                    for s in SCHEMES:
                        err = scheme_error(q, k, v, s, p_fp8=p_fp8, seed=seed, truth=truth)
                        cells.setdefault(f"{s.name}, P {'fp8' if p_fp8 else 'fp32'}",
                                         []).append(err)
            mean = {key: statistics.fmean(vals) for key, vals in cells.items()}
            ratios = [mean[f"{names[0]}, P {p}"] / mean[f"{names[-1]}, P {p}"]
                      for p in ("fp32", "fp8")]
            row = [str(d), str(n), *(f"{mean[h]:.2e}" for h in head[2:-2]),
                   *(f"{r:.2f}x" for r in ratios)]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
