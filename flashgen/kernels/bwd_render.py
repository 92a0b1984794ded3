"""BwdVariant + problem -> the three backward kernels' Triton sources, and their loaded kernels.

The forward's renderer does the work (same Jinja environment, same hash-named source files,
same caches); this module only says which template each backward kernel comes from and what
each one may read, and what a backward row's kernel hash covers (`bwd_kernel_hash`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal

from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import (
    _load_module,
    _render,
    environment_for,
    modifier_context,
    rendered_hash,
    source_hash,
    splits_head_dim,
)

BwdKernel = Literal["preprocess", "dkdv", "dq"]
BWD_KERNELS: tuple[str, ...] = ("preprocess", "dkdv", "dq")

#: Query rows per preprocessing program. It only streams O and dO once, so the tile size is a
#: fixed choice rather than a search-space knob.
PREPROCESS_BLOCK_M = 64


def bwd_template_name(kernel: BwdKernel, variant: BwdVariant | None = None,
                      problem: Problem | None = None) -> str:
    fa3 = "_fa3" if variant is not None and variant.gluon(kernel) else ""
    # Above D128 a consumer cannot hold 64 keys' dK and dV: the wide kernel splits the head
    # dim between two consumers.
    if fa3 and kernel == "dkdv" and problem is not None and problem.padded_head_dim > 128:
        fa3 += "_wide"
    return f"attn_bwd_{kernel}{fa3}.py.jinja"


def bwd_render_context(kernel: BwdKernel, variant: BwdVariant, problem: Problem) -> dict[str, Any]:
    """Everything the `kernel` template may depend on. Lengths, batch and heads stay runtime
    arguments, so one compiled kernel serves every shape of the same head dim and dtype."""
    context: dict[str, Any] = {
        "head_dim": problem.head_dim,
        "block_d": problem.padded_head_dim,
    }
    if kernel == "preprocess":
        context["block_m"] = PREPROCESS_BLOCK_M
        return context
    context["causal"] = problem.causal
    # Sinks take no part in these kernels (their gradient is a row sum, left to the
    # launcher), so only the packed layout, window and softcap add arguments.
    context.update(modifier_context(problem.with_(sinks=False)))
    if kernel == "dq":
        # Both dQ templates render nothing for it when false: rows stored before it keep
        # their kernel hashes.
        context["fused_delta"] = variant.fused_delta
    if variant.gluon(kernel):
        # Gluon kernels (Hopper, fp16/bf16 only): no precision switch; both keep the owned
        # tile as block_n's and the streamed one as block_m's in their own terms.
        owned, streamed = variant.block_owned, variant.streamed(kernel)
        if kernel == "dkdv":
            context.update(block_n=owned, block_m=streamed,
                           atomic_dq=variant.dq_mode == "atomic",
                           smem_stats=variant.smem_stats)
        else:
            context.update(block_m=owned, block_n=streamed)
        # Renders nothing when false (the wide kernel has no such structure): rows stored
        # before it keep their kernel hashes.
        context["lpt"] = variant.lpt
        # The products cover the 256 tile's first 192 columns, as the forward's split_d.
        context["split_d"] = splits_head_dim(problem)
        context["stages"] = variant.num_stages
        return context
    # fp32 inputs get true fp32 products: tf32 would lose ~3 decimal digits.
    context["dot_precision"] = "ieee" if problem.dtype == "fp32" else "tf32"
    if kernel == "dkdv":
        context["block_m"] = variant.block_streamed
        context["block_n"] = variant.block_owned
        context["atomic_dq"] = variant.dq_mode == "atomic"
    elif kernel == "dq":
        # The owned tile is block_n in both kernels (see BwdVariant), so the pair swaps here.
        context["block_m"] = variant.block_owned
        context["block_n"] = variant.block_streamed
    else:
        raise ValueError(f"unknown backward kernel {kernel!r}; use one of {BWD_KERNELS}")
    return context


def render_bwd(kernel: BwdKernel, variant: BwdVariant, problem: Problem) -> str:
    """The Triton source of one backward kernel (cached on what its template reads)."""
    context = tuple(sorted(bwd_render_context(kernel, variant, problem).items()))
    return _render(bwd_template_name(kernel, variant, problem), context)


def render_bwd_with(templates: Mapping[str, str], kernel: BwdKernel, variant: BwdVariant,
                    problem: Problem) -> str:
    """What `render_bwd` gives with other template texts (say an earlier revision's): lets a
    tool or test see which kernels (so which rows' kernel hashes) a template change alters."""
    env = environment_for(templates)
    return env.get_template(bwd_template_name(kernel, variant, problem)).render(
        **bwd_render_context(kernel, variant, problem))


def bwd_roles(variant: BwdVariant) -> tuple[BwdKernel, ...]:
    """The kernels `variant` launches: the atomic dq mode has no dQ kernel; with fused_delta
    the dQ kernel does the preprocessing's work (and runs before the dK/dV kernel)."""
    if variant.fused_delta:
        return ("dkdv", "dq")
    return ("preprocess", "dkdv") + (("dq",) if variant.dq_mode == "separate" else ())


def bwd_kernel_hash(variant: BwdVariant, problem: Problem) -> str:
    """The code part of a backward row's key: the hash of every kernel `variant` launches
    (`bwd_roles`), each normalised (`flashgen.kernels.render.normalised`). As in the forward,
    the Triton twin that runs on inputs TMA cannot address is not part of it."""
    return rendered_hash(
        (role, bwd_template_name(role, variant, problem),
         tuple(sorted(bwd_render_context(role, variant, problem).items())))
        for role in bwd_roles(variant))


@functools.lru_cache(maxsize=1024)
def load_bwd_kernel(kernel: BwdKernel, variant: BwdVariant, problem: Problem) -> Any:
    """The Triton (or Gluon) JIT function `attn_bwd_<kernel>` (compiled lazily at launch).

    Memoised: every backward call looks up three kernels, and rendering plus hashing their
    sources each time was about a quarter of a training step's host overhead."""
    source = render_bwd(kernel, variant, problem)
    return getattr(_load_module(source_hash(source), source), f"attn_bwd_{kernel}")
