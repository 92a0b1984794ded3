"""`attn_implementation="flashgen"` for Hugging Face transformers models.

Call `register()` once; then load or build a model with `attn_implementation="flashgen"`.
flashgen handles causal and full attention, GQA and KV caches (its causal mask is aligned
bottom-right, which is what a query chunk at the end of a cache needs). Padding masks are not
supported: a batch with padding raises an error naming the mask.

Generation: a step of a few new tokens against a cache runs the decode family
(`flashgen.attention_with_kvcache`). A dynamic cache hands over exactly the keys seen so far;
a static cache hands over all of its Nmax slots, and transformers' flash-style mask (a 2-D
all-ones mask as long as the keys seen, shorter than the cache) says how many are valid.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

import flashgen

#: New tokens per step that run the decode family (generation, speculative decoding): the
#: limit `flashgen.attention` itself uses for a few queries against a long cache.
DECODE_MAX_NEW_TOKENS = 16

#: The last mask read and whether it was free of padding: every layer of a forward pass gets
#: the same mask, which is read back once per pass, not once per layer (a GPU sync).
_last: list[Any] = [None, False]


def _valid_keys(attention_mask: torch.Tensor | None, keys: int) -> int:
    """How many leading keys of the cache are valid: all of them without a mask; the mask's
    length for a static cache's 2-D mask without padding. Anything else raises."""
    if attention_mask is None:
        return keys
    seen = _last[0]() if _last[0] is not None else None
    if seen is attention_mask:
        unpadded = _last[1]
    else:
        unpadded = (attention_mask.dim() == 2 and attention_mask.shape[1] <= keys
                    and bool(attention_mask.all()))
        _last[:] = [weakref.ref(attention_mask), unpadded]
    if not unpadded:
        raise ValueError(
            "flashgen got an attention_mask (a padded batch or a custom mask); flashgen has no "
            "dense masks. Use unpadded batches, or attn_implementation='sdpa' for this model."
        )
    return attention_mask.shape[1]

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
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, N, D) in, (B, N, H, D) out."""
    valid = _valid_keys(attention_mask, key.shape[2])
    if dropout and module.training:
        raise ValueError(f"attention dropout {dropout} is not supported by flashgen")
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("flashgen supports neither logit softcapping nor sliding windows")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    nq = query.shape[2]
    if nq <= DECODE_MAX_NEW_TOKENS and valid > nq:
        # New tokens against a cache: the decode family, every sequence `valid` keys long.
        lengths = torch.full((query.shape[0],), valid, dtype=torch.int32, device=query.device)
        out = flashgen.attention_with_kvcache(query, key, value, lengths, causal=causal,
                                              scale=scaling)
    else:
        out = flashgen.attention(query, key[:, :, :valid], value[:, :, :valid], causal=causal,
                                 scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """Masks the way flash-attention implementations get them: None unless there is padding."""
    from transformers.masking_utils import flash_attention_mask

    return flash_attention_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Add "flashgen" to transformers' attention and attention-mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, flashgen_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    _skip_flash_import_for_our_name()


def _skip_flash_import_for_our_name() -> None:
    """transformers (5.x) takes every implementation whose name contains "flash" for a
    flash-attn package or hub kernel and tries to import it when a model is built, which fails
    for "flashgen". Its loader is wrapped so that our name, which needs no import, is let by;
    every other name goes to the original loader unchanged."""
    import transformers.modeling_utils as mu

    original = getattr(mu, "lazy_import_flash_attention", None)
    if original is None or getattr(original, "_flashgen_wrapped", False):
        return

    def lazy_import_flash_attention(implementation: str | None, *args: Any, **kw: Any) -> Any:
        if implementation == NAME:
            return None
        return original(implementation, *args, **kw)

    lazy_import_flash_attention._flashgen_wrapped = True  # type: ignore[attr-defined]
    mu.lazy_import_flash_attention = lazy_import_flash_attention
