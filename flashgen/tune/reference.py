"""The single correctness oracle: plain, readable eager attention in PyTorch.

Tests compare kernels with it in float64, and the tuner's correctness gate uses it before a
variant may be timed. It materialises the full score matrix, so it is for checking only.
"""

from __future__ import annotations

import math

import torch


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v for q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D).

    Returns (output in q's dtype or `dtype`, log-sum-exp (B, Hq, Nq) in float32 or float64).
    Computation happens in `dtype` (default: q's dtype), so `dtype=torch.float64` gives the
    high-precision truth and the default gives the same-dtype eager result whose own error
    sets the tolerance for kernels.

    Causal masking is aligned bottom-right: query i sees key j when j <= i + (Nk - Nq). A query
    that sees no key at all gets output 0 and log-sum-exp -inf.
    """
    work = dtype or q.dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    group = q.shape[1] // k.shape[1]
    if group > 1:  # GQA/MQA: each K/V head serves `group` consecutive query heads.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal:
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (n_k - n_q), float("-inf"))
    lse = torch.logsumexp(scores.float() if work != torch.float64 else scores, dim=-1)
    seen = torch.isfinite(lse)[..., None]
    probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    out = probs @ v
    return out, lse
