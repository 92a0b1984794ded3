"""Gradient correctness against the reference, with a tolerance derived from the data.

The same idea as `flashgen.tune.check` for the forward: the float64 autograd gradients of the
reference are the truth, and a kernel's gradient may be off by a small multiple of what the
same-dtype eager reference's autograd gets wrong on the same inputs, plus one rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flashgen.tune.check import ERROR_FACTOR, CheckResult, reference_call

GRAD_NAMES = ("dq", "dk", "dv")


def reference_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    modifiers: Mapping[str, Any] | None = None,
    cu: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of the reference attention computed in `dtype` (default: q's dtype),
    with `modifiers` and packed offsets `cu` as `check.reference_call` takes them; dsinks
    follows where the modifiers have sinks."""
    work = dtype or q.dtype
    mods = dict(modifiers or {})
    leaves = [t.detach().to(work).requires_grad_(True) for t in (q, k, v)]
    if mods.get("sinks") is not None:
        mods["sinks"] = mods["sinks"].detach().to(work).requires_grad_(True)
        leaves.append(mods["sinks"])
    out, _ = reference_call(*leaves[:3], causal, scale, work, mods, cu)
    out.backward(do.to(work))
    grads = tuple(t.grad for t in leaves)
    assert all(g is not None for g in grads)
    return grads  # type: ignore[return-value]


def compare_grads(
    grads: tuple[torch.Tensor, ...],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    *,
    modifiers: Mapping[str, Any] | None = None,
    cu: tuple[Sequence[int], Sequence[int]] | None = None,
) -> CheckResult:
    """Compare a kernel's (dq, dk, dv) with the float64 reference gradients (and dsinks,
    the fourth, where `modifiers` have sinks; see `reference_grads`).

    Each gradient gets its own bound: ERROR_FACTOR x (its eager error) + a floor of one
    rounding and the LSE's allowed error (see below). The result reports the gradient
    closest to its bound, or the first one over it.
    """
    sinks = (modifiers or {}).get("sinks")
    names, likes = GRAD_NAMES, (q, k, v)
    if sinks is not None:
        names, likes = (*names, "dsinks"), (*likes, sinks)
    if len(grads) != len(names):
        return CheckResult(False, float("inf"), 0.0,
                           f"{len(grads)} gradients, expected {len(names)} ({', '.join(names)})")
    for name, grad, like in zip(names, grads, likes, strict=True):
        if grad.shape != like.shape or grad.dtype != like.dtype:
            return CheckResult(
                False, float("inf"), 0.0,
                f"{name} is {tuple(grad.shape)} {grad.dtype}, "
                f"expected {tuple(like.shape)} {like.dtype}",
            )  # fmt: skip
        if not torch.isfinite(grad).all():
            return CheckResult(False, float("inf"), 0.0, f"{name} has NaN or Inf")
    truth = reference_grads(q, k, v, do, causal, scale, torch.float64, modifiers, cu)
    eager = reference_grads(q, k, v, do, causal, scale, None, modifiers, cu)
    # The floor every implementation must allow: one rounding to the dtype, plus what a
    # correct LSE costs. The forward's LSE is held in fp32 and `check.compare` accepts it to
    # within 8 fp32 roundings of its size; P = exp(S - LSE) rebuilt from it inherits that as a
    # relative error, which in fp32 outweighs the dtype rounding (eager, which never stores an
    # LSE, is up to ~8x closer to the truth there) and in fp16/bf16 is negligible.
    # It is taken at the scale of the largest of the three gradients: they come out of one
    # computation (dS feeds dQ and dK, P feeds dV), and one of them can be ~0 by cancellation
    # while its terms are not (a single key: P = 1, so dS = dP - delta = 0 exactly in eager,
    # but only to within the LSE's error in a kernel that rebuilds P).
    _, truth_lse = reference_call(q, k, v, causal, scale, torch.float64, modifiers, cu)
    seen = torch.isfinite(truth_lse)
    lse_size = truth_lse[seen].abs().max().item() if seen.any() else 0.0
    relative = torch.finfo(q.dtype).eps + 8 * torch.finfo(torch.float32).eps * max(1.0, lse_size)
    rounding = relative * max(t.abs().max().item() for t in truth)
    worst = CheckResult(True, 0.0, 0.0)
    worst_ratio = -1.0
    for name, grad, t, e in zip(names, grads, truth, eager, strict=True):
        eager_err = (e.double() - t).abs().max().item()
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
