"""The public call: `flashgen.attention`."""

from __future__ import annotations

import torch

from flashgen.forward import run_forward
from flashgen.hardware import device_info
from flashgen.problem import Problem
from flashgen.space import default_variant, why_invalid
from flashgen.validate import check_inputs, check_runnable
from flashgen.variant import Variant


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    variant: Variant | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention softmax(q k^T * scale) v with q (B, Hq, Nq, D) and k, v (B, Hkv, Nk, D).

    k and v may have fewer heads than q (GQA/MQA; Hq % Hkv == 0). Causal masking is aligned
    bottom-right when Nq != Nk. Any strides are accepted, e.g. a (B, N, H, D) tensor transposed
    to (B, H, N, D). With `variant=` exactly that variant runs (an invalid one is an error,
    never a silent fallback); without it, a default variant for the problem.
    Returns the output (like q), and with `return_lse` also the log-sum-exp (B, Hq, Nq) fp32.
    """
    check_inputs(q, k, v)
    problem = Problem.from_tensors(q, k, v, causal)
    device = device_info(q.device)
    if variant is None:
        variant = default_variant(problem, device)
    else:
        if not isinstance(variant, Variant):
            raise TypeError(f"variant must be a flashgen.Variant, got {type(variant).__name__}")
        reason = why_invalid(variant, problem, device)
        if reason:
            raise ValueError(f"variant {variant} is invalid for {problem}: {reason}")
    check_runnable(q.device)
    out, lse = run_forward(q, k, v, variant, problem, scale)
    return (out, lse) if return_lse else out
