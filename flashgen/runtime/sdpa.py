"""A drop-in for `torch.nn.functional.scaled_dot_product_attention` backed by flashgen."""

from __future__ import annotations

import torch

from .api import attention
from .dispatch import PACKAGE


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA's signature and semantics on flashgen kernels, for (B, H, N, D) inputs.

    What flashgen cannot do is refused with an error naming the argument, never approximated:
    a dense `attn_mask` (the score matrix never exists), `dropout_p > 0`, and `is_causal` with
    Nq != Nk (SDPA aligns that mask top-left, flashgen bottom-right, so the results differ).
    As in SDPA, k/v with fewer heads than q need `enable_gqa=True`.
    """
    if attn_mask is not None:
        raise ValueError(
            f"attn_mask is not supported by {PACKAGE} (no dense masks); use "
            "is_causal=True for causal attention, or torch SDPA for other masks"
        )
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p} is not supported by {PACKAGE}; only 0.0")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (batch, heads, seq, head_dim) tensor")
    if is_causal and query.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"is_causal=True with query length {query.shape[-2]} != key length "
            f"{key.shape[-2]}: SDPA aligns this mask top-left; {PACKAGE}.attention(causal=True) "
            "aligns it bottom-right (as FlashAttention 2 does) if that is what you want"
        )
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
            "for grouped-query attention (as SDPA requires)"
        )
    return attention(query, key, value, causal=is_causal, scale=scale)
