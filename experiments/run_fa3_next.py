"""Check and time `experiments/fa3_next.py` (ping-pong, persistent grid) against the template.

Without a GPU it compiles every configuration for sm90a and prints ptxas's registers and
spills (run it without TRITON_INTERPRET). With one (Hopper) it first checks every
configuration against the float64 reference on ragged, GQA and Nq != Nk shapes, then times
the ones that passed on fa-bench cells next to SDPA's cuDNN backend and flashgen's fa3
template (`Variant("fa3", 128, 128, 4, 3)`), all in one process, and prints ratios to cuDNN.
A configuration that fails its check is reported and never timed.

  python3 experiments/run_fa3_next.py --csv $OUT/fa3_next.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fa3_next

import flashgen
from flashgen.check import compare, make_inputs
from flashgen.forward import _gluon_descriptor
from flashgen.gluon_compile import compile_gluon, example_args, ptxas_report
from flashgen.presets import TOKENS_PER_BATCH
from flashgen.problem import Problem
from flashgen.timing import tflops, time_cuda

#: (name, block_m, block_n, stages, warps, pingpong, persistent)
CONFIGS = [
    ("base", 128, 128, 2, 4, False, False),
    ("pingpong", 128, 128, 2, 4, True, False),
    ("persistent", 128, 128, 2, 4, False, True),
    ("pp+persist", 128, 128, 2, 4, True, True),
    ("pp+persist n64 s3", 128, 64, 3, 4, True, True),
]
SHAPES = [(1, 4, 4, 300, 300, 128), (2, 6, 2, 257, 520, 128), (1, 2, 1, 700, 333, 64),
          (2, 3, 3, 1024, 1024, 64), (1, 2, 2, 33, 33, 64)]


def fits(cfg: tuple, d: int) -> bool:
    """Shared memory: Q and O per consumer, K and V per stage."""
    _, bm, bn, st, _, _, _ = cfg
    return 2 * d * (2 * bm + 2 * bn * st) <= 232448 - 1024


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: tuple,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _, bm, bn, st, w, pingpong, persistent = cfg
    b, h, nq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, nq), device=q.device, dtype=torch.float32)
    tiles = -(-nq // bm) * b * h
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    grid = (min(tiles, sms) if persistent else tiles,)
    rows = 16 * w
    fa3_next.attn_fwd[grid](
        _gluon_descriptor(q, rows), _gluon_descriptor(k, bn), _gluon_descriptor(v, bn),
        _gluon_descriptor(out, rows), lse, lse.stride(0), lse.stride(1), d ** -0.5, nq,
        k.shape[2], h, h // k.shape[1], b * h, BLOCK_M=bm, BLOCK_N=bn, STAGES=st, BLOCK_D=d,
        CAUSAL=causal, PINGPONG_ON=pingpong, num_warps=w)
    return out, lse


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def compile_only() -> None:
    for cfg in CONFIGS:
        for d in (64, 128):
            if not fits(cfg, d):
                continue
            for causal in (False, True):
                name, bm, bn, st, w, pingpong, _ = cfg
                args = [*example_args(d, torch.bfloat16, 16 * w, bn), 8]
                consts = {"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": st, "BLOCK_D": d,
                          "CAUSAL": causal, "PINGPONG_ON": pingpong}
                kernel = compile_gluon(fa3_next.attn_fwd, args, consts, w)
                print(f"{name:18s} D{d} causal={causal!s:5s} shared={kernel.metadata.shared} "
                      f"{' | '.join(ptxas_report(kernel.asm['ptx']))}", flush=True)


def on_gpu(csv_path: str) -> None:
    bad = set()
    for shape in SHAPES:
        for dtype in (torch.float16, torch.bfloat16):
            q, k, v = make_inputs(*shape, dtype, "cuda", seed=sum(shape))
            for causal in (False, True):
                for cfg in CONFIGS:
                    if not fits(cfg, shape[-1]):
                        continue
                    try:
                        out, lse = launch(q, k, v, cfg, causal)
                        torch.cuda.synchronize()
                        check = compare(out, q, k, v, causal, None, lse)
                        ok, why = check.ok, check.reason
                    except Exception as exc:  # a failed configuration is data
                        ok, why = False, f"{type(exc).__name__}: {str(exc)[:200]}"
                    if not ok:
                        bad.add(cfg[0])
                        print(f"CHECK FAILED {cfg[0]} {shape} {dtype} causal={causal}: {why}",
                              flush=True)
    print(f"checks done; failed: {sorted(bad) or 'none'}", flush=True)
    template = flashgen.Variant("fa3", 128, 128, 4, 3)
    rows = []
    for d in (128, 64):
        for n in (512, 2048, 16384):
            for causal in (False, True):
                h = 2048 // d
                p = Problem(TOKENS_PER_BATCH // n, h, h, n, n, d, "fp16", causal)
                qkv = make_inputs(p.batch, h, h, n, n, d, torch.float16, "cuda", seed=n)
                calls = {
                    "cudnn": lambda x=qkv, c=causal: cudnn(*x, c),
                    "template": lambda x=qkv, c=causal: flashgen.attention(
                        *x, causal=c, variant=template),
                } | {cfg[0]: (lambda x=qkv, c=causal, f=cfg: launch(*x, f, c))
                     for cfg in CONFIGS if cfg[0] not in bad and fits(cfg, d)}
                res = {name: time_cuda(call, qkv[0].device).median_ms
                       for name, call in calls.items()}
                print(f"{p}: " + " ".join(f"{name}:{res['cudnn'] / ms:.2f}"
                                          for name, ms in res.items()), flush=True)
                rows += [{"problem": str(p), "impl": name, "ms": ms,
                          "tflops": tflops(p.flops(), ms), "x_cudnn": res["cudnn"] / ms}
                         for name, ms in res.items()]
    if csv_path and rows:
        with open(csv_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"device {torch.cuda.get_device_name()} "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", default="")
    ap.add_argument("--compile-only", action="store_true", help="even where a GPU is present")
    a = ap.parse_args()
    if torch.cuda.is_available() and not a.compile_only:
        on_gpu(a.csv)
    else:
        compile_only()


if __name__ == "__main__":
    main()
