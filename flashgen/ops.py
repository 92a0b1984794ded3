"""flashgen's operators registered with torch.library, so torch.compile traces through them.

`flashgen::attention_fwd` is opaque to the compiler: its fake implementation gives output
shapes, strides and dtypes, and the real one dispatches at run time like eager calls do.
"""

from __future__ import annotations

import functools

import torch

from flashgen.dispatch import default_dispatcher
from flashgen.variant import Variant


@functools.lru_cache(maxsize=256)
def _variant(text: str) -> Variant | None:
    return Variant.from_json(text) if text else None


@torch.library.custom_op("flashgen::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp); `variant` is a Variant's JSON, or "" for tuned dispatch."""
    out, lse = default_dispatcher().forward(q, k, v, causal, scale, _variant(variant))
    # A custom op's outputs must not alias its inputs (they never do) and must be fresh.
    return out, lse


@attention_fwd.register_fake
def _attention_fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, n, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, n), dtype=torch.float32)
