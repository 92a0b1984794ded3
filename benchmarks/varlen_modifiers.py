"""Issue 31's targets on a GPU: packed variable-length batches, sliding windows and softcap,
forward and forward+backward, in TFLOP/s of the work really done.

1. varlen: 16 sequences of seeded random lengths summing to 16k tokens (causal and full)
   against flashgen's dense kernel on the same token count (B16 N1024) and on a dense batch
   of equal FLOPs (B16, N = root mean square of the lengths). Target: within 5%.
2. window: a 4096-token causal window at N = 32k against torch.compile'd FlexAttention with
   a sliding-window block mask (target: at least 1.0x), and against flashgen's full causal
   kernel scaled by the FLOP ratio (target: within 10%).
3. softcap: the same causal call with and without softcap=30 (target: at most 10% slower).

Each flashgen result is first compared with an independent computation (per-sequence dense
flashgen for varlen, FlexAttention for the window, an eager softcap on a slice) and the max
difference printed. Run on the GPU machine (bf16, D128, 16 heads unless told otherwise):

    python3 benchmarks/varlen_modifiers.py --out docs/results-varlen.md
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable

import torch

import flashgen
from flashgen.tune.timing import time_cuda

DEVICE = torch.device("cuda")
TIMER = {"name": "wall"}  # --timer: "wall" (what an eager caller sees) or "gpu"


def causal_pairs(nq: int, nk: int, left: int = -1) -> int:
    """(query, key) pairs a bottom-right causal mask keeps, narrowed to `left` keys back."""
    total = 0
    for i in range(nq):
        at = i + nk - nq
        lo = 0 if left < 0 else max(0, at - left)
        total += max(0, min(nk - 1, at) - lo + 1)
    return total


def fwd_flops(pairs: int, heads: int, dim: int) -> float:
    return 4.0 * pairs * heads * dim


def timed(fn: Callable[[], torch.Tensor], grad: bool) -> float:
    """Median ms of `fn` (forward) or of forward + backward with a fixed upstream gradient."""
    if not grad:
        with torch.no_grad():
            return time_cuda(fn, DEVICE, timer=TIMER["name"]).median_ms
    out = fn()
    do = torch.randn_like(out)

    def step() -> None:
        fn().backward(do)

    return time_cuda(step, DEVICE, timer=TIMER["name"]).median_ms


def tflops(flops: float, ms: float, grad: bool) -> float:
    return (3.5 if grad else 1.0) * flops / (ms * 1e-3) / 1e12


def rand(*shape: int, dtype: torch.dtype, grad: bool) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(grad)


def lengths(total: int, count: int, seed: int) -> list[int]:
    """`count` positive lengths summing to `total`, seeded (uniform cut points)."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(total - 1, generator=gen)[: count - 1].add(1).tolist())
    edges = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(edges)]


def bench_varlen(heads: int, dim: int, dtype: torch.dtype, lines: list[str]) -> None:
    lens = lengths(16384, 16, seed=0)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    lines.append(f"varlen lengths: {lens}")
    rms = round(math.sqrt(sum(n * n for n in lens) / len(lens)))
    for causal in (True, False):
        for grad in (False, True):
            q, k, v = (rand(16384, heads, dim, dtype=dtype, grad=grad) for _ in range(3))
            pairs = sum(causal_pairs(n, n) if causal else n * n for n in lens)
            packed = lambda q=q, k=k, v=v, c=causal: flashgen.attention_varlen(
                q, k, v, cu, cu, max(lens), max(lens), causal=c)
            if not grad:  # an independent answer: each sequence alone, dense
                with torch.no_grad():
                    got = packed()
                    diff = max((got[a:b] - flashgen.attention(
                        q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                        v[a:b].transpose(0, 1)[None], causal=causal)[0].transpose(0, 1))
                        .abs().max().item() for a, b in itertools.pairwise(cu.tolist()))
                lines.append(f"varlen causal={causal}: max |packed - per-sequence dense| "
                             f"{diff:.3g}")
            ms = timed(packed, grad)
            row = [f"varlen 16 seqs causal={causal} {'fwd+bwd' if grad else 'fwd'}",
                   f"{tflops(fwd_flops(pairs, heads, dim), ms, grad):.1f}"]
            for label, n, b in (("same tokens", 1024, 16), ("equal FLOPs", rms, 16)):
                qd, kd, vd = (rand(b, heads, n, dim, dtype=dtype, grad=grad) for _ in range(3))
                dense = lambda qd=qd, kd=kd, vd=vd, c=causal: flashgen.attention(
                    qd, kd, vd, causal=c)
                dpairs = b * (causal_pairs(n, n) if causal else n * n)
                dt = tflops(fwd_flops(dpairs, heads, dim), timed(dense, grad), grad)
                row.append(f"dense {label} (B{b} N{n}) {dt:.1f}")
            lines.append(" | ".join(row))


