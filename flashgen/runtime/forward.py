"""Launching one forward variant: output allocation, grid, and the kernel call."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from flashgen.kernels.hardware import device_info
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import load_kernel
from flashgen.kernels.variant import Variant

#: (q, k, v, scale) -> (output like q, log-sum-exp (B, Hq, Nq) fp32)
Launcher = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these tensors: a unit last stride, other strides
    and the base address multiples of 16 bytes (the copy engine's rules)."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _descriptor(t: torch.Tensor, rows: int, cols: int) -> object:
    """A TMA descriptor over the (B, H, N, D) view moving [1, 1, rows, cols] tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])


@functools.cache
def _gluon_tile_layout(rows: int, cols: int, dtype: torch.dtype) -> object:
    """The widest shared-memory swizzle a [1, 1, rows, cols] tile allows (what the tensor
    cores read fastest). Cached: working it out costs ~10 us of Python, per descriptor."""
    from triton.experimental.gluon import language as gl

    element = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], element)


def _gluon_descriptor(t: torch.Tensor, rows: int) -> object:
    """A Gluon TMA descriptor over the (B, H, N, D) view moving [1, 1, rows, D] tiles."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    cols = t.shape[-1]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols],
                            _gluon_tile_layout(rows, cols, t.dtype))


def fa2_grid(variant: Variant, nq: int, heads: int, device: torch.device) -> tuple[int, int]:
    """The fa2 launch grid (Q-tile programs per head, B * H_Q).

    A persistent variant caps the first axis near `persistent` programs per SM in all (never
    below one per head); its programs then walk several Q tiles each.
    """
    tiles = -(-nq // variant.block_m)
    if not variant.persistent:
        return tiles, heads
    target = device_info(device).sm_count * variant.persistent
    return max(1, min(tiles, -(-target // heads))), heads


def fa3_grid(variant: Variant, nq: int, heads: int,
             device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The fa3 launch grid and the arguments it adds after fa3's common ones.

    One program per (Q tile, head); on a persistent grid one program per SM (at most one per
    tile), whose kernel takes the number of heads (B * H_Q) to enumerate the tiles itself.
    """
    tiles = -(-nq // variant.block_m)
    if not variant.persistent:
        return (tiles, heads), ()
    return (min(tiles * heads, device_info(device).sm_count),), (heads,)


def prepare_forward(variant: Variant, problem: Problem, strict: bool = True,
                    kernel: Any = None) -> Launcher:
    """Load `variant`'s kernel once and return a function that launches it on checked inputs.

    Everything that depends only on the variant and problem is settled here, so a launch does
    nothing but allocate the outputs and call the kernel: this is the dispatch fast path.
    Strides go to the kernel as they are, so (B, H, N, D) tensors and (B, N, H, D) memory
    viewed as (B, H, N, D) both run without a copy. The output keeps q's memory layout.

    A `use_tma` or fa3 variant needs 16-byte aligned rows (`tma_ready`). Given inputs that
    are not, a strict launcher (an explicitly requested variant) raises; otherwise its
    pointer twin (`Variant.pointer_twin`) runs, which computes the same function.

    `kernel` replaces the rendered one (a JIT function with the same arguments): how
    `scripts/ab_templates.py` times another revision's template beside the current one.
    """
    if variant.needs_tma:
        return _prepare_tma(variant, problem, strict, kernel)
    kernel = kernel or load_kernel(variant, problem)
    launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    group, fa1 = problem.group, variant.loop_order == "fa1"
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
            grid = fa2_grid(variant, nq, b * hq, q.device)
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


def _prepare_tma(variant: Variant, problem: Problem, strict: bool,
                 kernel: Any) -> Launcher:
    kernel = kernel or load_kernel(variant, problem)
    launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    bm, bn, d = variant.block_m, variant.block_n, problem.padded_head_dim
    plain: list[Launcher] = []  # the pointer twin, prepared on first need
    fa3 = variant.loop_order == "fa3"

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(q)
        if not tma_ready(q, k, v, out):
            if strict:
                raise ValueError(
                    f"variant {variant} uses TMA, which needs a unit last stride and 16-byte "
                    "aligned rows and base addresses; these inputs are not"
                )
            if not plain:
                plain.append(prepare_forward(variant.pointer_twin(), problem))
            return plain[0](q, k, v, scale)
        b, hq, nq, _ = q.shape
        lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
        if fa3:
            # Each consumer warpgroup moves its own 16 x num_warps rows of Q and O.
            rows = variant.fa3_rows
            grid, extra = fa3_grid(variant, nq, b * hq, q.device)
            kernel[grid](
                _gluon_descriptor(q, rows), _gluon_descriptor(k, bn), _gluon_descriptor(v, bn),
                _gluon_descriptor(out, rows), lse, *lse.stride()[:2],
                scale, nq, k.shape[2], hq, problem.group, *extra, num_warps=variant.num_warps,
            )  # fmt: skip
            return out, lse
        kernel[fa2_grid(variant, nq, b * hq, q.device)](
            _descriptor(q, bm, d), _descriptor(k, bn, d), _descriptor(v, bn, d),
            _descriptor(out, bm, d), lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride()[:2],
            scale, nq, k.shape[2], hq, problem.group, **launch,
        )  # fmt: skip
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
