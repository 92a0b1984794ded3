"""The public calls: `attention`, `attention_with_kvcache` and `explain` (flashgen's, and every
exported package's)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from . import ops
from .dispatch import Dispatcher, default_dispatcher
from .inputs import (
    FP8_DTYPE,
    asks_for_fp8,
    check_dispatcher,
    check_fp8,
    check_fp8_device,
    check_inputs,
    check_options,
)
from .kvcache import check_kvcache
from .modifiers import (
    Fp8,
    Mods,
    check_packed,
    check_sinks,
    check_softcap,
    check_varlen,
    check_window,
    checked_mods,
    kernel_sinks,
    kvcache_mods,
)
from .quantize import QUANT_BLOCK
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


def _encoded_fields(mode: str, kind: str, names: tuple[str, ...], values: tuple) -> str:
    """`_encoded` of the variant of class name `kind` with these fields' values."""
    dispatcher = default_dispatcher()
    cls = dispatcher.variant_types.get(mode)
    if cls is None or cls.__name__ != kind:  # encode's TypeError, naming the class
        dispatcher.check_variant(mode, type(kind, (), {})())
    return dispatcher.encode(mode, cls(**dict(zip(names, values, strict=True))))


# What `torch.compiler.assume_constant_result(...)` does, without importing
# torch._dynamo (and with it triton) whenever the package is imported: the CLI must choose
# the Triton interpreter before triton is first imported.
_encoded._dynamo_marked_constant = True  # type: ignore[attr-defined]
_encoded_fields._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _op_text(mode: str, variant: Any) -> str:
    """The op's text for an explicit variant, under torch.compile. The tracer of torch 2.11
    cannot hand a frozen dataclass to a constant-result function ("can't reconstruct
    arbitrary frozen dataclass instances"), so a variant goes as its class name and its
    fields' values, which it reads as constants (`__match_args__`: a dataclass's field
    names)."""
    if variant is None:
        return ""
    names = getattr(variant, "__match_args__", None)
    if names is None:  # not a variant: encode's TypeError
        return _encoded(mode, variant)
    return _encoded_fields(mode, type(variant).__name__, names,
                           tuple([getattr(variant, name) for name in names]))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    variant: Any = None,
    bwd_variant: Any = None,
    dispatcher: Dispatcher | None = None,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
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
    Modifiers: `window=(left, right)` lets query i (at its bottom-right aligned position i')
    see keys i' - left ..= i' + right (-1: unbounded; tiles outside are skipped);
    `softcap=c` turns each scaled score s into c * tanh(s / c); `sinks` (Hq,), q's dtype or
    float32, are per-head logits in each row's softmax denominator (no value), with their
    gradient. The log-sum-exp then includes the sinks.
    FP8: q, k, v in torch.float8_e4m3fn (all three) with fp32 `descale_q`, `descale_k`,
    `descale_v` (per tensor, or per (batch, head, block of 128 rows); `flashgen.fp8.quantize`
    makes both), on a GPU with fp8 tensor cores (compute capability 8.9+); the output is bf16,
    or `out_dtype=torch.float16`. The fa2 family's fp8 path runs it (P rounded to e4m3 for
    P V, as in FlashAttention 3), with GQA, causal and the modifiers; forward only.
    Returns the output (like q), and with `return_lse` also the log-sum-exp (B, Hq, Nq) fp32.
    """
    scale = check_options(causal, scale, return_lse)
    check_dispatcher(dispatcher, Dispatcher)
    descales = (descale_q, descale_k, descale_v)
    if asks_for_fp8(q, k, v, descales, out_dtype) and check_fp8(q, k, v, descales, out_dtype):
        check_fp8_device(q.device)
        out, lse = _fp8(q, k, v, descales, out_dtype, causal, scale, window, softcap, sinks,
                        variant, dispatcher)
        return (out, lse) if return_lse else out
    if _empty(q, k):
        out, lse = _empty_call(q, k, v, window, softcap, sinks)
        return (out, lse) if return_lse else out
    if window is not None or softcap is not None or sinks is not None:
        check_inputs(q, k, v)
        mods = checked_mods(q, window, softcap, sinks)
        if mods.flags != (False, False, False, False):
            out, lse = _modified_call(q, k, v, sinks, causal, scale, mods, variant,
                                      bwd_variant, dispatcher)
            return (out, lse) if return_lse else out
    if _needs_op(q, k, v):
        if not torch.compiler.is_compiling():
            d = dispatcher or default_dispatcher()
            d.check_variant("fwd", variant)
            d.check_variant("bwd", bwd_variant)
            out, lse = ops.EagerAttention.apply(q, k, v, causal, scale, variant, bwd_variant, d)
            return (out, lse) if return_lse else out
        text, bwd_text = _op_text("fwd", variant), _op_text("bwd", bwd_variant)
        out, lse = ops.attention_fwd(q, k, v, causal, scale, text, bwd_text)
    else:
        out, lse = (dispatcher or default_dispatcher()).forward(q, k, v, causal, scale, variant)
    return (out, lse) if return_lse else out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    variant: Any = None,
    bwd_variant: Any = None,
    dispatcher: Dispatcher | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention` of packed sequences, each attending only to itself: q (total_q, Hq, D),
    k and v (total_k, Hkv, D), sequence b at rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q
    and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v (int32 offsets from 0 to the packed
    length; `max_seqlen_*` at least the longest sequence). Causal masks and windows align
    bottom-right per sequence. GQA, modifiers, gradients and dispatch as in `attention`.
    Returns the output (total_q, Hq, D), and with `return_lse` also the log-sum-exp
    (Hq, total_q) fp32. The offsets are checked on the host, read once per tensor and
    in-place version (each read is a GPU sync); the kernels read them on the device.
    """
    scale = check_options(causal, scale, return_lse)
    check_dispatcher(dispatcher, Dispatcher)
    check_packed(q, k, v)
    lens = check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mods = checked_mods(q, window, softcap, sinks, lens)
    out, lse = _modified_call(q, k, v, sinks, causal, scale, mods, variant, bwd_variant,
                              dispatcher)
    return (out, lse) if return_lse else out


