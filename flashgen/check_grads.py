"""Gradient correctness against the reference, with a tolerance derived from the data.

The same idea as `flashgen.check` for the forward: the float64 autograd gradients of the
reference are the truth, and a kernel's gradient may be off by a small multiple of what the
same-dtype eager reference's autograd gets wrong on the same inputs, plus one rounding.
"""

from __future__ import annotations

import torch

from flashgen import reference
from flashgen.check import ERROR_FACTOR, CheckResult

GRAD_NAMES = ("dq", "dk", "dv")


def reference_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the reference attention computed in `dtype` (default: q's dtype)."""
    work = dtype or q.dtype
    leaves = [t.detach().to(work).requires_grad_(True) for t in (q, k, v)]
    out, _ = reference.attention(*leaves, causal=causal, scale=scale, dtype=work)
    out.backward(do.to(work))
    dq, dk, dv = (t.grad for t in leaves)
    assert dq is not None and dk is not None and dv is not None
    return dq, dk, dv


def compare_grads(
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
) -> CheckResult:
    """Compare a kernel's (dq, dk, dv) with the float64 reference gradients.

    Each gradient gets its own bound, ERROR_FACTOR x (eager error) + eps(dtype) x max|truth|;
    the result reports the gradient closest to (or furthest over) its bound.
    """
    for name, grad, like in zip(GRAD_NAMES, grads, (q, k, v), strict=True):
        if grad.shape != like.shape or grad.dtype != like.dtype:
            return CheckResult(
                False, float("inf"), 0.0,
                f"{name} is {tuple(grad.shape)} {grad.dtype}, "
                f"expected {tuple(like.shape)} {like.dtype}",
            )  # fmt: skip
        if not torch.isfinite(grad).all():
            return CheckResult(False, float("inf"), 0.0, f"{name} has NaN or Inf")
    truth = reference_grads(q, k, v, do, causal, scale, dtype=torch.float64)
    eager = reference_grads(q, k, v, do, causal, scale)
    worst = CheckResult(True, 0.0, 0.0)
    worst_ratio = -1.0
    for name, grad, t, e in zip(GRAD_NAMES, grads, truth, eager, strict=True):
        eager_err = (e.double() - t).abs().max().item()
        # One rounding of the gradient to its dtype is the least any implementation must make.
        rounding = torch.finfo(grad.dtype).eps * t.abs().max().item()
        bound = ERROR_FACTOR * eager_err + rounding
        err = (grad.double() - t).abs().max().item()
        ratio = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
        if ratio > 1:
            return CheckResult(
                False, err, bound,
                f"{name}: max error {err:.3g} over bound {bound:.3g} (eager {eager_err:.3g})",
            )  # fmt: skip
        if ratio > worst_ratio:
            worst_ratio = ratio
            worst = CheckResult(True, err, bound, f"closest to its bound: {name}")
    return worst
