"""The public calls: `flashgen.attention` and `flashgen.explain`."""

from __future__ import annotations

import torch

from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.variant import Variant
from flashgen.runtime import ops
from flashgen.runtime.dispatch import Choice, Dispatcher, default_dispatcher


def _needs_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Autograd is needed (under torch.compile always: the registered op; in eager mode when
    an input requires grad: `ops.EagerAttention`); eager inference calls the dispatcher."""
    if torch.compiler.is_compiling():
        return True
    if not torch.is_grad_enabled():
        return False
    try:
        return q.requires_grad or k.requires_grad or v.requires_grad
    except AttributeError:  # not tensors: the input checks raise the TypeError
        return False


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    variant: Variant | None = None,
    bwd_variant: BwdVariant | None = None,
    dispatcher: Dispatcher | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention softmax(q k^T * scale) v with q (B, Hq, Nq, D) and k, v (B, Hkv, Nk, D).

    k and v may have fewer heads than q (GQA/MQA; Hq % Hkv == 0). Causal masking is aligned
    bottom-right when Nq != Nk. Any strides are accepted, e.g. a (B, N, H, D) tensor transposed
    to (B, H, N, D). Without `variant=` the tuned winner for this GPU and shape runs (see
    `explain`); with it exactly that variant runs (an invalid one is an error, never a silent
    fallback). `dispatcher` picks the databases (default: user, then shipped); under
    torch.compile the shared default dispatcher decides.
    Differentiable: the backward recomputes attention block by block from the saved
    log-sum-exp (`bwd_variant=` picks its kernels, else the tuned or default ones); no
    gradient flows through the returned log-sum-exp.
    Returns the output (like q), and with `return_lse` also the log-sum-exp (B, Hq, Nq) fp32.
    """
    if _needs_op(q, k, v):
        if variant is not None and not isinstance(variant, Variant):
            raise TypeError(f"variant must be a flashgen.Variant, got {type(variant).__name__}")
        if bwd_variant is not None and not isinstance(bwd_variant, BwdVariant):
            raise TypeError(
                f"bwd_variant must be a flashgen.BwdVariant, got {type(bwd_variant).__name__}"
            )
        if not torch.compiler.is_compiling():
            out, lse = ops.EagerAttention.apply(q, k, v, causal, scale, variant, bwd_variant,
                                                dispatcher or default_dispatcher())
            return (out, lse) if return_lse else out
        text = variant.to_json() if variant is not None else ""
        bwd_text = bwd_variant.to_json() if bwd_variant is not None else ""
        out, lse = ops.attention_fwd(q, k, v, causal, scale, text, bwd_text)
    else:
        out, lse = (dispatcher or default_dispatcher()).forward(q, k, v, causal, scale, variant)
    return (out, lse) if return_lse else out


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    variant: Variant | None = None,
    bwd_variant: BwdVariant | None = None,
    dispatcher: Dispatcher | None = None,
) -> Choice:
    """Which variant `attention` would run for these inputs, why (exact hit, nearest bucket,
    fallback, explicit) and from which database row; its `backward` answers the same for the
    backward pass. `print()` it for a short answer."""
    return (dispatcher or default_dispatcher()).explain(q, k, v, causal=causal, variant=variant,
                                                        bwd_variant=bwd_variant)
