"""The search space: every variant, and the named rules that drop the ones that cannot work.

Rules exclude points up front (a tile that cannot fit shared memory, a block longer than the
sequence needs), so the tuner spends no time on them and nothing crashes to find them out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from flashgen.kernels.hardware import DeviceInfo, device_info
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import LOOP_ORDERS, Variant

if TYPE_CHECKING:
    from flashgen.kernels.bwd_variant import BwdVariant

BLOCK_SIZES = (16, 32, 64, 128, 256)
WARPS = (2, 4, 8)
STAGES = (1, 2, 3, 4)
#: Programs per SM a persistent grid aims for (0: not persistent).
PERSISTENT = (0, 1, 2)

#: Accumulator registers a thread may hold (fp32 values) before the compiler starts spilling.
MAX_ACC_PER_THREAD = 128


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def shared_memory_bytes(v: Variant, p: Problem) -> int:
    """Estimate the shared memory a variant stages: the Q tile (and fa3's O where it has
    its own), plus K and V tiles per stage."""
    elem = 4 if p.dtype == "fp32" else 2
    d = p.padded_head_dim
    stages = max(1, v.num_stages)
    # fa3 stages O through Q's buffer, except on a persistent grid: there Q is double-buffered
    # (the next tile's loads during this one) and O, written while both are in use, has its own.
    q_and_o = 3 * v.block_m if v.loop_order == "fa3" and v.persistent else v.block_m
    # One-tile fa3 also stores each row's running sum (fp32) where nothing reads it.
    row_sums = 4 * v.block_m if v.loop_order == "fa3" and not v.persistent else 0
    return elem * d * (q_and_o + 2 * v.block_n * stages) + row_sums


Rule = Callable[[Variant, Problem, DeviceInfo], str | None]


def block_m_longer_than_queries(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    if v.block_m > _pow2_at_least_16(p.seq_q):
        return f"block_m {v.block_m} is longer than the {p.seq_q} queries need"
    return None


def block_n_longer_than_keys(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    if v.block_n > _pow2_at_least_16(p.seq_k):
        return f"block_n {v.block_n} is longer than the {p.seq_k} keys need"
    return None


def shared_memory_overflow(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    need = shared_memory_bytes(v, p)
    if need > dev.shared_memory:
        return f"needs ~{need} B of shared memory, device has {dev.shared_memory}"
    return None


def accumulator_too_large(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # The fp32 output tile block_m x D and score tile block_m x block_n live in registers,
    # spread over the program's threads; past this they spill to local memory.
    # fa3 spreads them over every consumer warpgroup: 16 rows a warp, whatever the count.
    threads = 2 * v.block_m if v.loop_order == "fa3" else 32 * v.num_warps
    per_thread = v.block_m * (p.padded_head_dim + v.block_n) // threads
    if per_thread > 2 * MAX_ACC_PER_THREAD:
        return f"{per_thread} accumulator registers per thread (block_m x (D + block_n) too big)"
    return None


def too_many_warps(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # Each warp's matrix instructions cover at least 16 rows of the Q tile (the rows are split
    # across warps); more warps than that leave some idle or duplicate work.
    if v.num_warps > max(1, v.block_m // 16) * 2:
        return f"{v.num_warps} warps for a {v.block_m}-row Q tile"
    return None


def fa1_pipelining(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # The fa1 inner loop reads and writes running O/m/l through global memory with a barrier
    # between steps, so deep K/V pipelining only adds shared memory.
    if v.loop_order == "fa1" and v.num_stages > 2:
        return "fa1 pipelines at most 2 stages"
    return None


def fa1_has_no_fa2_knobs(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # fa1 masks every step and has no separate main loop: one point per tile shape.
    if v.loop_order == "fa1" and (
        not v.split_mask or v.warp_specialize or v.use_tma or v.persistent
    ):
        return "split_mask/warp_specialize/use_tma/persistent are fa2 knobs"
    return None


def warp_specialize_needs_hopper(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # Triton's warp specialization of this loop was written and measured for Hopper; later
    # GPUs get the portable loop (see DeviceInfo.is_hopper). The interpreter ignores the
    # knob, which lets CPU tests exercise the code path.
    if v.warp_specialize and not (dev.is_hopper or dev.is_interpreter):
        return "warp_specialize needs a Hopper GPU (compute capability 9.x)"
    return None


def tma_needs_hopper_and_aligned_rows(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # TMA descriptors are served on Hopper only (the interpreter emulates them, for CPU
    # tests), and every stride but the last must be a multiple of 16 bytes: rows of D
    # elements must be.
    if not v.use_tma:
        return None
    if not (dev.is_hopper or dev.is_interpreter):
        return "use_tma needs a Hopper GPU (compute capability 9.x)"
    elem = 4 if p.dtype == "fp32" else 2
    if (p.head_dim * elem) % 16:
        return f"use_tma needs 16-byte rows; head dim {p.head_dim} x {elem} B is not"
    return None


#: fa3 (block_m, num_warps): one consumer of 64 or 128 rows, or two or three of 64. Two
#: consumers of 128 rows (17 warps) would leave each thread too few registers for S and O.
FA3_TILES = ((64, 4), (128, 4), (128, 8), (192, 4))
#: fa3 block_m outside BLOCK_SIZES: three 64-row consumers (FlashAttention 3's D64 tile), 160
#: registers a thread each. The persistent template alone has the third consumer.
FA3_EXTRA_BLOCK_M = tuple(m for m, _ in FA3_TILES if m not in BLOCK_SIZES)
FA3_HEAD_DIMS = (64, 128)


def fa3_needs_hopper_and_16bit(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # Gluon's warpgroup MMA, TMA and register reallocation are Hopper instructions, and the
    # interpreter cannot run Gluon. P is fed to the tensor cores as 16-bit A operands, and
    # TMA tiles carry no column mask, so the head dim must be a supported power of two.
    if v.loop_order != "fa3":
        return None
    if not dev.is_hopper:
        return "fa3 needs a Hopper GPU (compute capability 9.x; Gluon does not interpret)"
    if p.dtype not in ("fp16", "bf16"):
        return f"fa3 runs fp16 and bf16, not {p.dtype}"
    if p.head_dim not in FA3_HEAD_DIMS:
        return f"fa3 runs head dims {FA3_HEAD_DIMS}, not {p.head_dim}"
    return None


def fa3_tiles(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # TMA is built in and the mask is always split, so the fa2 knobs have one value here.
    if v.loop_order != "fa3":
        return None
    if (v.block_m, v.num_warps) not in FA3_TILES:
        return f"fa3 (block_m, num_warps) must be among {FA3_TILES}"
    if v.block_n not in (64, 128):
        return "fa3 block_n must be 64 or 128"
    if not 2 <= v.num_stages <= 4:
        return "fa3 keeps 2 to 4 K/V stages"
    if not v.split_mask or v.warp_specialize or v.use_tma:
        return ("fa3 has its own warp roles and TMA: split_mask/warp_specialize/use_tma are "
                "fa2 knobs")
    if v.persistent not in (0, 1):
        # Its tiles take most of an SM's shared memory: one program per SM is all that fits.
        return "fa3 persistent is 0 (a program per Q tile) or 1 (a program per SM)"
    if v.block_m in FA3_EXTRA_BLOCK_M and not v.persistent:
        return f"fa3 block_m {v.block_m} (three consumers) runs on the persistent grid only"
    return None


def pingpong_needs_fa3_consumers(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # Turns are taken between consumer warpgroups of the persistent fa3 kernel: with one
    # consumer there is no one to take turns with, and the other kernels have no such roles.
    if not v.pingpong:
        return None
    if v.loop_order != "fa3" or not v.persistent:
        return "pingpong is a knob of fa3 on the persistent grid"
    if v.fa3_consumers < 2:
        return "pingpong needs two or three fa3 consumers (block_m / (16 x num_warps) >= 2)"
    return None


def head_units_need_causal_persistent_fa3(v: Variant, p: Problem,
                                         dev: DeviceInfo) -> str | None:
    # A head's Q tiles differ in length only under the causal mask, where a program walks
    # them in pairs or (this knob) whole heads; without the mask every tile is its own unit.
    if not v.head_units:
        return None
    if v.loop_order != "fa3" or not v.persistent:
        return "head_units is a knob of fa3 on the persistent grid"
    if not p.causal:
        return "head_units is a schedule for the causal mask (without it tiles are equal)"
    return None


def persistent_out_of_range(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    if v.persistent not in PERSISTENT:
        return f"persistent must be among {PERSISTENT} (programs per SM; 0 is off)"
    return None


RULES: tuple[Rule, ...] = (
    persistent_out_of_range,
    block_m_longer_than_queries,
    block_n_longer_than_keys,
    shared_memory_overflow,
    accumulator_too_large,
    too_many_warps,
    fa1_pipelining,
    fa1_has_no_fa2_knobs,
    warp_specialize_needs_hopper,
    tma_needs_hopper_and_aligned_rows,
    fa3_needs_hopper_and_16bit,
    fa3_tiles,
    pingpong_needs_fa3_consumers,
    head_units_need_causal_persistent_fa3,
)


def why_invalid(v: Variant, p: Problem, device: DeviceInfo | str | None = None) -> str | None:
    """The first rule `v` breaks for problem `p` on `device`, or None if the variant is valid."""
    dev = device_info(device)
    if v.loop_order not in LOOP_ORDERS:
        return f"unknown loop_order {v.loop_order!r}; use one of {LOOP_ORDERS}"
    extra_m = FA3_EXTRA_BLOCK_M if v.loop_order == "fa3" else ()
    return tile_reason(v, BLOCK_SIZES, WARPS, extra_m) or first_broken(RULES, v, p, dev)


def tile_reason(v: Variant | BwdVariant, blocks: tuple[int, ...],
                warps: tuple[int, ...], extra_m: tuple[int, ...] = ()) -> str | None:
    """Why the tile knobs every variant kind has are outside its grid, or None."""
    if v.block_m not in blocks + extra_m or v.block_n not in blocks:
        return f"block sizes must be among {blocks}" + (
            f" (block_m also {extra_m})" if extra_m else "")
    if v.num_warps not in warps and v.num_warps != 1:
        return f"num_warps must be among {warps}"
    if v.num_stages < 1:
        return "num_stages must be at least 1"
    return None


def first_broken(rules: tuple[Callable, ...], v: Variant | BwdVariant, p: Problem,
                 dev: DeviceInfo) -> str | None:
    """The reason of the first rule `v` breaks, or None."""
    for rule in rules:
        reason = rule(v, p, dev)
        if reason:
            return reason
    return None


def all_points() -> list[Variant]:
    """Every point before the validity rules: the full grid."""
    return [
        Variant(order, bm, bn, w, s, split, ws, tma, persist, pp, heads)
        for order, bm, bn, w, s, split, ws, tma, persist, pp, heads in itertools.product(
            LOOP_ORDERS, BLOCK_SIZES + FA3_EXTRA_BLOCK_M, BLOCK_SIZES, WARPS, STAGES,
            (True, False), (False, True), (False, True), PERSISTENT, (False, True),
            (False, True),
        )
    ]


def search_space(problem: Problem, device: DeviceInfo | str | None = None) -> list[Variant]:
    """The valid variants for `problem` on `device`, in a stable order."""
    dev = device_info(device)
    return [v for v in all_points() if why_invalid(v, problem, dev) is None]


def _fa3(bm: int, bn: int, warps: int, stages: int, *, persistent: int = 0,
         pingpong: bool = False, heads: bool = False) -> Variant:
    return Variant("fa3", bm, bn, warps, stages, persistent=persistent, pingpong=pingpong,
                   head_units=heads)


def _fa2(bm: int, bn: int, warps: int, stages: int, *, ws: bool = False,
         tma: bool = True) -> Variant:
    return Variant("fa2", bm, bn, warps, stages, split_mask=True, warp_specialize=ws,
                   use_tma=tma)


#: Hopper points that measured fastest when whole blocks of the fa2 space were swept
#: (`scripts/sweep_fwd.py` on an H100, 2026-11-22, fp16, N = 2k..16k, causal and not; NOTES.md):
#: by padded head dim, fastest first. A tuner sampling a few points of a space this size
#: rarely lands on them (the shipped D128 winners had missed the 128x128 TMA tiles, ~10%
#: faster), so they are measured first and the sampler explores from there.
#: The fa3 points lead: two 64-row consumers measured up to 1.09x (D128) and 1.12x (D64)
#: cuDNN on an H100 and beat the tuned fa2 winners at D128 from N=2k (2026-11-23, NOTES.md;
#: `scripts/sweep_fa3.py` re-measures them).
#: The persistent fa3 points follow: one program per SM hides the TMA prologue and epilogue
#: that dominate short programs (H100, 2026-11-23, an experiment of the same kernel: D128
#: N512 0.69 -> 0.84x cuDNN at 2 stages, D64 N512 0.67 -> 0.83x; NOTES.md "fa3"). Tuned on
#: fa-bench and llama3-8b (2026-11-24) they won about half of the keys on both GPUs (most of
#: D64 and of GQA D128 up to 4k); fa2 kept only D64 N512 causal. Since a slot's K and V are
#: released apart (2026-11-24), persistent m128 n128 s2 measured 1.00-1.11x cuDNN at D128
#: N512-8k on an H100 (NOTES.md), so the persistent points now come first: a short re-tune
#: (`--trials 3`) measures them and the strongest one-tile point. Since each causal consumer
#: stops at its own last visible key (2026-11-24), persistent m128 n64 s3 ran 0.95x cuDNN at
#: D64 N512 causal (fa2's best 0.88x) and 1.00x at D128 N512 causal (0.96x before).
#: Three 64-row consumers (m192, D64) ran 1.03-1.06x cuDNN at N2k-4k without the mask, where
#: m128 ran 0.99-1.02x, and lost at N512-1k (0.94-0.95 against 1.01-1.03; H100, 2026-11-24,
#: `scripts/ab_templates.py`, NOTES.md "three consumers"). Under the causal mask they spill
#: (160 registers a thread) and ran 0.40-0.86x, so `portfolio` leaves them out there.
#: With the consumers taking turns at the tensor cores (pingpong), persistent m128 n128 s2 ran
#: 2-8% faster at D128 from N1k (N2k causal 1.02 -> 1.10x cuDNN), even at N512, and three
#: consumers at D64 without the mask 1-5% faster (m192 n128 s3, N2k 1.04 -> 1.09x); two
#: consumers at D64 and 64-key tiles ran 0-3% slower (H100, 2026-11-24,
#: `scripts/ab_templates.py`, NOTES.md "ping-pong"). So ping-pong leads at D128 and among
#: the three-consumer points, with the plain points right after it.
#: Under the causal mask a program of the persistent kernel may take whole heads instead of
#: tile pairs (head_units): at D64 N512 m128 n128 s3 ran 0.996x cuDNN against 0.90x in pairs
#: and 0.98x for the best pair point, but slower from N1k and at D128 (0.75x; H100,
#: 2026-11-25, `scripts/ab_templates.py`, NOTES.md), so it sits in the D64 list only, where
#: the rules keep it to causal problems.
#: Keys from which the untuned default takes fa3 over fa2 at head dim 64 (see default_variant).
FA3_DEFAULT_MIN_KEYS_D64 = 4096
#: Keys from which the untuned default takes three consumers at head dim 64 without the mask.
FA3_THREE_CONSUMERS_MIN_KEYS = 2048

HOPPER_PORTFOLIO: dict[str, tuple[Variant, ...]] = {
    "d<=64": (
        _fa3(192, 128, 4, 3, persistent=1, pingpong=True),
        _fa3(192, 128, 4, 3, persistent=1), _fa3(128, 128, 4, 3, persistent=1),
        _fa3(128, 128, 4, 2, persistent=1), _fa3(192, 128, 4, 4, persistent=1),
        _fa3(128, 64, 4, 3, persistent=1),
        _fa3(128, 128, 4, 3, persistent=1, heads=True),
        _fa3(128, 128, 4, 2, persistent=1, heads=True),
        _fa3(128, 128, 4, 3), _fa3(128, 128, 4, 4), _fa3(128, 128, 4, 2), _fa3(128, 64, 4, 4),
        _fa3(128, 128, 8, 3),
        _fa2(64, 128, 4, 2), _fa2(128, 64, 8, 4), _fa2(128, 128, 4, 3), _fa2(128, 64, 4, 3),
        _fa2(128, 64, 8, 3, ws=True, tma=False), _fa2(128, 64, 8, 4, tma=False),
        _fa2(64, 64, 4, 3, tma=False),
    ),
    "d>=128": (
        _fa3(128, 128, 4, 2, persistent=1, pingpong=True), _fa3(128, 128, 4, 2, persistent=1),
        _fa3(128, 64, 4, 3, persistent=1), _fa3(128, 64, 4, 3, persistent=1, pingpong=True),
        _fa3(128, 128, 4, 3), _fa3(128, 64, 4, 4, persistent=1),
        _fa3(128, 64, 4, 3), _fa3(128, 128, 4, 2), _fa3(128, 64, 4, 4), _fa3(128, 128, 8, 2),
        _fa2(128, 128, 8, 3, ws=True), _fa2(128, 128, 8, 3), _fa2(256, 64, 8, 4, ws=True),
        _fa2(128, 64, 4, 2), _fa2(64, 64, 4, 3), _fa2(256, 64, 8, 3),
    ),
}


def portfolio(problem: Problem, device: DeviceInfo | str | None = None) -> list[Variant]:
    """The valid points of the Hopper portfolio for `problem` (none on other devices).

    Head dims between 64 and 128 (80, 96) pad to 128 and take the d>=128 list; points that a
    rule excludes (shared memory at D=256, TMA on rows that are not 16-byte multiples) drop.
    """
    dev = device_info(device)
    if not dev.is_hopper:
        return []
    picks = HOPPER_PORTFOLIO["d>=128" if problem.padded_head_dim >= 128 else "d<=64"]
    return [v for v in picks if why_invalid(v, problem, dev) is None
            and not (problem.causal and v.block_m in FA3_EXTRA_BLOCK_M)]


def default_variant(problem: Problem, device: DeviceInfo | str | None = None,
                    fa3: bool = True) -> Variant:
    """A hand-picked variant that is valid for any problem: the answer when nothing was tuned.

    Preferences go from the fastest general choice on recent GPUs down to the smallest tile,
    which every problem admits. With `fa3` False the Gluon kernels are left out: the
    portable Triton default, which dispatch falls back to where a kernel fails to compile.
    """
    dev = device_info(device)
    big_d = problem.padded_head_dim >= 128
    fa3_first = [
        # Hopper, 16-bit, D 64 or 128 (the fa3 rules drop it elsewhere). At D64 fa3 pays off
        # only from 4k keys on: below that a program is too short to hide its TMA prologue
        # (H100, 2026-11-23: 0.67-0.89x cuDNN against fa2's 0.85-0.93x; NOTES.md "fa3").
        # On the persistent grid: with K and V released apart it ran 1.00-1.11x cuDNN at D128
        # N1k-8k where the one-tile kernel ran 0.89-1.05x (H100, 2026-11-24, NOTES.md).
        # At D64 without the mask, three consumers from 2k keys. Three consumers, and two at
        # D128, take turns at the tensor cores (pingpong, see HOPPER_PORTFOLIO).
        *([Variant("fa3", 192, 128, 4, 3, persistent=1, pingpong=True)]
          if not big_d and not problem.causal
          and problem.seq_k >= FA3_THREE_CONSUMERS_MIN_KEYS else []),
        *([Variant("fa3", 128, 128, 4, 2, persistent=1, pingpong=big_d)]
          if big_d or problem.seq_k >= FA3_DEFAULT_MIN_KEYS_D64 else []),
    ]
    prefs = [
        *(fa3_first if fa3 else []),
        Variant("fa2", 128, 64, 8 if big_d else 4, 3 if dev.is_hopper else 2),
        Variant("fa2", 128, 32, 8, 2),
        Variant("fa2", 64, 64, 4, 2),
        Variant("fa2", 64, 32, 4, 2),
        Variant("fa2", 32, 32, 4, 2),
        Variant("fa2", 32, 16, 2, 1),
        Variant("fa2", 16, 32, 2, 1),
        Variant("fa2", 16, 16, 2, 1),
    ]
    for v in prefs:
        if why_invalid(v, problem, dev) is None:
            return v
    raise AssertionError(f"no default variant fits {problem}")  # the 16x16 tile always fits
