"""The decode search space: every DecodeVariant, the named rules that drop the ones that cannot
work, and the hand-picked default used before any tuning."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.fwd_space import (
    MAX_ACC_PER_THREAD,
    first_broken,
    longer_than_needed,
    over_shared_memory,
)
from flashgen.kernels.hardware import DeviceInfo, device_info
from flashgen.kernels.problem import Problem

BLOCK_M = (16, 32, 64, 128)
BLOCK_N = (16, 32, 64, 128, 256)
#: 0: the launcher's choice (about two programs per SM); the rest fixed counts.
SPLITS = (0, 1, 2, 4, 8, 16, 32, 64)
WARPS = (1, 2, 4, 8)
STAGES = (1, 2, 3, 4)
#: Merge the splits in a combine kernel (False) or in the split pass's last program (True).
FUSED = (False, True)
#: Per-key row offsets: recomputed each step (False, as rows tuned before the knob) or their
#: loop-invariant part computed once (True).
HOISTED = (False, True)
#: The most splits the launcher makes or a variant may ask for: the combine kernel holds a
#: row's partials (splits x D fp32) in registers.
MAX_SPLITS = 128

Rule = Callable[[DecodeVariant, Problem, DeviceInfo], str | None]


def packed_rows(p: Problem) -> int:
    """Query rows one K/V head serves: the GQA group times the new queries."""
    return p.group * p.seq_q


def knobs_out_of_range(v: DecodeVariant, p: Problem, dev: DeviceInfo) -> str | None:
    if v.block_m not in BLOCK_M or v.block_n not in BLOCK_N:
        return f"block_m must be among {BLOCK_M} and block_n among {BLOCK_N}"
    if v.num_warps not in WARPS:
        return f"num_warps must be among {WARPS}"
    if v.num_stages not in STAGES:
        return f"num_stages must be among {STAGES}"
    if not 0 <= v.num_splits <= MAX_SPLITS:
        return f"num_splits must be 0 (automatic) to {MAX_SPLITS}"
    if not isinstance(v.fused_combine, bool):
        return f"fused_combine must be true or false, not {v.fused_combine!r}"
    if not isinstance(v.hoisted, bool):
        return f"hoisted must be true or false, not {v.hoisted!r}"
    return None


def block_m_longer_than_rows(v: DecodeVariant, p: Problem, dev: DeviceInfo) -> str | None:
    return longer_than_needed("block_m", v.block_m, packed_rows(p), "packed query rows")


def block_n_longer_than_keys(v: DecodeVariant, p: Problem, dev: DeviceInfo) -> str | None:
    return longer_than_needed("block_n", v.block_n, p.seq_k, "keys")


def more_splits_than_tiles(v: DecodeVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # Splits take whole key tiles: past one tile each, the extra programs only write -inf.
    tiles = -(-p.seq_k // v.block_n)
    if v.num_splits > tiles:
        return f"num_splits {v.num_splits} is more than the {tiles} key tiles of block_n"
    return None


def fused_without_splits(v: DecodeVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # One split is the whole call already: the fused point would repeat the unfused one.
    if v.fused_combine and v.num_splits == 1:
        return "fused_combine with num_splits 1 (nothing to merge)"
    return None


def shared_memory_overflow(v: DecodeVariant, p: Problem, dev: DeviceInfo) -> str | None:
    elem = 4 if p.dtype == "fp32" else 2
    need = elem * p.padded_head_dim * (v.block_m + 2 * v.block_n * v.num_stages)
    return over_shared_memory(need, dev)


def accumulator_too_large(v: DecodeVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # As in the forward: the fp32 output tile and the score tile live in registers.
    per_thread = v.block_m * (p.padded_head_dim + v.block_n) // (32 * v.num_warps)
    if per_thread > 2 * MAX_ACC_PER_THREAD:
        return f"{per_thread} accumulator registers per thread (block_m x (D + block_n) too big)"
    return None


def too_many_warps(v: DecodeVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # A decode tile has few rows; warps split the key side too, but past one warp per 16
    # keys they have nothing left to split.
    if v.num_warps > max(1, v.block_n // 16):
        return f"{v.num_warps} warps for a {v.block_n}-key tile"
    return None


RULES: tuple[Rule, ...] = (
    knobs_out_of_range,
    block_m_longer_than_rows,
    block_n_longer_than_keys,
    more_splits_than_tiles,
    fused_without_splits,
    shared_memory_overflow,
    accumulator_too_large,
    too_many_warps,
)


def why_invalid_decode(v: DecodeVariant, p: Problem,
                       device: DeviceInfo | str | None = None) -> str | None:
    """The first rule `v` breaks for decode problem `p` on `device`, or None if it is valid."""
    return first_broken(RULES, v, p, device_info(device))


def decode_search_space(problem: Problem,
                        device: DeviceInfo | str | None = None) -> list[DecodeVariant]:
    """The valid decode variants for `problem` on `device`, in a stable order."""
    dev = device_info(device)
    points = (DecodeVariant(*knobs)
              for knobs in itertools.product(BLOCK_M, BLOCK_N, SPLITS, WARPS, STAGES, FUSED,
                                             HOISTED))
    return [v for v in points if why_invalid_decode(v, problem, dev) is None]


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def default_decode_variant(problem: Problem, device: DeviceInfo | str | None = None,
                           fa3: bool = True) -> DecodeVariant:
    """The untuned choice: every packed row in one tile (up to 64), 64-key steps (32 for
    heads wider than 128), automatic splits, on paged caches too (a tile spanning pages
    gathers a page id per key, and each key's row is still one contiguous read), row
    offsets hoisted (as fast on a contiguous cache, faster on a paged one). Falls back to
    smaller tiles until the rules pass; the 16 x 16 tile always does. `fa3` is accepted for
    the modes' common signature: decode has no Gluon kernel."""
    dev = device_info(device)
    block_m = min(64, _pow2_at_least_16(packed_rows(problem)))
    block_n = 64 if problem.padded_head_dim <= 128 else 32
    stages = 2 if dev.is_interpreter else 3
    for bm, bn in ((block_m, block_n), (block_m, 32), (block_m, 16), (16, 16)):
        for warps in (4, 2, 1):
            for v in (DecodeVariant(bm, bn, 0, warps, stages, hoisted=True),
                      DecodeVariant(bm, bn, 0, warps, 1, hoisted=True)):
                if why_invalid_decode(v, problem, dev) is None:
                    return v
    raise AssertionError(f"no default decode variant fits {problem}")


#: Hoisted points measured first when tuning (block_n, splits, warps, stages), at the
#: default's block_m: the tile shapes that won decode keys before the knob existed, so a
#: re-tune meets their hoisted forms before the sampler's picks.
HOISTED_PORTFOLIO = ((64, 0, 4, 3), (64, 16, 4, 3), (128, 16, 4, 3), (128, 0, 8, 3),
                     (128, 2, 8, 3), (32, 8, 1, 3), (16, 0, 1, 3))


def decode_portfolio(problem: Problem,
                     device: DeviceInfo | str | None = None) -> list[DecodeVariant]:
    """Points measured first when tuning, after the default (which the tuner enqueues
    itself): `HOISTED_PORTFOLIO`'s valid points."""
    dev = device_info(device)
    block_m = default_decode_variant(problem, dev).block_m
    points = (DecodeVariant(block_m, n, splits, warps, stages, hoisted=True)
              for n, splits, warps, stages in HOISTED_PORTFOLIO)
    return [v for v in points if why_invalid_decode(v, problem, dev) is None]