def _empty(q: object, k: object) -> bool:
    """A call with no rows or no keys (a batch, Nq or Nk of 0), which no kernel answers."""
    return (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and (q.numel() == 0 or k.numel() == 0))


def _empty_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                window: tuple[int, int] | None, softcap: float | None,
                sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention` of an empty call (`ops.EmptyAttention`), its inputs and modifiers checked
    as any call's: SDPA answers such a call too (an empty batch from a data loader)."""
    check_inputs(q, k, v, empty=True)
    check_window(window)
    check_softcap(softcap)
    checked = check_sinks(sinks, q.shape[1], q.dtype, q.device)
    out, lse = ops.EmptyAttention.apply(q, k, v, checked)
    return out, lse


def _fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: tuple[Any, ...],
         out_dtype: torch.dtype | None, causal: bool, scale: float | None,
         window: tuple[int, int] | None, softcap: float | None, sinks: torch.Tensor | None,
         variant: Any, dispatcher: Dispatcher | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 call (inputs checked): the fa2 fp8 forward, with any modifiers. Forward only:
    training keeps bf16, as in FlashAttention 3."""
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False)
                                       for t in (q, k, v, sinks, *descales)):
        raise NotImplementedError("fp8 attention is forward only: it has no backward (train in "
                                  "bf16, or call it under torch.no_grad())")
    if torch.compiler.is_compiling():
        raise NotImplementedError("fp8 attention does not run under torch.compile yet")
    sink = kernel_sinks(check_sinks(sinks, q.shape[1], torch.float32, q.device))
    mods = Mods(check_window(window), check_softcap(softcap), sink,
                fp8=Fp8.of(q, k, descales, out_dtype, QUANT_BLOCK))
    d = dispatcher or default_dispatcher()
    d.check_variant("fwd", variant)
    return d.forward(q, k, v, causal, scale, variant, mods)


def _modified(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
              causal: bool, scale: float | None, mods: Mods, variant: Any, bwd_variant: Any,
              dispatcher: Dispatcher | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A call with modifiers or packed sequences: autograd where an input needs it (the
    sinks included), else the dispatcher alone."""
    d = dispatcher or default_dispatcher()
    d.check_variant("fwd", variant)
    d.check_variant("bwd", bwd_variant)
    grads = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (sinks is not None and sinks.requires_grad))
    if grads:
        return ops.ModifiedAttention.apply(q, k, v, sinks, causal, scale, mods, variant,
                                           bwd_variant, d)
    return d.forward(q, k, v, causal, scale, variant, mods)


#: `_modified` outside the graph under torch.compile (the modifiers' calls read offsets on
#: the host); eager calls skip the wrapper, whose frame check costs host time every call.
_modified_graph_break = torch.compiler.disable(_modified)


def _modified_call(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.compiler.is_compiling():
        return _modified_graph_break(*args)
    return _modified(*args)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    *,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    cache_leftpad: torch.Tensor | None = None,
    variant: Any = None,
    dispatcher: Dispatcher | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few new queries against a KV cache: the decode family (flash-decoding:
    the keys split across programs, the query heads of one K/V head packed into one tile).

    q: (B, Hq, Nq, D), any strides. Caches, either contiguous, k_cache and v_cache (B, Hkv,
    Nmax, D) with any strides (a (B, Nmax, Hkv, D) tensor transposed works), or paged
    (num_pages, page_size, Hkv, D) with `block_table` (B, max_pages) int32 naming each
    sequence's pages in order; page_size a power of two. `cache_seqlens` (B,) int32: the valid
    keys of each sequence (ragged batches work); None: every sequence holds the whole cache
    (Nmax keys; paged: max_pages x page_size), a call with no lengths tensor to make. With
    `causal` (the default) the last Nq of a sequence's keys are the queries' own: query i sees
    keys j <= i + L - Nq. Lengths beyond the cache, negative lengths and (under causal) lengths
    below Nq are ValueErrors, checked on the host where the lengths are (CPU tensors) or with
    FLASHGEN_DEBUG=1, which also checks page ids; without it GPU lengths are clamped to the
    cache in the kernel, and pages are trusted (a check would cost a GPU sync each call).
    Inference only: no gradient.
    `window`, `softcap` and `sinks` as `attention` takes them, query i of a sequence of L
    keys at position i + L - Nq (the window's splits start at the first query's left edge).
    `cache_leftpad` (B,) int32, contiguous caches only: pad slots at the start of each
    sequence's row (a left-padded batch); its keys are then [pad, length), aligned as if the
    row began at the pad's end. Lengths are worked out on the GPU, so a padded batch needs no
    host sync (what a compiled static-cache `generate()` needs).
    `variant=` (flashgen: a `flashgen.DecodeVariant`) runs exactly that variant.
    Returns the output (like q), and with `return_lse` the log-sum-exp (B, Hq, Nq) fp32.
    """
    scale = check_options(causal, scale, return_lse)
    check_dispatcher(dispatcher, Dispatcher)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k_cache, v_cache)):
        # Said, not raised: a model may call this with grad on in evaluation code.
        warnings.warn("attention_with_kvcache is inference only: its output carries no "
                      "gradient to q, k_cache or v_cache; use flashgen.attention to train",
                      stacklevel=2)
    mods = kvcache_mods(q, window, softcap, sinks)
    if isinstance(q, torch.Tensor) and q.numel() == 0:  # a batch or Nq of 0: no kernel
        check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal, cache_leftpad,
                      empty=True)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        return (torch.empty_like(q), lse) if return_lse else torch.empty_like(q)
    args = (q, k_cache, v_cache, cache_seqlens, block_table, causal, scale)
    if not torch.compiler.is_compiling():
        out, lse = (dispatcher or default_dispatcher()).kvcache(*args, variant, mods,
                                                                cache_leftpad, return_lse)
    elif dispatcher is None:
        # The registered op, opaque to the compiler as the forward's is; modifiers as its
        # plain arguments.
        text = _op_text("decode", variant)
        m = mods or Mods()
        out, lse = ops.attention_kvcache(*args, text, cache_leftpad,
                                         None if m.window is None else list(m.window),
                                         m.softcap, m.sinks)
    else:  # a dispatcher of the caller's cannot go through the op: outside the graph
        out, lse = torch.compiler.disable(dispatcher.kvcache)(*args, variant, mods,
                                                               cache_leftpad)
    return (out, lse) if return_lse else out


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    variant: Any = None,
    bwd_variant: Any = None,
    dispatcher: Dispatcher | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> Choice:
    """Which variant `attention` would run for these inputs (and modifiers), why (exact hit,
    nearest bucket, fallback, explicit) and from which database row; its `backward` answers
    the same for the backward pass (none for fp8 inputs: forward only). `print()` it for a
    short answer. `scale` is checked as `attention` checks it; it changes no choice. Given
    `cu_seqlens_q` (and the rest of `attention_varlen`'s packing arguments), it answers for
    that packed call."""
    check_options(causal, scale)
    check_dispatcher(dispatcher, Dispatcher)
    d = dispatcher or default_dispatcher()
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        check_packed(q, k, v)
        lens = check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return d.explain(q, k, v, causal=causal, variant=variant, bwd_variant=bwd_variant,
                         mods=checked_mods(q, window, softcap, sinks, lens))
    mods = None
    if window is not None or softcap is not None or sinks is not None:
        check_inputs(q, k, v)
        mods = checked_mods(q, window, softcap, sinks)
        mods = None if mods.flags == (False, False, False, False) else mods
    if getattr(q, "dtype", None) == FP8_DTYPE:  # the fp8 family; its descales change nothing
        one = torch.ones((), device=q.device)
        mods = dataclasses.replace(mods or Mods(), fp8=Fp8.of(q, k, (one, one, one), None,
                                                              QUANT_BLOCK))
    return d.explain(q, k, v, causal=causal, variant=variant, bwd_variant=bwd_variant,
                     mods=mods)
