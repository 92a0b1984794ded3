"""`attn_implementation="flashgen"` for Hugging Face transformers models.

Call `register()` once; then load or build a model with `attn_implementation="flashgen"`.
flashgen handles causal and full attention, GQA and KV caches (its causal mask is aligned
bottom-right, which is what a query chunk at the end of a cache needs). As transformers' own
flash-attention path does, a padded batch (a 2-D padding mask) is unpadded into packed
sequences for `flashgen.attention_varlen` and padded back (pad rows give 0), and packed
documents (batch 1, position ids that restart, or `cu_seq_lens_*` given, keys' own included,
as continuous batching gives them) run as separate sequences. A layer's `sliding_window`,
`softcap` and `s_aux` (attention sinks) are honoured, and a value head dim other than the
query's (DeepSeek's MLA) is padded. Refused with a named error, as transformers refuses its
flash-attention names: models marked `_supports_flash_attn = False` (T5's position bias,
Gemma 3's image mask), a `position_bias`, the paged continuous-batching cache, 4-D masks.

Generation: a step of a few new tokens against a cache, with the layer's modifiers, runs the
decode family (`flashgen.attention_with_kvcache`). A dynamic cache hands over exactly the keys
seen so far; a static cache hands over all of its Nmax slots. Where a step comes with a 2-D
mask (a padded batch, or a static cache) whose rows' 1s are each one run, a row's keys are
that run, found on the GPU (`cache_leftpad` for left padding); other masks are unpadded. A
static cache's decode mask is padded to the cache's length, so a compiled step sees one
input shape every step (one CUDA graph, not a new recording per generated token).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

import flashgen

#: New tokens per step that run the decode family (generation, speculative decoding): the
#: limit `flashgen.attention` itself uses for a few queries against a long cache.
DECODE_MAX_NEW_TOKENS = 16

#: One host read of a mask per forward pass, not one per layer (each is a GPU sync): per kind
#: of read, the last mask read (a weak reference), its version (an in-place change reads it
#: again) and what the read found.
_reads: dict[Any, tuple[Any, int, Any]] = {}


def _read_once(kind: Any, mask: torch.Tensor, read: Callable[[torch.Tensor], Any]) -> Any:
    """`read(mask)`, reused while the same mask object, unchanged, comes back (the layers of
    one pass get the same mask). An inference-mode tensor keeps no version: read each time."""
    try:
        version = mask._version
    except RuntimeError:
        return read(mask)
    last = _reads.get(kind)
    if last is not None and last[0]() is mask and last[1] == version:
        return last[2]
    value = read(mask)
    _reads[kind] = (weakref.ref(mask), version, value)
    return value


def _mask_state(attention_mask: torch.Tensor | None, keys: int) -> tuple[int, bool]:
    """(valid leading keys, padded). Without a mask every key is valid; a 2-D all-ones mask
    (a static cache's) says how many are; any other 2-D mask is padding, which the caller
    unpads. A mask of more dimensions (a custom mask) raises."""
    if attention_mask is None:
        return keys, False
    if attention_mask.dim() != 2:
        raise ValueError(
            f"flashgen got a {attention_mask.dim()}-D attention_mask (a custom mask); it takes "
            "2-D padding masks only. Use attn_implementation='sdpa' for this model."
        )
    unpadded = (attention_mask.shape[1] <= keys
                and _read_once("all", attention_mask, lambda m: bool(m.all())))
    return (attention_mask.shape[1], False) if unpadded else (keys, True)


NAME = "flashgen"


def flashgen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, N, D) in, (B, N, H, D) out. A value
    head dim other than the query's (DeepSeek's MLA) is padded to the wider one and the
    output cut back, as transformers' flash-attention path does."""
    if dropout and module.training:
        raise ValueError(f"attention dropout {dropout} is not supported by flashgen: set the "
                         "config's attention_dropout to 0, or call model.eval()")
    if kwargs.get("position_bias") is not None:
        raise ValueError("flashgen got a position_bias (T5's relative attention bias, MPT's "
                         "ALiBi): it adds no bias to the scores. Use attn_implementation="
                         "'sdpa' or 'eager' for this model.")
    if kwargs.get("block_table") is not None:
        raise ValueError("flashgen does not take transformers' paged continuous-batching "
                         "cache (block_table); use generate(), or attn_implementation="
                         "'sdpa' for generate_batch()")
    if kwargs.get("output_attentions"):
        _warn_once("flashgen computes no attention weights: output_attentions=True returns "
                   "None for them; use attn_implementation='eager' to get them")
    if value.shape[-1] != query.shape[-1]:
        return _widened(module, query, key, value, attention_mask, dropout, scaling,
                        is_causal, sliding_window, softcap, s_aux, **kwargs)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if s_aux is not None and s_aux.dtype not in (query.dtype, torch.float32):
        s_aux = s_aux.float()  # under autocast the sinks keep the parameters' dtype

    def options_for(valid: int) -> dict[str, Any]:
        window = None
        if sliding_window is not None and sliding_window < valid:
            # Keys (i - sliding_window, i] for causal layers: transformers' flash-attention
            # convention (sliding_window - 1 on either side; causal cuts the right one).
            window = (sliding_window - 1, sliding_window - 1)
        return {"causal": causal, "scale": scaling, "window": window, "softcap": softcap,
                "sinks": s_aux}

    nq = query.shape[2]
    # The decode family is inference only: a step that needs gradients takes the dense path.
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if (attention_mask is not None and attention_mask.dim() == 2 and not grads
            and nq <= DECODE_MAX_NEW_TOKENS and nq < attention_mask.shape[1] <= key.shape[2]
            and _runs(attention_mask) is not None):
        return _decode_step(query, key, value, attention_mask,
                            options_for(attention_mask.shape[1])), None
    valid, padded = _mask_state(attention_mask, key.shape[2])
    options = options_for(valid)
    if padded:
        assert attention_mask is not None
        out = _padded(query, key, value, attention_mask.bool(), options)
    elif (packed := _packed_lengths(query, key, attention_mask, kwargs)) is not None:
        q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])
                   for t in (query, key, value))
        out = flashgen.attention_varlen(q, k, v, *packed, **options)
        out = out.view(query.shape[0], nq, query.shape[1], query.shape[3])
    elif nq <= DECODE_MAX_NEW_TOKENS and valid > nq and not grads:
        # New tokens against a cache: the decode family (window, softcap and sinks included)
        # on the caches cut to their `valid` keys, every sequence full (no lengths tensor to
        # make each step).
        if valid < key.shape[2]:
            key, value = key[:, :, :valid], value[:, :, :valid]
        out = flashgen.attention_with_kvcache(query, key, value, None, **options
                                              ).transpose(1, 2)
    else:
        out = flashgen.attention(query, key[:, :, :valid], value[:, :, :valid],
                                 **options).transpose(1, 2)
    return out.contiguous(), None


