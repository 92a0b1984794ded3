"""DecodeVariant + problem -> the decode kernels' Triton sources, and their loaded kernels.

The forward's renderer does the work (same Jinja environment, same hash-named source files,
same caches); this module says which template each decode kernel comes from, what each may
read, and what a decode row's kernel hash covers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal

from flashgen.kernels import render
from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.problem import DecodeProblem, Problem

DecodeKernel = Literal["decode", "decode_combine"]
DECODE_KERNELS: tuple[str, ...] = ("decode", "decode_combine")
_TEMPLATES = {"decode": "attn_decode_split.py.jinja",
              "decode_combine": "attn_decode_combine.py.jinja"}
_FUNCTIONS = {"decode": "attn_decode", "decode_combine": "attn_decode_combine"}


def decode_template_name(kernel: DecodeKernel) -> str:
    try:
        return _TEMPLATES[kernel]
    except KeyError:
        raise ValueError(f"unknown decode kernel {kernel!r}; use one of {DECODE_KERNELS}") from None


def decode_render_context(kernel: DecodeKernel, variant: DecodeVariant,
                          problem: Problem) -> dict[str, Any]:
    """Everything the `kernel` template may depend on. Lengths, batch, heads, the split count
    and the page size stay runtime (or constexpr) arguments, so one compiled kernel serves
    every shape of the same head dim, dtype, mask and cache kind."""
    context: dict[str, Any] = {"head_dim": problem.head_dim,
                               "block_d": problem.padded_head_dim}
    if kernel == "decode_combine":
        # The combine folds the sinks in; other modifiers are the split pass's alone.
        return context | {"sinks": problem.sinks, "tile_mods": " SINKS," if problem.sinks else ""}
    decode_template_name(kernel)
    paged = isinstance(problem, DecodeProblem) and problem.paged
    leftpad = isinstance(problem, DecodeProblem) and problem.leftpad
    mods = render.modifier_context(problem)
    if leftpad:  # its pointer after the modifiers' arguments
        mods["tile_mods"] += " LEFTPAD,"
    return context | {
        "block_m": variant.block_m,
        "block_n": variant.block_n,
        "pad_d": problem.padded_head_dim != problem.head_dim,
        "causal": problem.causal,
        "paged": paged,
        # fp32 inputs get true fp32 products: tf32 would lose ~3 decimal digits.
        "dot_precision": "ieee" if problem.dtype == "fp32" else "tf32",
        # Window, softcap and sinks as structure (the shared online-softmax fragment reads
        # the same flags); none of them changes a plain kernel's text, nor does leftpad.
        **mods,
        "leftpad": leftpad,
        "fused_combine": variant.fused_combine,
        "hoisted": variant.hoisted,
    }


def _context(kernel: DecodeKernel, variant: DecodeVariant, problem: Problem) -> tuple:
    return tuple(sorted(decode_render_context(kernel, variant, problem).items()))


def render_decode(kernel: DecodeKernel, variant: DecodeVariant, problem: Problem) -> str:
    """The Triton source of one decode kernel (cached on what its template reads)."""
    return render._render(decode_template_name(kernel), _context(kernel, variant, problem))


def render_decode_with(templates: Mapping[str, str], kernel: DecodeKernel,
                       variant: DecodeVariant, problem: Problem) -> str:
    """What `render_decode` gives with other template texts (say an earlier revision's)."""
    env = render.environment_for(templates)
    return env.get_template(decode_template_name(kernel)).render(
        **decode_render_context(kernel, variant, problem))


def decode_roles(variant: DecodeVariant) -> tuple[DecodeKernel, ...]:
    """The kernels `variant` may launch: one split, or a fused combine, needs no combine
    kernel."""
    if variant.num_splits == 1 or variant.fused_combine:
        return ("decode",)
    return ("decode", "decode_combine")


def decode_kernel_hash(variant: DecodeVariant, problem: Problem) -> str:
    """The code part of a decode row's key: the hash of every kernel `variant` launches,
    each normalised (`flashgen.kernels.render.normalised`)."""
    return render.rendered_hash((role, decode_template_name(role), _context(role, variant, problem))
                         for role in decode_roles(variant))


@functools.lru_cache(maxsize=1024)
def load_decode_kernel(kernel: DecodeKernel, variant: DecodeVariant, problem: Problem) -> Any:
    """The Triton JIT function of decode kernel `kernel` (compiled lazily at launch)."""
    source = render_decode(kernel, variant, problem)
    return getattr(render._load_module(render.source_hash(source), source),
                   _FUNCTIONS[kernel])
