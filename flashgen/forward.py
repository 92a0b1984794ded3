"""Launching one forward variant: output allocation, grid, and the kernel call."""

from __future__ import annotations

import math

import torch

from flashgen.problem import Problem
from flashgen.render import load_kernel
from flashgen.variant import Variant


def run_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    problem: Problem,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `variant` on checked inputs; returns (output like q, log-sum-exp (B, Hq, Nq) fp32).

    Strides go to the kernel as they are, so (B, H, N, D) tensors and (B, N, H, D) memory
    viewed as (B, H, N, D) both run without a copy. The output keeps q's memory layout.
    """
    kernel = load_kernel(variant, problem)
    scale = 1.0 / math.sqrt(problem.head_dim) if scale is None else float(scale)
    b, hq, nq, _ = q.shape
    nk = k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride()[:2])
    common = (scale, nq, nk, hq, problem.group)
    launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    if variant.loop_order == "fa2":
        grid = (triton_cdiv(nq, variant.block_m), b * hq)
        kernel[grid](q, k, v, out, lse, *strides, *common, **launch)
    else:
        # fa1 keeps the running output, max and sum in fp32 scratch between K/V tiles.
        acc = torch.zeros(
            (b * hq, nq, problem.padded_head_dim), device=q.device, dtype=torch.float32
        )
        m = torch.full((b * hq, nq), float("-inf"), device=q.device, dtype=torch.float32)
        lsum = torch.zeros((b * hq, nq), device=q.device, dtype=torch.float32)
        kernel[(b * hq,)](q, k, v, out, lse, acc, m, lsum, *strides, *common, **launch)
    return out, lse


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
