"""FP8 attention emulated in fp32 on the CPU: what an fp8 kernel computes, without one.

The kernel's inputs are fp8 values times their descales; its products accumulate in fp32;
FlashAttention 3 also rounds the probability tile P to fp8 for the P V product. Emulating
exactly that gives (a) the accuracy of each quantization scheme (docs/fp8.md) and (b) the
same-dtype error that the tuner's gate scales into an fp8 bound (`check.fp8_bound`), as
eager attention in the input dtype does for the other dtypes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from flashgen.runtime.quantize import FP8_DTYPE, QUANT_BLOCK, Quantized, dequantize, quantize
from flashgen.tune import reference


class Scheme(NamedTuple):
    """One way to quantize: rows per scale (None: per tensor) and the Hadamard rotation."""

    name: str
    block: int | None
    incoherent: bool


#: The three schemes the accuracy table compares, baseline first.
SCHEMES: tuple[Scheme, ...] = (
    Scheme("per-tensor", None, False),
    Scheme("block", QUANT_BLOCK, False),
    Scheme("block + incoherent", QUANT_BLOCK, True),
)


def outlier_inputs(batch: int, heads: int, seq: int, head_dim: int, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention 3's accuracy inputs, float64: N(0, 1) + N(0, 100) * Bernoulli(0.001),
    i.e. about one value in a thousand gets an outlier of standard deviation 10 added."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def one() -> torch.Tensor:
        shape = (batch, heads, seq, head_dim)
        base = torch.randn(shape, generator=gen, dtype=torch.float64)
        spikes = torch.randn(shape, generator=gen, dtype=torch.float64) * 10.0
        hit = torch.rand(shape, generator=gen, dtype=torch.float64) < 0.001
        return base + spikes * hit

    return one(), one(), one()


def emulate_fp8_attention(qz: Quantized, causal: bool = False, scale: float | None = None, *,
                          block: int | None = QUANT_BLOCK, p_fp8: bool = True) -> torch.Tensor:
    """Attention of the dequantized inputs in fp32, as an fp8 kernel computes it. With `p_fp8`
    the unnormalised probabilities exp(s - rowmax), all in [0, 1], are rounded to fp8 before
    the P V product, while the row sums stay fp32 (the kernel sums P before converting it).
    One row max over all keys stands in for the kernel's running max: both keep P <= 1.
    A query that sees no key gets output 0. Returns fp32 (B, Hq, Nq, D)."""
    q, k, v = (dequantize(t, d, block) for t, d in ((qz.q, qz.descale_q),
                                                     (qz.k, qz.descale_k),
                                                     (qz.v, qz.descale_v)))
    if not p_fp8:
        return reference.attention(q, k, v, causal, scale)[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        keep = reference.visible(q.shape[2], k.shape[2], causal, device=q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    seen = torch.isfinite(top)
    p = torch.exp(scores - torch.where(seen, top, 0.0))
    total = p.sum(dim=-1, keepdim=True)
    out = (p.to(FP8_DTYPE).float() @ v) / torch.where(seen, total, 1.0)
    return out.masked_fill(~seen, 0.0)


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def scheme_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: Scheme, *,
                 causal: bool = False, p_fp8: bool = False, seed: int = 0,
                 truth: torch.Tensor | None = None) -> float:
    """RMSE of `scheme`'s emulated fp8 attention against the float64 reference of the
    unquantized inputs (`truth`, if already computed; power-of-two head dims: no padding
    to undo)."""
    if truth is None:
        truth = reference.attention(q, k, v, causal, dtype=torch.float64)[0]
    qz = quantize(q, k, v, block=scheme.block, incoherent=scheme.incoherent, seed=seed)
    out = emulate_fp8_attention(qz, causal, block=scheme.block, p_fp8=p_fp8)
    return rmse(out, truth)
