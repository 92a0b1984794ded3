"""Launching the backward pass of one BwdVariant: allocation, grids, and the kernel calls."""

from __future__ import annotations

import math

import torch

from flashgen.kernels.bwd_render import PREPROCESS_BLOCK_M, BwdKernel, load_bwd_kernel
from flashgen.kernels.bwd_space import bwd_pointer_twin
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.problem import Problem
from flashgen.runtime.forward import _gluon_descriptor, tma_ready


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

    A variant with Gluon (fa3) kernels needs 16-byte aligned rows (`tma_ready`); on inputs
    that are not, its `pointer_twin` runs, which computes the same gradients.

    Inputs are not validated here (as for `run_forward`): the autograd layer checks them.
    """
    scale = 1.0 / math.sqrt(problem.head_dim) if scale is None else float(scale)
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if variant.fa3 != "none" and (lse.stride(-1) != 1 or not tma_ready(q, k, v, do, dq, dk, dv)):
        variant = bwd_pointer_twin(variant, problem, q.device)
    launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}

    delta = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    preprocess = load_bwd_kernel("preprocess", variant, problem)
    preprocess[(_cdiv(nq, PREPROCESS_BLOCK_M), b * hq)](
        out, do, delta, *out.stride(), *do.stride(), *delta.stride(), nq, hq
    )
    if variant.gluon("dkdv"):
        _launch_fa3("dkdv", variant, problem, (_cdiv(nk, variant.block_n), b * hkv),
                    (q, k, v, do, dk, dv), lse, delta, scale, hkv)
    else:
        _triton_dkdv(q, k, v, do, lse, delta, dq, dk, dv, variant, problem, scale, launch)
    if variant.gluon("dq"):
        _launch_fa3("dq", variant, problem, (_cdiv(nq, variant.block_n), b * hq),
                    (q, k, v, do, dq), lse, delta, scale, hq)
    elif variant.dq_mode == "separate":
        dq_kernel = load_bwd_kernel("dq", variant, problem)
        # The dQ kernel owns block_n query rows per program (the pair swaps; see BwdVariant).
        dq_kernel[(_cdiv(nq, variant.block_n), b * hq)](
            q, k, v, do, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(),
            *delta.stride(), *dq.stride(), scale, nq, nk, hq, problem.group, **launch,
        )  # fmt: skip
    return dq, dk, dv


def fa3_tile_rows(kernel: str, variant: BwdVariant) -> tuple[int, ...]:
    """Rows of the TMA tile of each tensor a Gluon backward kernel takes, in argument order:
    an owned tensor moves 64 rows per consumer warpgroup, a streamed one the kernel's
    streamed tile (`BwdVariant.streamed`)."""
    rows = variant.streamed(kernel)
    if kernel == "dkdv":  # q, k, v, do, dk, dv: K and V owned
        return (rows, 64, 64, rows, 64, 64)
    return (64, rows, rows, 64, 64)  # q, k, v, do, dq: Q and dO owned


def _launch_fa3(kernel: BwdKernel, variant: BwdVariant, problem: Problem,
                grid: tuple[int, int], tensors: tuple[torch.Tensor, ...], lse: torch.Tensor,
                delta: torch.Tensor, scale: float, heads: int) -> None:
    """One Gluon backward kernel on `tensors` (q, k, v, do, then its outputs); `heads`: the
    heads its grid spans, H_KV or H_Q."""
    rows = fa3_tile_rows(kernel, variant)
    load_bwd_kernel(kernel, variant, problem)[grid](
        *(_gluon_descriptor(t, r) for t, r in zip(tensors, rows, strict=True)),
        lse, delta, *lse.stride()[:2], *delta.stride()[:2], scale, tensors[0].shape[2],
        tensors[1].shape[2], heads, problem.group, num_warps=4,
    )  # fmt: skip


def _triton_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor, variant: BwdVariant, problem: Problem, scale: float,
                 launch: dict[str, int]) -> None:
    """The Triton dK/dV kernel; in the atomic dq mode it also fills `dq`."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
