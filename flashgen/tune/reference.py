"""The single correctness oracle: plain, readable eager attention in PyTorch.

Tests compare kernels with it in float64, and the tuner's correctness gate uses it before a
variant may be timed. It materialises the full score matrix, so it is for checking only.
Every modifier (sliding window, softcap, sinks) and the packed variable-length layout is
written here the obvious way; gradients come from autograd through these few lines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def visible(n_q: int, n_k: int, causal: bool = False,
            window: tuple[int, int] | None = None,
            device: torch.device | str | None = None) -> torch.Tensor:
    """(n_q, n_k) bool: which keys each query sees. Positions are aligned bottom-right: query
    i stands at i' = i + n_k - n_q. Causal keeps j <= i'; window (left, right) keeps
    i' - left <= j <= i' + right, -1 meaning unbounded on that side."""
    i = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=device)[None, :]
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
    return keep


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    *,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v for q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D).

    Returns (output in q's dtype or `dtype`, log-sum-exp (B, Hq, Nq) in float32 or float64).
    Computation happens in `dtype` (default: q's dtype), so `dtype=torch.float64` gives the
    high-precision truth and the default gives the same-dtype eager result whose own error
    sets the tolerance for kernels.

    Causal masking is aligned bottom-right: query i sees key j when j <= i + (Nk - Nq); a
    `window` narrows what it sees (see `visible`). `softcap` c replaces each scaled score s
    by c * tanh(s / c) before the softmax. `sinks` (Hq,) are per-head logits that join every
    row's softmax denominator with no value: the log-sum-exp includes them, the output is
    the keys' share only. A query that sees no key gets output 0 and log-sum-exp -inf (or
    its sink's logit).
    """
    work = dtype or q.dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    group = q.shape[1] // k.shape[1]
    if group > 1:  # GQA/MQA: each K/V head serves `group` consecutive query heads.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal or window is not None:
        keep = visible(n_q, n_k, causal, window, q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        # The sink is one more column of every row's scores, dropped after the softmax.
        column = sinks.to(work).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    lse = torch.logsumexp(scores.float() if work != torch.float64 else scores, dim=-1)
    seen = torch.isfinite(lse)[..., None]
    probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    out = probs @ v
    return out, lse


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | Sequence[int],
    cu_seqlens_k: torch.Tensor | Sequence[int],
    *args: Any,
    **modifiers: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention` of each packed sequence on its own: q (total_q, Hq, D), k and v
    (total_k, Hkv, D), sequence b spanning rows cu_seqlens[b]:cu_seqlens[b + 1]; `args` and
    `modifiers` as `attention` takes them (causal, scale, dtype; window, softcap, sinks).
    Returns (output (total_q, Hq, D), log-sum-exp (Hq, total_q)), the layout FlashAttention's
    varlen call uses. A sequence with no keys gets output 0 and log-sum-exp -inf (or its
    sinks)."""
    dtype = args[2] if len(args) > 2 else modifiers.get("dtype")
    sinks = modifiers.get("sinks")
    cq = [int(x) for x in cu_seqlens_q]
    ck = [int(x) for x in cu_seqlens_k]
    work = dtype or q.dtype
    lse_dtype = torch.float64 if work == torch.float64 else torch.float32
    # Empty to start with, so a packing whose sequences all have no queries returns
    # (0, Hq, D) and (Hq, 0), as the kernels do.
    outs = [torch.zeros((0, q.shape[1], v.shape[-1]), dtype=work, device=q.device)]
    lses = [torch.zeros((q.shape[1], 0), dtype=lse_dtype, device=q.device)]
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]
        ks = k[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        vs = v[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        if qs.shape[2] == 0:
            continue
        if ks.shape[2] == 0:  # nothing to see: the sinks alone, or -inf
            out = torch.zeros((*qs.shape[:-1], v.shape[-1]), dtype=work, device=q.device)
            lse = torch.full(qs.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)
            if sinks is not None:
                lse = sinks.to(lse_dtype)[None, :, None].expand_as(lse)
        else:
            out, lse = attention(qs, ks, vs, *args, **modifiers)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=-1)
