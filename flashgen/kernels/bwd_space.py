"""The backward search space: every BwdVariant, and the named rules that drop unworkable ones.

Same shape as `flashgen.kernels.fwd_space` for the forward: one grid, a tuple of named rules, and a
hand-picked default that is valid for every problem.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

from flashgen.kernels.bwd_variant import DQ_MODES, FA3_KERNELS, BwdVariant
from flashgen.kernels.fwd_space import (
    MAX_ACC_PER_THREAD,
    NoDefaultFits,
    Pick,
    first_broken,
    longer_than_needed,
    over_shared_memory,
    rows_not_16_bytes,
    tile_reason,
)
from flashgen.kernels.hardware import DeviceInfo, device_info
from flashgen.kernels.problem import Problem

#: 256-row tiles are left out: dK and dV of a 256-key tile alone would fill every register.
BWD_BLOCK_SIZES = (16, 32, 64, 128)
BWD_WARPS = (2, 4, 8)
BWD_STAGES = (1, 2, 3, 4)
#: The Gluon dQ kernel's own streamed tile (`BwdVariant.dq_block_streamed`); 0 follows
#: block_streamed. Its 32-key tiles were the slow ones, so only the longer two are offered.
DQ_BLOCK_SIZES = (0, 64, 128)


def bwd_shared_memory_bytes(v: BwdVariant, p: Problem) -> int:
    """Estimate the shared memory of the bigger backward kernel.

    Both kernels stage the owned pair of tiles (K and V, or Q and dO: 2 x block_owned x D),
    the streamed pair per pipeline stage (2 x block_streamed x D each), and one
    block_owned x block_streamed probability tile on its way into a dot, so one formula
    covers dK/dV and dQ.
    """
    elem = 4 if p.dtype == "fp32" else 2
    d = p.padded_head_dim
    stages = max(1, v.num_stages)
    streamed = max(v.streamed("dkdv"), v.streamed("dq"))
    staged = 0
    if v.gluon("dkdv") and v.dq_mode == "atomic":
        # The Gluon dK/dV kernel's dQ share, staged in fp32 for its TMA reduce, and dS^T
        # for both consumers' products, double-buffered (the estimate's P tile is one).
        staged = 4 * v.block_streamed * d + elem * v.block_owned * v.block_streamed
    elif v.gluon("dkdv") and d > 128:
        # The wide dK/dV kernel's P^T and dS^T, double-buffered: four owned x streamed tiles
        # where the estimate counts one.
        staged = 3 * elem * v.block_owned * v.block_streamed
    if v.smem_stats:
        staged += 4 * 2 * v.block_streamed * stages  # the LSE and delta ring, fp32
    return staged + elem * (d * (2 * v.block_owned + 2 * streamed * stages)
                            + v.block_owned * streamed)


BwdRule = Callable[[BwdVariant, Problem, DeviceInfo], str | None]


def block_streamed_longer_than_needed(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # block_streamed steps over queries in dK/dV and over keys in the separate dQ kernel.
    reason = longer_than_needed("block_streamed", v.block_streamed, p.seq_q, "queries")
    if reason or v.dq_mode != "separate":
        return reason
    keys = v.streamed("dq")
    knob = "dq_block_streamed" if keys != v.block_streamed else "block_streamed"
    return longer_than_needed(knob, keys, p.seq_k, "keys", whose="the dQ kernel's")


def block_owned_longer_than_needed(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # block_owned is the owned tile: keys in dK/dV, queries in the separate dQ kernel.
    reason = longer_than_needed("block_owned", v.block_owned, p.seq_k, "keys")
    if reason or v.dq_mode != "separate":
        return reason
    return longer_than_needed("block_owned", v.block_owned, p.seq_q, "queries",
                              whose="the dQ kernel's")


def shared_memory_overflow(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    return over_shared_memory(bwd_shared_memory_bytes(v, p), dev)


def dq_tile_unused(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # dq_block_streamed is the Gluon dQ kernel's alone; anywhere else it would only repeat a
    # point.
    if v.dq_block_streamed not in DQ_BLOCK_SIZES:
        return (f"dq_block_streamed must be among {DQ_BLOCK_SIZES} (0: block_streamed), "
                f"not {v.dq_block_streamed}")
    if v.dq_block_streamed and not v.gluon("dq"):
        return ("dq_block_streamed sets the Gluon dQ kernel's tile: it needs fa3 'dq' or 'both' "
                "and dq_mode 'separate'")
    if v.dq_block_streamed == v.block_streamed:
        return f"dq_block_streamed {v.dq_block_streamed} repeats block_streamed: leave it 0"
    return None


def fa3_unavailable(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # The Gluon kernels: Hopper's wgmma and TMA, 64-row consumer warpgroups of 4 warps.
    if v.fa3 == "none":
        return None
    if not dev.is_hopper:
        return "fa3 backward kernels are Gluon kernels for Hopper (sm_90)"
    if p.dtype not in ("fp16", "bf16"):
        return f"fa3 backward kernels take fp16 or bf16, not {p.dtype}"
    if p.padded_head_dim not in (64, 128, 256):
        return (f"fa3 backward kernels tile head dims 64, 128 and 256 (or pad up to one), not "
                f"{p.head_dim}")
    if p.padded_head_dim == 256 and (reason := wide_fa3_unavailable(v, p)):
        return reason
    if reason := rows_not_16_bytes("fa3 backward", p):
        # Below its tile a head dim (80, 96, 112) is padded by TMA: zero fill on load,
        # clipped on store; its rows need only be 16-byte multiples.
        return reason
    if v.dq_mode == "atomic" and v.fa3 != "both":
        return ("fa3 'dq' is the Gluon dQ kernel, which the atomic mode does not launch: "
                "use fa3 'both' (the Gluon dK/dV kernel adds dQ) or 'none'")
    if v.dq_mode == "atomic" and v.block_streamed < 64:
        # dQ = dS K has the streamed query rows as its M dimension: one wgmma is 64 rows.
        return ("the Gluon dK/dV kernel's dQ product takes 64 query rows or more, not "
                f"block_streamed {v.block_streamed}")
    if v.num_warps != 4:
        return f"fa3 backward kernels run 4-warp consumers, not num_warps {v.num_warps}"
    if v.block_owned not in (64, 128):
        return ("fa3 backward kernels own 64 rows per consumer: block_owned 64 or 128, "
                f"not {v.block_owned}")
    if v.block_streamed < 32:
        return f"fa3 backward kernels stream tiles of 32 rows or more, not {v.block_streamed}"
    if v.gluon("dkdv") and p.padded_head_dim == 128 and v.block_streamed > 64:
        # dK and dV of a consumer's 64 keys take 128 of its 240 registers at D128.
        return (f"fa3 dK/dV at head_dim 128 spills with block_streamed {v.block_streamed} "
                "(at most 64)")
    return None


def wide_fa3_unavailable(v: BwdVariant, p: Problem) -> str | None:
    """Above D128 (padded to 256): the wide dK/dV kernel (two consumers split the head dim of
    one program's 64 keys; window and softcap, not the packed layout) and the dQ kernel with
    one consumer of 64 rows, whose 64 x 256 fp32 accumulator leaves room for score tiles of
    64 keys at most."""
    if v.block_owned != 64:
        return f"fa3 backward kernels above head dim 128 own 64 rows, not {v.block_owned}"
    if v.dq_mode != "separate":
        return "fa3 backward kernels above head dim 128 take dq_mode 'separate' only"
    if v.gluon("dkdv") and v.block_streamed > 64:
        return ("the wide fa3 dK/dV kernel streams 32 or 64 query rows, not "
                f"{v.block_streamed}")
    if v.gluon("dkdv") and p.varlen:
        # Its dK and dV leave by TMA store, which would write a packed tile's rows of the
        # next sequence.
        return "the wide fa3 dK/dV kernel takes no packed layout: use fa3 'none'"
    if v.gluon("dq") and v.streamed("dq") > 64:
        return ("the fa3 dQ kernel above head dim 128 streams 64 keys at most, not "
                f"{v.streamed('dq')}")
    return None


def accumulators_too_large(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    if v.gluon("dkdv"):
        return None  # one consumer per 64 keys; fa3_unavailable bounds its tiles
    # dK/dV is the heavier kernel: dK and dV (2 x block_owned x D fp32) plus two live
    # block_owned x block_streamed score tiles (P and dP, then dS) sit in registers across its
    # threads.
    threads = 32 * v.num_warps
    per_thread = 2 * v.block_owned * (p.padded_head_dim + v.block_streamed) // threads
    if per_thread > 2 * MAX_ACC_PER_THREAD:
        return (
            f"{per_thread} accumulator registers per thread "
            "(2 x block_owned x (D + block_streamed) too big for the warps)"
        )
    return None


def too_many_warps(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # fa3's num_warps is always 4 (per consumer); fa3_unavailable checks it.
    # The owned tile's rows are split across warps, at least 16 rows per warp's matrix
    # instructions; more warps than that leave some idle or duplicate work.
    if v.num_warps > max(1, v.block_owned // 16) * 2:
        return f"{v.num_warps} warps for a {v.block_owned}-row owned tile"
    return None


#: The modifiers the Gluon (fa3) dK/dV and dQ kernels take: the packed layout (descriptors
#: over the packing, gradients stored through a row mask per sequence), window and softcap
#: as structure, and sinks, which need nothing in any backward kernel (dsinks is a row sum
#: the launcher takes from LSE and delta).
FA3_BWD_MODIFIERS = frozenset({"varlen", "window", "softcap", "sinks"})


def modifiers_need_triton_kernels(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # Every modifier is written into the Triton dK/dV and dQ templates; the Gluon ones take
    # FA3_BWD_MODIFIERS. A modifier added later runs in the Triton kernels until the Gluon
    # ones take it.
    missing = [name for name in p.modifiers if name not in FA3_BWD_MODIFIERS]
    if missing and v.fa3 != "none":
        return f"{', '.join(missing)} run in the Triton backward kernels only (fa3 'none')"
    return None


def fused_delta_needs_a_dq_kernel(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # delta is worked out where dO is on chip row by row: the dQ kernel's prologue (Triton's
    # or Gluon's); the atomic mode has no dQ kernel.
    if v.fused_delta and v.dq_mode != "separate":
        return "fused_delta runs in the dQ kernel: dq_mode 'separate' only"
    return None


def smem_stats_needs_the_gluon_dkdv_kernel(v: BwdVariant, p: Problem,
                                           dev: DeviceInfo) -> str | None:
    # Only the Gluon dK/dV kernels (the wide one above D128 too) have the staging warp.
    if v.smem_stats and not v.gluon("dkdv"):
        return "smem_stats is the Gluon dK/dV kernel's: fa3 'both'"
    return None


def lpt_needs_causal_gluon_kernels(v: BwdVariant, p: Problem, dev: DeviceInfo) -> str | None:
    # Only the causal mask makes programs' work differ; packed sequences and windows keep
    # grid order (their work follows the lengths and the window, not the block index).
    if not v.lpt:
        return None
    if not (v.gluon("dkdv") or v.gluon("dq")):
        return "lpt orders the Gluon kernels' programs: fa3 'dq' or 'both'"
    if not p.causal or p.varlen or p.window:
        return ("lpt is for the causal mask without packing or a window: elsewhere it "
                "repeats a point")
    return None


BWD_RULES: tuple[BwdRule, ...] = (
    fused_delta_needs_a_dq_kernel,
    smem_stats_needs_the_gluon_dkdv_kernel,
    lpt_needs_causal_gluon_kernels,
    modifiers_need_triton_kernels,
    dq_tile_unused,
    fa3_unavailable,
    block_streamed_longer_than_needed,
    block_owned_longer_than_needed,
    shared_memory_overflow,
    accumulators_too_large,
    too_many_warps,
)


def why_invalid_bwd(
    v: BwdVariant, p: Problem, device: DeviceInfo | str | None = None
) -> str | None:
    """The first rule `v` breaks for problem `p` on `device`, or None if the variant is valid."""
    dev = device_info(device)
    if v.dq_mode not in DQ_MODES:
        return f"unknown dq_mode {v.dq_mode!r}; use one of {DQ_MODES}"
    if v.fa3 not in FA3_KERNELS:
        return f"unknown fa3 {v.fa3!r}; use one of {FA3_KERNELS}"
    for name in ("fused_delta", "smem_stats", "lpt"):
        if not isinstance(getattr(v, name), bool):
            return f"{name} must be true or false, not {getattr(v, name)!r}"
    return (tile_reason(v, (v.block_streamed, v.block_owned), BWD_BLOCK_SIZES, BWD_WARPS)
            or first_broken(BWD_RULES, v, p, dev))


def all_bwd_points() -> list[BwdVariant]:
    """Every point before the validity rules: the full grid."""
    return [
        BwdVariant(bm, bn, w, s, mode, fa3, dq_bm, fused, stats, lpt)
        for fa3, mode, bm, bn, w, s, dq_bm, fused, stats, lpt in itertools.product(
            FA3_KERNELS, DQ_MODES, BWD_BLOCK_SIZES, BWD_BLOCK_SIZES, BWD_WARPS, BWD_STAGES,
            DQ_BLOCK_SIZES, (False, True), (False, True), (False, True),
        )
    ]


def bwd_search_space(problem: Problem, device: DeviceInfo | str | None = None) -> list[BwdVariant]:
    """The valid backward variants for `problem` on `device`, in a stable order."""
    dev = device_info(device)
    return [v for v in all_bwd_points() if why_invalid_bwd(v, problem, dev) is None]


_16BIT = ("fp16", "bf16")

#: The untuned backward default: the first row that serves the problem and is valid for it
#: (Gluon rows only when asked for). Rows without a measurement are untimed guesses in the
#: spirit of FlashAttention 2's backward: a big owned key tile (128) with a narrower query
#: step, more warps as the head dim grows, smaller tiles for D > 128 where dK and dV alone
#: take half the registers; the separate dQ kernel is preferred for being deterministic. The
#: tail steps down to the 16 x 16 tile, which every problem admits.
#: Measurements: docs/backward-kernels.md.
BWD_DEFAULTS: tuple[Pick[BwdVariant], ...] = (
    # The Gluon rows serve the head dims they were measured at; a padded one (40, 96) takes
    # them only where tuned, the tuner's gate having checked them there.
    Pick(BwdVariant(64, 128, 4, 2, fa3="both", smem_stats=True, lpt=True), "the row below "
         "under the causal mask, programs launched heaviest first: +2-8% on the backward "
         "alone at D128 N2k-8k (H100)", exact_d=True),
    Pick(BwdVariant(64, 128, 4, 2, fa3="both", smem_stats=True), "both Gluon kernels, LSE "
         "and delta staged in shared memory: at D128 1-4% ahead of the same without, which won "
         "every D128 fa-bench key on H100 and H200; at D64 0.86-0.94x cuDNN's backward where "
         "the Triton dK/dV with the Gluon dQ read 0.81-0.90x (H100)", exact_d=True),
    Pick(BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64), "Triton dK/dV, Gluon "
         "dQ on 64-key tiles: won most D64 keys", max_d=64, hopper=True, exact_d=True),
    Pick(BwdVariant(64, 64, 4, 2, fa3="both", fused_delta=True, smem_stats=True), "D256: the "
         "wide Gluon dK/dV kernel and the Gluon dQ with delta, LSE and delta staged: won the 8 "
         "gemma2-9b bf16 keys and the 8 D192 keys (H100); the head dims padded to it too "
         "(129-192 skip the padding: 1.04-1.09x cuDNN's backward at D192, where the Triton "
         "row below read 0.35x); with window or softcap only where tuned", min_d=256,
         unmodified=True),
    # fp32 dots run exactly on CUDA cores, unrolled per thread: big tiles compile for
    # minutes, and fp32 is the exactness path, so compile time decides.
    Pick(BwdVariant(16, 32, 4, 1), "fp32 at D >= 128: seconds to compile, not half a minute",
         min_d=128, dtypes=("fp32",)),
    Pick(BwdVariant(32, 64, 4, 1), "fp32 up to D64", max_d=64, dtypes=("fp32",)),
    Pick(BwdVariant(32, 32, 4, 1), "fp32 up to D64, smaller", max_d=64, dtypes=("fp32",)),
    Pick(BwdVariant(32, 128, 4, 3), "D64 Triton winner on Hopper", max_d=64, dtypes=_16BIT,
         hopper=True),
    Pick(BwdVariant(64, 128, 8, 3), "D64, wider query step", max_d=64, dtypes=_16BIT,
         hopper=True),
    Pick(BwdVariant(32, 128, 4, 2), "D64 off Hopper", max_d=64, dtypes=_16BIT, hopper=False),
    Pick(BwdVariant(64, 128, 8, 2), "D64 off Hopper, wider query step", max_d=64,
         dtypes=_16BIT, hopper=False),
    Pick(BwdVariant(64, 128, 8, 2), "D128 Triton", min_d=128, max_d=128, dtypes=_16BIT),
    Pick(BwdVariant(32, 128, 8, 2), "D128 Triton, narrower query step", min_d=128, max_d=128,
         dtypes=_16BIT),
    Pick(BwdVariant(32, 64, 8, 2), "D256: dK and dV take half the registers", min_d=256,
         dtypes=_16BIT),
    Pick(BwdVariant(32, 64, 8, 1), "D256, unpipelined", min_d=256, dtypes=_16BIT),
    Pick(BwdVariant(64, 64, 4, 2), "smaller tiles from here on"),
    Pick(BwdVariant(32, 64, 4, 2), "smaller still"),
    Pick(BwdVariant(32, 32, 4, 1), "smaller still"),
    Pick(BwdVariant(16, 32, 4, 1), "smaller still"),
    Pick(BwdVariant(32, 16, 2, 1), "short key blocks"),
    Pick(BwdVariant(16, 16, 2, 1), "the smallest tile: every problem admits it"),
)


def default_bwd_variant(problem: Problem, device: DeviceInfo | str | None = None,
                        fa3: bool = True) -> BwdVariant:
    """A hand-picked backward variant valid for any problem: the answer when nothing was tuned
    (the first row of BWD_DEFAULTS that serves `problem` and is valid for it). `fa3` False
    skips the Gluon rows: the all-Triton default, which the portfolio also measures."""
    dev = device_info(device)
    for pick in BWD_DEFAULTS:
        v = pick.variant
        if (pick.serves(problem, dev) and (fa3 or v.fa3 == "none")
                and why_invalid_bwd(v, problem, dev) is None):
            return v
    raise NoDefaultFits(f"no default backward variant fits {problem}")


#: Gluon (fa3) points measured before the sampler's on Hopper, in this order, where valid,
#: then the all-Triton default (see `bwd_portfolio`). Measurements: docs/backward-kernels.md.
HOPPER_BWD_PORTFOLIO: tuple[Pick[BwdVariant], ...] = (
    # Causal problems only (the rule): the causal winners' points with their programs
    # launched heaviest first, +1-8% on the backward alone (H100).
    Pick(BwdVariant(128, 128, 4, 2, "atomic", "both", smem_stats=True, lpt=True), "the "
         "five-product kernel on the 128-row step, heaviest programs first (D64)"),
    Pick(BwdVariant(64, 128, 4, 2, "atomic", "both", smem_stats=True, lpt=True), "the same "
         "on 64-row steps"),
    Pick(BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True, smem_stats=True, lpt=True),
         "both Gluon kernels, delta in the dQ kernel, heaviest programs first"),
    Pick(BwdVariant(64, 128, 4, 2, fa3="both", smem_stats=True, lpt=True), "both Gluon "
         "kernels, heaviest programs first"),
    Pick(BwdVariant(64, 128, 4, 2, "atomic", "both", smem_stats=True), "the five-product "
         "kernel with LSE and delta staged in shared memory by a warp of their own: "
         "0.91-0.97x cuDNN's backward at bf16 D64 and D128 N2k-8k, 1-12% ahead of the same "
         "without (H100)"),
    Pick(BwdVariant(128, 128, 4, 2, "atomic", "both", smem_stats=True), "the same on the "
         "128-row step (D64): 0.91-0.99x"),
    Pick(BwdVariant(64, 128, 4, 2, fa3="both", smem_stats=True), "both Gluon kernels "
         "(deterministic), the stats staged: 1-4% ahead at D128, 4-10% at D64"),
    Pick(BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True, smem_stats=True), "the same "
         "with delta worked out in its dQ kernel (short problems)"),
    Pick(BwdVariant(64, 128, 4, 2, "atomic", "both"), "FlashAttention 3's five products: the "
         "Gluon dK/dV kernel adds dQ by TMA reduce (no dQ kernel; not deterministic): "
         "0.86-0.95x cuDNN on the H100's bf16 fa-bench cells, the best at D64"),
    Pick(BwdVariant(128, 128, 4, 2, "atomic", "both"), "the same on the 128-row step (D64)"),
    Pick(BwdVariant(64, 128, 4, 2, fa3="both"), "both Gluon kernels, 64-query steps: the "
         "D128 winner"),
    Pick(BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True), "the D128 winner with delta "
         "worked out in its dQ kernel: 3-9% faster backward at N512-2k (H100)"),
    Pick(BwdVariant(64, 128, 4, 3, fa3="both"), "the same on a 3-stage ring"),
    Pick(BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64), "the Triton dK/dV tile that "
         "wins at D64, with the Gluon dQ on 64-key tiles"),
    Pick(BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64, fused_delta=True), "the "
         "same with delta in its dQ kernel: 3-8% faster backward at N512-2k (H100)"),
    Pick(BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=128), "the same, dQ on 128-key "
         "tiles"),
    Pick(BwdVariant(128, 128, 4, 2, fa3="both"), "D64: the Gluon dK/dV's 128-row step, S^T "
         "issued alone (it spilled with S^T and dP^T together)"),
    Pick(BwdVariant(128, 128, 4, 2, fa3="both", dq_block_streamed=64), "the same, dQ on 64-key "
         "tiles"),
    Pick(BwdVariant(64, 64, 4, 2, fa3="both", fused_delta=True, smem_stats=True), "D256: "
         "the wide dK/dV kernel, LSE and delta staged (sm_90a: spills 84 -> 12 bytes)",
         min_d=256),
    Pick(BwdVariant(64, 64, 4, 2, fa3="both", fused_delta=True), "D256: the wide dK/dV kernel "
         "(two consumers split the head dim) and the dQ kernel with delta, 64-row steps: "
         "won 7 of the 8 gemma2-9b bf16 keys (H100)", min_d=256),
    Pick(BwdVariant(64, 64, 4, 2, fa3="both"), "the same with the preprocessing kernel",
         min_d=256),
    Pick(BwdVariant(32, 64, 4, 3, fa3="both"), "D256: 32-query steps on a 3-stage ring",
         min_d=256),
)


def bwd_portfolio(problem: Problem, device: DeviceInfo | str | None = None) -> list[BwdVariant]:
    """Points the tuner measures first on Hopper: the portfolio's valid Gluon points, then
    the all-Triton default and its fused_delta twin (one launch fewer: short problems are
    host-bound), so every key also holds the Triton kernels' time."""
    dev = device_info(device)
    if not dev.is_hopper:
        return []
    points = [pick.variant for pick in HOPPER_BWD_PORTFOLIO if pick.serves(problem, dev)
              and why_invalid_bwd(pick.variant, problem, dev) is None]
    triton = default_bwd_variant(problem, dev, fa3=False)
    fused = replace(triton, fused_delta=True)
    return [*points, triton, *([fused] if why_invalid_bwd(fused, problem, dev) is None else [])]


def bwd_pointer_twin(variant: BwdVariant, problem: Problem,
                     device: DeviceInfo | str | None = None) -> BwdVariant:
    """The variant with every kernel a Triton one: what runs where the Gluon kernels cannot
    (inputs TMA cannot address), computing the same gradients. The same tiles where the
    Triton kernels take them, else 8 warps, else the Triton default."""
    twin = replace(variant, fa3="none", dq_block_streamed=0, smem_stats=False, lpt=False)
    for candidate in (twin, replace(twin, num_warps=8)):
        if why_invalid_bwd(candidate, problem, device) is None:
            return candidate
    # The default keeps the variant's kernel roles (fused_delta: no preprocessing kernel),
    # which are all an exported package ships.
    fallback = default_bwd_variant(problem, device, fa3=False)
    fused = replace(fallback, fused_delta=variant.fused_delta)
    return fused if why_invalid_bwd(fused, problem, device) is None else fallback
