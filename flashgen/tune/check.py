"""Correctness against the reference, with a tolerance derived from the data.

A kernel's output is compared with the float64 reference. The allowed error is a small multiple
of the error that the same-dtype eager reference makes on the same inputs: that is how far an
honest implementation in this dtype can land, measured rather than guessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashgen.runtime.quantize import QUANT_BLOCK, Quantized, dequantize
from flashgen.tune import reference
from flashgen.tune.emulation import emulate_fp8_attention

#: A kernel may be this many times worse than eager attention in the same dtype. Kernels
#: accumulate in fp32 and usually beat eager; the slack covers a different summation order
#: and the P tile being rounded to the input dtype before the second matmul.
ERROR_FACTOR = 4.0


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    error: float  # max |kernel - float64 reference|
    bound: float  # the allowed error
    reason: str = ""


def make_inputs(
    batch: int,
    heads_q: int,
    heads_kv: int,
    seq_q: int,
    seq_k: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    layout: str = "bhnd",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random q, k, v from a seeded generator, in (B, H, N, D) or (B, N, H, D) memory.

    The "bnhd" layout allocates (B, N, H, D), as transformers does, and returns (B, H, N, D)
    views of it, so kernels must honour strides.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def one(heads: int, seq: int) -> torch.Tensor:
        if layout == "bnhd":
            t = torch.randn(batch, seq, heads, head_dim, generator=gen)
            return t.to(device=device, dtype=dtype).transpose(1, 2)
        if layout != "bhnd":
            raise ValueError(f"unknown layout {layout!r}; use 'bhnd' or 'bnhd'")
        return torch.randn(batch, heads, seq, head_dim, generator=gen).to(
            device=device, dtype=dtype
        )

    return one(heads_q, seq_q), one(heads_kv, seq_k), one(heads_kv, seq_k)


def compare(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    lse: torch.Tensor | None = None,
    *,
    modifiers: Mapping[str, Any] | None = None,
    cu: tuple[Sequence[int], Sequence[int]] | None = None,
) -> CheckResult:
    """Compare a kernel's output (and optionally LSE) with the float64 reference; with
    `modifiers` (window, softcap, sinks as `reference.attention` takes them) and, for packed
    q, k, v, the offsets `cu`, the reference computes the same modified call."""
    if not torch.isfinite(out).all():
        return CheckResult(False, float("inf"), 0.0, "output has NaN or Inf")
    truth, truth_lse = reference_call(q, k, v, causal, scale, torch.float64, modifiers, cu)
    eager, eager_lse = reference_call(q, k, v, causal, scale, None, modifiers, cu)
    eager_err = (eager.double() - truth).abs().max().item()
    # One rounding of the output to its dtype is the least any implementation must make.
    rounding = torch.finfo(out.dtype).eps * truth.abs().max().item()
    bound = ERROR_FACTOR * eager_err + rounding
    err = (out.double() - truth).abs().max().item()
    if err > bound:
        return CheckResult(
            False, err, bound, f"max error {err:.3g} over bound {bound:.3g} (eager {eager_err:.3g})"
        )
    if lse is not None:
        seen = torch.isfinite(truth_lse)
        if not torch.equal(torch.isfinite(lse), seen):
            return CheckResult(False, err, bound, "log-sum-exp finite where it should not be")
        # Same derivation as the output: a multiple of eager's own LSE error, plus a few fp32
        # roundings of the LSE's size (kernels keep it in fp32 whatever the input dtype).
        lse_err = _max_abs(lse.double() - truth_lse, seen)
        eager_lse_err = _max_abs(eager_lse.double() - truth_lse, seen)
        lse_floor = 8 * torch.finfo(torch.float32).eps * max(1.0, _max_abs(truth_lse, seen))
        lse_bound = ERROR_FACTOR * eager_lse_err + lse_floor
        if lse_err > lse_bound:
            return CheckResult(
                False, err, bound, f"log-sum-exp error {lse_err:.3g} over bound {lse_bound:.3g}"
            )
    return CheckResult(True, err, bound)


def reference_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
    dtype: torch.dtype | None, modifiers: Mapping[str, Any] | None = None,
    cu: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.attention`, or `attention_varlen` where `cu` gives packed offsets."""
    mods = dict(modifiers or {})
    if cu is not None:
        return reference.attention_varlen(q, k, v, *cu, causal, scale, dtype, **mods)
    return reference.attention(q, k, v, causal, scale, dtype, **mods)


def _fp8_truth_and_bound(qz: Quantized, out_dtype: torch.dtype, causal: bool,
                         scale: float | None, block: int | None
                         ) -> tuple[torch.Tensor, float, float]:
    """The float64 truth of fp8 inputs (attention of their dequantized values: what the
    kernel was given), the bound, and the emulation's own error."""
    q, k, v = (dequantize(t, d, block) for t, d in ((qz.q, qz.descale_q),
                                                     (qz.k, qz.descale_k),
                                                     (qz.v, qz.descale_v)))
    truth = reference.attention(q, k, v, causal, scale, dtype=torch.float64)[0]
    # fp8's "same-dtype eager": fp32 products with P rounded to fp8, as an fp8 kernel does.
    emulated = emulate_fp8_attention(qz, causal, scale, block=block, p_fp8=True)
    emulated_err = (emulated.double() - truth).abs().max().item()
    rounding = torch.finfo(out_dtype).eps * truth.abs().max().item()
    return truth, ERROR_FACTOR * emulated_err + rounding, emulated_err


def fp8_bound(qz: Quantized, out_dtype: torch.dtype = torch.bfloat16, causal: bool = False,
              scale: float | None = None, block: int | None = QUANT_BLOCK) -> float:
    """The largest error an fp8 kernel's output (in `out_dtype`) may have on inputs `qz`,
    against the float64 attention of their dequantized values: `ERROR_FACTOR` times the
    error of the fp32 emulation with P in fp8 (`emulation.emulate_fp8_attention`), plus one
    rounding to `out_dtype`. The same derivation `compare` makes from same-dtype eager: the
    inputs' own quantization error is not the kernel's and is not counted."""
    return _fp8_truth_and_bound(qz, out_dtype, causal, scale, block)[1]


def compare_fp8(out: torch.Tensor, qz: Quantized, causal: bool = False,
                scale: float | None = None, block: int | None = QUANT_BLOCK) -> CheckResult:
    """`compare` for an fp8 kernel's output on quantized inputs `qz` (`fp8_bound`)."""
    if not torch.isfinite(out).all():
        return CheckResult(False, float("inf"), 0.0, "output has NaN or Inf")
    truth, bound, emulated_err = _fp8_truth_and_bound(qz, out.dtype, causal, scale, block)
    err = (out.double() - truth).abs().max().item()
    if err > bound:
        return CheckResult(False, err, bound, f"max error {err:.3g} over fp8 bound {bound:.3g} "
                                              f"(fp8 emulation {emulated_err:.3g})")
    return CheckResult(True, err, bound)


def _max_abs(t: torch.Tensor, where: torch.Tensor) -> float:
    return t[where].abs().max().item() if where.any() else 0.0