def bench_window(heads: int, dim: int, dtype: torch.dtype, n: int, left: int,
                 lines: list[str]) -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def sliding(b: object, h: object, qi: torch.Tensor, kj: torch.Tensor) -> torch.Tensor:
        return (kj <= qi) & (qi - kj <= left)

    mask = create_block_mask(sliding, None, None, n, n, device=DEVICE)
    flex = torch.compile(flex_attention, dynamic=False)
    pairs = causal_pairs(n, n, left)
    full_pairs = causal_pairs(n, n)
    for grad in (False, True):
        q, k, v = (rand(1, heads, n, dim, dtype=dtype, grad=grad) for _ in range(3))
        ours = lambda q=q, k=k, v=v: flashgen.attention(
            q, k, v, causal=True, window=(left, -1))
        theirs = lambda q=q, k=k, v=v: flex(q, k, v, block_mask=mask)
        causal = lambda q=q, k=k, v=v: flashgen.attention(q, k, v, causal=True)
        if not grad:
            with torch.no_grad():
                diff = (ours() - theirs()).abs().max().item()
            lines.append(f"window {left} N{n}: max |flashgen - flex| {diff:.3g}")
        t_ours, t_flex, t_causal = (timed(f, grad) for f in (ours, theirs, causal))
        scaled = t_causal * pairs / full_pairs
        lines.append(
            f"window {left} N{n} {'fwd+bwd' if grad else 'fwd'} | flashgen "
            f"{tflops(fwd_flops(pairs, heads, dim), t_ours, grad):.1f} TFLOP/s {t_ours:.3f} ms"
            f" | flex {t_flex:.3f} ms (flashgen {t_flex / t_ours:.2f}x) | causal scaled by "
            f"FLOPs {scaled:.3f} ms (window/scaled {t_ours / scaled:.2f})")


def bench_softcap(heads: int, dim: int, dtype: torch.dtype, n: int, lines: list[str]) -> None:
    for grad in (False, True):
        q, k, v = (rand(4, heads, n, dim, dtype=dtype, grad=grad) for _ in range(3))
        capped = lambda q=q, k=k, v=v: flashgen.attention(
            q, k, v, causal=True, softcap=30.0)
        plain = lambda q=q, k=k, v=v: flashgen.attention(q, k, v, causal=True)
        if not grad:
            with torch.no_grad():
                s = slice(0, 256)
                qs, ks, vs = q[:1, :2, s].float(), k[:1, :2, s].float(), v[:1, :2, s].float()
                scores = 30.0 * torch.tanh(qs @ ks.transpose(-1, -2) / math.sqrt(dim) / 30.0)
                keep = torch.ones(256, 256, device=DEVICE, dtype=torch.bool).tril()
                eager = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ vs
                got = flashgen.attention(q[:1, :2, s], k[:1, :2, s], v[:1, :2, s],
                                         causal=True, softcap=30.0)
                lines.append(f"softcap: max |flashgen - eager fp32| "
                             f"{(got.float() - eager).abs().max().item():.3g}")
        t_cap, t_plain = timed(capped, grad), timed(plain, grad)
        lines.append(f"softcap B4 N{n} {'fwd+bwd' if grad else 'fwd'} | {t_cap:.3f} ms vs "
                     f"{t_plain:.3f} ms without: {100 * (t_cap / t_plain - 1):+.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--window-n", type=int, default=32768)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--softcap-n", type=int, default=8192)
    parser.add_argument("--only", default="varlen,window,softcap")
    parser.add_argument("--timer", default="wall", choices=("wall", "gpu"),
                        help="wall: back-to-back calls, host cost included (default); gpu: "
                        "calls queued behind a spin, GPU time only")
    parser.add_argument("--out", help="also write the lines to this file")
    args = parser.parse_args()
    TIMER["name"] = args.timer
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    lines = [f"{torch.cuda.get_device_name()} {args.dtype} D{args.dim} H{args.heads}, "
             f"{args.timer} timer"]
    only = args.only.split(",")
    if "varlen" in only:
        bench_varlen(args.heads, args.dim, dtype, lines)
    if "window" in only:
        bench_window(args.heads, args.dim, dtype, args.window_n, args.window, lines)
    if "softcap" in only:
        bench_softcap(args.heads, args.dim, dtype, args.softcap_n, lines)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as handle:
            handle.write(text + "\n\n")


if __name__ == "__main__":
    main()
