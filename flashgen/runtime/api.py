"""The public calls: `attention`, `attention_with_kvcache` and `explain` (flashgen's, and every
exported package's)."""

from __future__ import annotations

from typing import Any

import torch

from . import ops
from .dispatch import Dispatcher, default_dispatcher
from .inputs import check_options
from .table import Choice


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


def _encoded(mode: str, variant: Any) -> str:
    """An explicit variant as the op's text, worked out at trace time (a constant of the
    graph): the tracer cannot follow the default dispatcher's making or the JSON."""
    return default_dispatcher().encode(mode, variant)


# What `torch.compiler.assume_constant_result(_encoded)` does, without importing
# torch._dynamo (and with it triton) whenever the package is imported: the CLI must choose
# the Triton interpreter before triton is first imported.
_encoded._dynamo_marked_constant = True  # type: ignore[attr-defined]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    variant: Any = None,
    bwd_variant: Any = None,
    dispatcher: Dispatcher | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention softmax(q k^T * scale) v with q (B, Hq, Nq, D) and k, v (B, Hkv, Nk, D).

    k and v may have fewer heads than q (GQA/MQA; Hq % Hkv == 0). Causal masking is aligned
    bottom-right when Nq != Nk. Any strides are accepted, e.g. a (B, N, H, D) tensor transposed
    to (B, H, N, D). The default scale is 1/sqrt(D). Without `variant=` the tuned winner for
    this GPU and shape runs (see `explain`); with it (flashgen only: a `flashgen.Variant`)
    exactly that variant runs, and an invalid one is an error, never a silent fallback.
    `dispatcher` picks the tables (flashgen: the databases; default: user, then shipped);
    under torch.compile the shared default dispatcher decides.
    Differentiable: the backward recomputes attention block by block from the saved
    log-sum-exp (`bwd_variant=` picks its kernels, else the tuned or default ones); no
    gradient flows through the returned log-sum-exp.
    Returns the output (like q), and with `return_lse` also the log-sum-exp (B, Hq, Nq) fp32.
    """
    check_options(causal, scale)
    if _needs_op(q, k, v):
        if not torch.compiler.is_compiling():
            d = dispatcher or default_dispatcher()
            d.check_variant("fwd", variant)
            d.check_variant("bwd", bwd_variant)
            out, lse = ops.EagerAttention.apply(q, k, v, causal, scale, variant, bwd_variant, d)
            return (out, lse) if return_lse else out
        text = "" if variant is None else _encoded("fwd", variant)
        bwd_text = "" if bwd_variant is None else _encoded("bwd", bwd_variant)
        out, lse = ops.attention_fwd(q, k, v, causal, scale, text, bwd_text)
    else:
        out, lse = (dispatcher or default_dispatcher()).forward(q, k, v, causal, scale, variant)
    return (out, lse) if return_lse else out


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    variant: Any = None,
    dispatcher: Dispatcher | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few new queries against a KV cache: the decode family (flash-decoding:
    the keys split across programs, the query heads of one K/V head packed into one tile).

    q: (B, Hq, Nq, D), any strides. Caches, either contiguous, k_cache and v_cache
    (B, Hkv, Nmax, D) with any strides (a (B, Nmax, Hkv, D) tensor transposed works), or paged
    (num_pages, page_size, Hkv, D) with `block_table` (B, max_pages) int32 naming each
    sequence's pages in order; page_size a power of two. `cache_seqlens` (B,) int32: the valid
    keys of each sequence (ragged batches work). With `causal` (the default) the last Nq of a
    sequence's keys are the queries' own: query i sees keys j <= i + L - Nq. Lengths beyond
    the cache, negative lengths and (under causal) lengths below Nq are ValueErrors, checked
    on the host where the lengths are (CPU tensors) or with FLASHGEN_DEBUG=1, which also checks
    page ids; without it GPU lengths are clamped to the cache in the kernel, and pages are
    trusted (a check would cost a GPU sync each call). Inference only: no gradient.
    `variant=` (flashgen: a `flashgen.DecodeVariant`) runs exactly that variant.
    Returns the output (like q), and with `return_lse` the log-sum-exp (B, Hq, Nq) fp32.
    """
    check_options(causal, scale)
    out, lse = (dispatcher or default_dispatcher()).kvcache(
        q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, variant)
    return (out, lse) if return_lse else out


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    variant: Any = None,
    bwd_variant: Any = None,
    dispatcher: Dispatcher | None = None,
) -> Choice:
    """Which variant `attention` would run for these inputs, why (exact hit, nearest bucket,
    fallback, explicit) and from which database row; its `backward` answers the same for the
    backward pass. `print()` it for a short answer."""
    check_options(causal, None)
    return (dispatcher or default_dispatcher()).explain(q, k, v, causal=causal, variant=variant,
                                                        bwd_variant=bwd_variant)