#: Messages `_warn_once` has given.
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _widened(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`flashgen_attention_forward` where q/k and v have different head dims: the narrower
    zero-padded to the wider (scores and the value rows are unchanged by zero columns),
    the softmax scale fixed to the query's own head dim first, the output cut to v's."""
    wide = max(query.shape[-1], value.shape[-1])
    pad = lambda t: torch.nn.functional.pad(t, (0, wide - t.shape[-1]))
    mask, dropout, scaling, *rest = args
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out, _ = flashgen_attention_forward(module, pad(query), pad(key), pad(value), mask,
                                        dropout, scaling, *rest, **kwargs)
    return out[..., :value.shape[-1]].contiguous(), None


def _decode_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    """A decode step with a 2-D mask, the mask read on the GPU only: each row's keys are the
    run from its mask's first 1 to its last, passed as lengths and `cache_leftpad`, so left
    padding and a static cache's unfilled slots need no host read. Under torch.compile a
    host read was a graph break inside the layer loop (dynamo then ran the model eagerly and
    recompiled it every step), so a compiled step takes every mask this way; a row with a
    hole then differs from eager mode, which checks for holes first (`_runs`)."""
    runs = _runs(attention_mask)
    assert runs is not None
    pads, lengths = runs
    out = flashgen.attention_with_kvcache(query, key, value, lengths, cache_leftpad=pads,
                                          **options)
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2).contiguous()


def _runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first 1, one past the last 1) of each row of a 2-D mask, int32 on its device. Eager:
    None where a row's 1s are not one run (a hole, or none), worked out with a host read
    once per pass and stream (the layers of a step share the answer and its tensors);
    compiled: always the runs, no host read."""
    if torch.compiler.is_compiling():
        return _mask_runs(mask)
    stream = torch.cuda.current_stream(mask.device).cuda_stream if mask.is_cuda else 0
    runs = _read_once(("runs", stream), mask, _one_run_per_row)
    if runs is not None and mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return _mask_runs(mask)  # a CUDA graph keeps the addresses it reads: its own tensors
    return runs


def _mask_runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ones = mask.to(torch.int32)
    pads = ones.argmax(-1).to(torch.int32)
    lengths = (ones.shape[1] - ones.flip(-1).argmax(-1)).to(torch.int32)
    return pads, lengths


def _one_run_per_row(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`mask`'s runs where every row's 1s are one run (no hole, not empty): what
    `_decode_step` can express; else None. A host read."""
    pads, lengths = _mask_runs(mask)
    one = bool((mask.sum(-1) == lengths - pads).all() and (lengths > pads).all())
    return (pads, lengths) if one else None


def _packed_lengths(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                    kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(cu_seqlens_q, cu_seqlens_k, longest q, longest k) of packed documents in a batch of
    one, else None: from `cu_seq_lens_q`/`_k` and `max_length_q`/`_k` where the caller gives
    them (continuous batching gives keys of their own: each request's new tokens against its
    cached ones; packed training gives queries only, the keys being the same), or from
    position ids: a document starts at the first token and wherever a position is not the
    one before it plus one (a restart at 0, or a pack that began mid-document)."""
    if attention_mask is not None or query.shape[0] != 1:
        return None
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        given = kwargs.get("max_length_q")
        # A longest length not given is a host read of the offsets (a GPU sync): once each.
        longest_q = int(given) if given is not None else int(cu_q.diff().max())
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is None or cu_k is cu_q:  # packed training: the keys are the queries
            offsets = cu_q.to(torch.int32)
            return offsets, offsets, longest_q, longest_q
        given = kwargs.get("max_length_k")
        longest_k = int(given) if given is not None else int(cu_k.diff().max())
        return cu_q.to(torch.int32), cu_k.to(torch.int32), longest_q, longest_k
    positions = kwargs.get("position_ids")
    n = query.shape[2]
    # One position per token (not, say, Qwen2-VL's three rows of them), keys the queries.
    if positions is None or positions.numel() != n or n == 1 or key.shape[2] != n:
        return None
    positions = positions.reshape(-1)
    breaks = (positions.diff() != 1).nonzero().view(-1) + 1
    if breaks.numel() == 0:
        return None  # one document: the dense kernel
    ends = torch.tensor([0, n], device=breaks.device)
    cu = torch.cat([ends[:1], breaks, ends[1:]]).to(torch.int32)
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


def _padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
            options: dict[str, Any]) -> torch.Tensor:
    """Attention of a padded batch: its real tokens packed (mask (B, Nk), True = token),
    attended per sequence, scattered back to (B, Nq, Hq, D) with zeros at pad rows. Queries
    are the last Nq positions of each row (left padding), as transformers assumes."""
    b, hq, nq, d = query.shape
    if mask.shape[1] > nq and not bool(mask[:, -1].any()):
        # A static cache's mask, padded with 0s to the cache's length: up to its last token.
        mask = mask[:, :int(mask.any(0).nonzero().max()) + 1]
    if key.shape[2] > mask.shape[1]:  # a static cache longer than the mask
        key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
    nk = key.shape[2]
    k_rows = mask.reshape(-1).nonzero().view(-1)
    k_lens = mask.sum(dim=1, dtype=torch.int32)
    # Cross-attention (not causal, queries other than the keys): every query is real.
    q_mask = (mask[:, -nq:] if options["causal"] or nq == nk
              else torch.ones(b, nq, dtype=torch.bool, device=mask.device))
    q_rows = q_mask.reshape(-1).nonzero().view(-1)
    q_lens = q_mask.sum(dim=1, dtype=torch.int32)
    cu_k = torch.nn.functional.pad(k_lens.cumsum(0, dtype=torch.int32), (1, 0))
    cu_q = torch.nn.functional.pad(q_lens.cumsum(0, dtype=torch.int32), (1, 0))
    pack = lambda t, n, rows: t.transpose(1, 2).reshape(b * n, t.shape[1], d)[rows]
    out = flashgen.attention_varlen(
        pack(query, nq, q_rows), pack(key, nk, k_rows), pack(value, nk, k_rows), cu_q, cu_k,
        max(1, int(q_lens.max())), max(1, int(k_lens.max())), **options)
    full = out.new_zeros(b * nq, hq, d)
    full = full.index_copy(0, q_rows, out)  # differentiable scatter back to the padded rows
    return full.view(b, nq, hq, d)


def _mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """Masks the way flash-attention implementations get them: None unless there is padding.
    The 2-D mask of a compiled decode step is never read on the host (that breaks the graph):
    `_decode_step` reads it on the GPU. A decode step's mask for a static cache's plain causal
    layers (kv_length the cache's length, past the tokens seen) is padded with 0s to that
    length: `generate()` makes this mask outside the compiled forward, and one that grew a
    column a step was a new input shape, so a new CUDA graph, every token. Other layers
    (sliding windows, wrapped mask functions) and prompts keep flash-attention's mask."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask

    kv_length, q_length = kwargs.get("kv_length"), kwargs.get("q_length")
    if (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
            and isinstance(kv_length, int) and isinstance(q_length, int)
            and q_length <= DECODE_MAX_NEW_TOKENS):
        if (q_length < attention_mask.shape[1] < kv_length
                and kwargs.get("mask_function") is causal_mask_function):
            return torch.nn.functional.pad(attention_mask.bool(),
                                           (0, kv_length - attention_mask.shape[1]))
        if torch.compiler.is_compiling():
            return attention_mask[:, -kv_length:].bool()
    return flash_attention_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Add "flashgen" to transformers' attention and attention-mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, flashgen_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    _skip_flash_import_for_our_name()
    _list_our_name_where_flash_kernels_are_listed()
    _refuse_models_without_flash_support()


def _refuse_models_without_flash_support() -> None:
    """transformers refuses its flash-attention names for models marked
    `_supports_flash_attn = False` (T5's relative bias, Gemma 3's two-way image mask, ...:
    what a flash kernel drops), but lets any other name by, so such a model ran under
    "flashgen" with wrong results and no error. Its check of the requested implementation
    is wrapped to refuse our name the same way; every other name goes through unchanged."""
    from transformers.modeling_utils import PreTrainedModel

    def wrap(original: Callable[..., str]) -> Callable[..., str]:
        def get_correct_attn_implementation(self: Any, requested_attention: str | None,
                                            *args: Any, **kw: Any) -> str:
            if requested_attention == NAME and not (
                    self._supports_flash_attn or getattr(self, "_supports_flash_attn_2", False)):
                raise ValueError(
                    f"{type(self).__name__} does not support flash-attention-style "
                    "implementations (transformers marks it so: its attention needs what they "
                    "drop, such as a relative position bias or a non-causal image mask), so "
                    "attn_implementation='flashgen' cannot run it; use 'sdpa' or 'eager'")
            return original(self, requested_attention, *args, **kw)

        return get_correct_attn_implementation

    _wrap_once(PreTrainedModel, "get_correct_attn_implementation", wrap)


def _wrap_once(owner: Any, attr: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
               ) -> None:
    """`owner.attr` replaced by `wrap(owner.attr)`, once: a second `register()` finds it
    wrapped. Nothing where transformers has no such attribute."""
    original = getattr(owner, attr, None)
    if original is None or getattr(original, "_flashgen_wrapped", False):
        return
    wrapped = wrap(original)
    wrapped._flashgen_wrapped = True  # type: ignore[attr-defined]
    setattr(owner, attr, wrapped)


#: Model classes that name the flash implementations they accept (those that handle their
#: sinks), and would otherwise swap "flashgen", a "flash" name to transformers, for one.
_LISTING_MODELS = (("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssPreTrainedModel"),)


def _list_our_name_where_flash_kernels_are_listed() -> None:
    """flashgen handles sinks, so it joins those lists (where the installed transformers
    has the model)."""
    import importlib

    for module_name, class_name in _LISTING_MODELS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        listed = getattr(cls, "_compatible_flash_implementations", None)
        if listed is not None and NAME not in listed:
            cls._compatible_flash_implementations = [*listed, NAME]


def _skip_flash_import_for_our_name() -> None:
    """transformers (5.x) takes every implementation whose name contains "flash" for a
    flash-attn package or hub kernel and tries to import it when a model is built, which fails
    for "flashgen". Its loader is wrapped so that our name, which needs no import, is let by;
    every other name goes to the original loader unchanged."""
    import transformers.modeling_utils as mu

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def lazy_import_flash_attention(implementation: str | None, *args: Any,
                                        **kw: Any) -> Any:
            if implementation == NAME:
                return None
            return original(implementation, *args, **kw)

        return lazy_import_flash_attention

    _wrap_once(mu, "lazy_import_flash_attention", wrap)
