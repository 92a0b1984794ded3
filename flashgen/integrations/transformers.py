"""`attn_implementation="flashgen"` for Hugging Face transformers models.

Call `register()` once; then load or build a model with `attn_implementation="flashgen"`.
flashgen handles causal and full attention, GQA and KV caches (its causal mask is aligned
bottom-right, which is what a query chunk at the end of a cache needs). Padding masks are not
supported: a batch with padding raises an error naming the mask.
"""

from __future__ import annotations

from typing import Any

import torch

import flashgen

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
    if attention_mask is not None:
        raise ValueError(
            "flashgen got an attention_mask (a padded batch or a custom mask); flashgen has no "
            "dense masks. Use unpadded batches, or attn_implementation='sdpa' for this model."
        )
    if dropout and module.training:
        raise ValueError(f"attention dropout {dropout} is not supported by flashgen")
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("flashgen supports neither logit softcapping nor sliding windows")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = flashgen.attention(query, key, value, causal=bool(causal), scale=scaling)
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
