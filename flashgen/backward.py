"""Launching the backward pass of one BwdVariant: allocation, grids, and the kernel calls."""

from __future__ import annotations

import math

import torch

from flashgen.bwd_render import PREPROCESS_BLOCK_M, load_bwd_kernel
from flashgen.bwd_variant import BwdVariant
from flashgen.problem import Problem


def run_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    variant: BwdVariant,
    problem: Problem,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention given the upstream gradient `do` (shaped like q).

    `out` and `lse` are the forward's output and natural-log log-sum-exp (B, Hq, Nq) fp32, as
    `flashgen.attention(..., return_lse=True)` returns them; rows with LSE -inf (they saw no
    key) get zero gradient. Inputs are read in place through their strides, never copied, and
    the gradients keep their input's dtype, shape and memory layout. With GQA, dk and dv sum
    the contributions of every query head that shares the key/value head.

    Inputs are not validated here (as for `run_forward`): the autograd layer checks them.
    """
    scale = 1.0 / math.sqrt(problem.head_dim) if scale is None else float(scale)
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}

    delta = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    preprocess = load_bwd_kernel("preprocess", variant, problem)
    preprocess[(_cdiv(nq, PREPROCESS_BLOCK_M), b * hq)](
        out, do, delta, *out.stride(), *do.stride(), *delta.stride(), nq, hq
    )

    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    atomic = variant.dq_mode == "atomic"
    # The atomic mode sums dQ shares from every K block, so it needs a zeroed fp32 buffer.
    dq_target = torch.zeros((b, hq, nq, d), device=q.device, dtype=torch.float32) if atomic else dq
    rows = (*lse.stride(), *delta.stride())
    dkdv = load_bwd_kernel("dkdv", variant, problem)
    dkdv[(_cdiv(nk, variant.block_n), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, dq_target,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *rows,
        *dk.stride(), *dv.stride(), *dq_target.stride(),
        scale, nq, nk, hkv, problem.group,
        **launch,
    )  # fmt: skip

    if atomic:
        dq.copy_(dq_target)
    else:
        dq_kernel = load_bwd_kernel("dq", variant, problem)
        # The dQ kernel owns block_n query rows per program (the pair swaps; see BwdVariant).
        dq_kernel[(_cdiv(nq, variant.block_n), b * hq)](
            q, k, v, do, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *rows, *dq.stride(),
            scale, nq, nk, hq, problem.group,
            **launch,
        )  # fmt: skip
    return dq, dk, dv


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
