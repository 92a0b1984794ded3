"""Launching one forward variant: output allocation, grid, and the kernel call."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashgen.problem import Problem
from flashgen.render import load_kernel
from flashgen.variant import Variant

#: (q, k, v, scale) -> (output like q, log-sum-exp (B, Hq, Nq) fp32)
Launcher = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


def prepare_forward(variant: Variant, problem: Problem) -> Launcher:
    """Load `variant`'s kernel once and return a function that launches it on checked inputs.

    Everything that depends only on the variant and problem is settled here, so a launch does
    nothing but allocate the outputs and call the kernel: this is the dispatch fast path.
    Strides go to the kernel as they are, so (B, H, N, D) tensors and (B, N, H, D) memory
    viewed as (B, H, N, D) both run without a copy. The output keeps q's memory layout.
    """
    kernel = load_kernel(variant, problem)
    launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    group, block_m, fa1 = problem.group, variant.block_m, variant.loop_order == "fa1"
    padded = problem.padded_head_dim

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, hq, nq, _ = q.shape
        nk = k.shape[2]
        out = torch.empty_like(q)
        lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
        args = (q, k, v, out, lse)
        if fa1:
            # fa1 keeps the running output, max and sum in fp32 scratch between K/V tiles.
            acc = torch.zeros((b * hq, nq, padded), device=q.device, dtype=torch.float32)
            m = torch.full((b * hq, nq), float("-inf"), device=q.device, dtype=torch.float32)
            lsum = torch.zeros((b * hq, nq), device=q.device, dtype=torch.float32)
            args = (*args, acc, m, lsum)
            grid: tuple[int, ...] = (b * hq,)
        else:
            grid = (-(-nq // block_m), b * hq)
        kernel[grid](
            *args,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride(),
            *lse.stride()[:2],
            scale,
            nq,
            nk,
            hq,
            group,
            **launch,
        )
        return out, lse

    return run


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def run_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    problem: Problem,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `variant` on checked inputs; returns (output like q, log-sum-exp (B, Hq, Nq) fp32)."""
    scale = default_scale(problem.head_dim) if scale is None else float(scale)
    return prepare_forward(variant, problem)(q, k, v, scale)
