"""The search space: every variant, and the named rules that drop the ones that cannot work.

Rules exclude points up front (a tile that cannot fit shared memory, a block longer than the
sequence needs), so the tuner spends no time on them and nothing crashes to find them out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from flashgen.kernels.hardware import DeviceInfo, device_info
from flashgen.kernels.problem import FP8_BLOCK, FP8_MIN_D, MAX_HEAD_DIM, Problem
from flashgen.kernels.variant import LOOP_ORDERS, Variant

if TYPE_CHECKING:
    from flashgen.kernels.bwd_variant import BwdVariant

BLOCK_SIZES = (16, 32, 64, 128, 256)
WARPS = (2, 4, 8)
STAGES = (1, 2, 3, 4)
#: Programs per SM a persistent grid aims for (0: not persistent).
PROGRAMS_PER_SM = (0, 1, 2)

#: Accumulator registers a thread may hold (fp32 values) before the compiler starts spilling.
MAX_ACC_PER_THREAD = 128


def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def shared_memory_bytes(v: Variant, p: Problem) -> int:
    """Estimate the shared memory a variant stages: the Q tile (and fa3's O where it has
    its own), plus K and V tiles per stage."""
    elem = p.torch_dtype.itemsize
    d = p.padded_head_dim
    stages = max(1, v.num_stages)
    # fa3 stages O through Q's buffer, except on a persistent grid: there Q is double-buffered
    # (the next tile's loads during this one) and O, written while both are in use, has its own;
    # above D128 Q has one buffer, which also stages O (the template's `one_q`).
    persistent_fa3 = v.loop_order == "fa3" and v.programs_per_sm and d <= 128
    q_and_o = 3 * v.block_m if persistent_fa3 else v.block_m
    # fa2 on a persistent grid with TMA stages O for its TMA store while the next tile's K/V
    # loads hold their buffers, and fa1 pipelines its inner loop's Q and running-output
    # loads: each a block_m x D tile more. Fitted to an H100 sweep of every valid variant
    # (docs/search-quality.md), where exactly these kernels overflowed at D128.
    if (v.loop_order == "fa2" and v.use_tma and v.programs_per_sm) or v.loop_order == "fa1":
        q_and_o += v.block_m
    # One-tile fa3 also stores each row's running sum (fp32) where nothing reads it.
    row_sums = 4 * v.block_m if v.loop_order == "fa3" and not v.programs_per_sm else 0
    # fp8 fa3 stages its 16-bit O in a buffer of its own, and P for P V.
    o_fp8 = (2 * d + v.block_n) * v.block_m if v.loop_order == "fa3" and p.dtype == "fp8" else 0
    return elem * d * (q_and_o + 2 * v.block_n * stages) + row_sums + o_fp8


Rule = Callable[[Variant, Problem, DeviceInfo], str | None]


def longer_than_needed(knob: str, tile: int, count: int, what: str,
                       whose: str = "the") -> str | None:
    """Why a `tile` of `count` rows is too long (None: it is not); shared by the forward and
    backward rules so both spaces drop the same redundant points with the same words."""
    if tile > _pow2_at_least_16(count):
        return f"{knob} {tile} is longer than {whose} {count} {what} need"
    return None


def over_shared_memory(need: int, dev: DeviceInfo) -> str | None:
    """Why `need` bytes of shared memory do not fit on `dev` (None: they do)."""
    if need > dev.shared_memory:
        return f"needs ~{need} B of shared memory, device has {dev.shared_memory}"
    return None


def block_m_longer_than_queries(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    return longer_than_needed("block_m", v.block_m, p.seq_q, "queries")


def block_n_longer_than_keys(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # fp8 key tiles hold at least FP8_MIN_D keys however short the sequence (fp8_kernels).
    keys = max(p.seq_k, FP8_MIN_D) if p.dtype == "fp8" else p.seq_k
    return longer_than_needed("block_n", v.block_n, keys, "keys")


def shared_memory_overflow(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    return over_shared_memory(shared_memory_bytes(v, p), dev)


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
        not v.split_mask or v.warp_specialize or v.use_tma or v.programs_per_sm
    ):
        return "split_mask/warp_specialize/use_tma/programs_per_sm are fa2 knobs"
    return None


def warp_specialize_needs_hopper(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # Triton's warp specialization of this loop was written and measured for Hopper; later
    # GPUs get the portable loop (see DeviceInfo.is_hopper). The interpreter ignores the
    # knob, which lets CPU tests exercise the code path.
    if v.warp_specialize and not (dev.is_hopper or dev.is_interpreter):
        return "warp_specialize needs a Hopper GPU (compute capability 9.x)"
    return None


def warp_specialize_crashes_with_4_warps(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # Triton 3.6's warp-specialization pass (NVGPUWarpSpecialization) aborts on the split-mask
    # main loop with 4 warps and 64 or more query rows, at every head dim, dtype and mask
    # tried; 2 or 8 warps, 16 or 32 rows, or one masked loop compile (docs/testing.md).
    if (v.loop_order == "fa2" and v.warp_specialize and v.split_mask and v.num_warps == 4
            and v.block_m >= 64):
        return ("warp_specialize with 4 warps and block_m >= 64 crashes Triton's "
                "warp-specialization pass")
    return None


def tma_needs_hopper_and_aligned_rows(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # TMA descriptors are served on Hopper only (the interpreter emulates them, for CPU
    # tests), and every stride but the last must be a multiple of 16 bytes: rows of D
    # elements must be.
    if not v.use_tma:
        return None
    if not (dev.is_hopper or dev.is_interpreter):
        return "use_tma needs a Hopper GPU (compute capability 9.x)"
    return rows_not_16_bytes("use_tma", p)


def rows_not_16_bytes(who: str, p: Problem) -> str | None:
    """TMA's rule for a row of D elements (every stride but the last a multiple of 16 bytes);
    a padded head dim's extra columns are TMA's zero fill, so only the row itself counts."""
    elem = p.torch_dtype.itemsize
    if (p.head_dim * elem) % 16:
        return f"{who} needs 16-byte rows; head dim {p.head_dim} x {elem} B is not"
    return None


#: fa3 (block_m, num_warps): one consumer of 64 or 128 rows, or two or three of 64. Two
#: consumers of 128 rows (17 warps) would leave each thread too few registers for S and O.
FA3_TILES = ((64, 4), (128, 4), (128, 8), (192, 4))
#: fa3 block_m outside BLOCK_SIZES: three 64-row consumers (FlashAttention 3's D64 tile), 160
#: registers a thread each. The persistent template alone has the third consumer.
FA3_EXTRA_BLOCK_M = tuple(m for m, _ in FA3_TILES if m not in BLOCK_SIZES)
FA3_HEAD_DIMS = (64, 128, 256)
#: Head dims the persistent fa3 kernel takes. At D256 (16-bit only) Q has one buffer, which
#: also stages O, or there would be no room for a K/V ring (shared memory).
FA3_PERSISTENT_HEAD_DIMS = (64, 128, 256)


def fa3_needs_hopper_and_16bit(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # Gluon's warpgroup MMA, TMA and register reallocation are Hopper instructions, and the
    # interpreter cannot run Gluon. P is fed to the tensor cores as 16-bit (or, for fp8, 8-bit)
    # A operands. The kernels tile a supported power of two; a head dim below it (80, 96,
    # 112) is padded by TMA, which zero-fills the columns past D on load and clips them on
    # store, so its rows need only be 16-byte multiples.
    if v.loop_order != "fa3":
        return None
    if not dev.is_hopper:
        return "fa3 needs a Hopper GPU (compute capability 9.x; Gluon does not interpret)"
    if p.dtype not in ("fp16", "bf16", "fp8"):
        return f"fa3 runs fp16, bf16 and fp8, not {p.dtype}"
    d = p.padded_head_dim
    if d not in FA3_HEAD_DIMS:
        return f"fa3 tiles head dims {FA3_HEAD_DIMS} (or pads up to one), not {d}"
    if v.programs_per_sm and d not in FA3_PERSISTENT_HEAD_DIMS:
        return (f"fa3 on the persistent grid tiles head dims {FA3_PERSISTENT_HEAD_DIMS}, not "
                f"{d} (the one-tile kernel does)")
    if d > 128 and v.programs_per_sm and p.dtype == "fp8":
        # fp8 stages O and P in shared memory, which the one-buffer D256 kernel has no room for.
        return "fp8 fa3 on the persistent grid tiles head dims up to 128"
    if d > 128 and v.block_m in FA3_EXTRA_BLOCK_M:
        # Three consumers get 160 registers a thread; a 64 x 256 fp32 O takes 128 of them.
        return f"fa3 block_m {v.block_m} (three consumers) tiles head dims up to 128, not {d}"
    return rows_not_16_bytes("fa3", p)


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
    if v.programs_per_sm not in (0, 1):
        # Its tiles take most of an SM's shared memory: one program per SM is all that fits.
        return "fa3 programs_per_sm is 0 (a program per Q tile) or 1 (a program per SM)"
    if v.block_m in FA3_EXTRA_BLOCK_M and not v.programs_per_sm:
        return f"fa3 block_m {v.block_m} (three consumers) runs on the persistent grid only"
    return None


def pingpong_needs_fa3_consumers(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # Turns are taken between consumer warpgroups of the persistent fa3 kernel: with one
    # consumer there is no one to take turns with, and the other kernels have no such roles.
    if not v.pingpong:
        return None
    if v.loop_order != "fa3" or not v.programs_per_sm:
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
    if v.loop_order != "fa3" or not v.programs_per_sm:
        return "head_units is a knob of fa3 on the persistent grid"
    if not p.causal:
        return "head_units is a schedule for the causal mask (without it tiles are equal)"
    if p.varlen:
        # Packed sequences walk the launcher's tile schedule (costliest first), one
        # (Q tile, head) a unit: the schedule, not whole heads, balances the work.
        return ("head_units is a schedule of dense heads; packed sequences walk the "
                "launcher's tile schedule, one (Q tile, head) a unit")
    return None


def programs_per_sm_out_of_range(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    if v.programs_per_sm not in PROGRAMS_PER_SM:
        return f"programs_per_sm must be among {PROGRAMS_PER_SM} (0: a program per Q tile)"
    return None


#: What the one-tile fa3 template takes of the modifiers (16-bit inputs): all of them, alone
#: or together (fp8 takes none).
FA3_MODIFIERS = frozenset({"varlen", "window", "softcap", "sinks"})
#: The modifiers the persistent fa3 kernel takes: per-score and per-row ones, and packed
#: sequences (it walks the launcher's tile schedule, reading each unit's offsets). A window's
#: K/V range starts at a different tile per Q tile, which its K/V walk does not model.
FA3_PERSISTENT_MODIFIERS = frozenset({"softcap", "sinks", "varlen"})


def modifiers_need_pointer_kernels(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # Window, softcap and sinks are written into the fa1 and fa2 templates, the packed layout
    # into fa2 (fa1's scratch is laid out per (batch, head)); the one-tile fa3 kernel takes
    # FA3_MODIFIERS (its descriptors span the packing, its O store is masked per sequence,
    # its K/V range starts at the window), the persistent one FA3_PERSISTENT_MODIFIERS (the
    # packing as the one-tile one does, over a tile schedule).
    # fa2's TMA descriptors address whole (B, H, N, D) tensors, so its modified kernels load
    # through pointers.
    if not p.modifiers:
        return None
    if (v.loop_order == "fa3" and set(p.modifiers) <= FA3_MODIFIERS
            and p.dtype != "fp8"):
        if v.programs_per_sm and not set(p.modifiers) <= FA3_PERSISTENT_MODIFIERS:
            return (f"{', '.join(p.modifiers)} run in the one-tile fa3 kernel; the persistent "
                    f"one takes {', '.join(sorted(FA3_PERSISTENT_MODIFIERS))} only")
        return None
    if v.loop_order == "fa3" or v.use_tma:
        return (f"{', '.join(p.modifiers)} run in fa1 and fa2 without use_tma only "
                f"(not {v.loop_order}{' use_tma' if v.use_tma else ''})")
    if p.varlen and v.loop_order != "fa2":
        return "varlen (packed sequences) runs in fa2 and fa3, not fa1"
    return None


def fp8_kernels(v: Variant, p: Problem, dev: DeviceInfo) -> str | None:
    # The fp8 path is written into the fa2 template (pointer loads, or TMA with V read
    # keys-inner) and both fa3 ones, and reads one descale per tile: a tile (an fa3
    # consumer's rows) must lie inside one quantization block of rows. P V reduces over the
    # tile's keys, and 8-bit products need at least 32.
    if p.dtype != "fp8":
        return None
    if v.loop_order == "fa1":
        return "fp8 runs in fa2 and fa3 only (not fa1)"
    if v.loop_order == "fa3" and v.head_units:
        return "fp8 fa3 takes tile pairs, not whole heads (head_units is not built for fp8)"
    rows = v.fa3_rows if v.loop_order == "fa3" else v.block_m
    if FP8_BLOCK % rows or FP8_BLOCK % v.block_n:
        return (f"fp8 tiles must divide the {FP8_BLOCK}-row quantization block "
                f"({'fa3 rows' if v.loop_order == 'fa3' else 'block_m'} {rows}, "
                f"block_n {v.block_n})")
    if v.block_n < FP8_MIN_D:
        return f"fp8 P V products need at least {FP8_MIN_D} keys a tile (block_n {v.block_n})"
    if p.varlen:
        return "fp8 packed sequences are not built"
    if not dev.is_interpreter and dev.capability < (8, 9):
        return f"fp8 needs compute capability 8.9 or newer (this GPU has {dev.capability})"
    return None


RULES: tuple[Rule, ...] = (
    fp8_kernels,
    modifiers_need_pointer_kernels,
    programs_per_sm_out_of_range,
    block_m_longer_than_queries,
    block_n_longer_than_keys,
    shared_memory_overflow,
    accumulator_too_large,
    too_many_warps,
    fa1_pipelining,
    fa1_has_no_fa2_knobs,
    warp_specialize_needs_hopper,
    warp_specialize_crashes_with_4_warps,
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
    return (tile_reason(v, (v.block_m, v.block_n), BLOCK_SIZES, WARPS, extra_m)
            or first_broken(RULES, v, p, dev))


def tile_reason(v: Variant | BwdVariant, tiles: tuple[int, int], blocks: tuple[int, ...],
                warps: tuple[int, ...], extra_first: tuple[int, ...] = ()) -> str | None:
    """Why the two tiles (block_m, block_n; backward: streamed, owned), warps or stages that
    every variant kind has are outside its grid, or None."""
    if tiles[0] not in blocks + extra_first or tiles[1] not in blocks:
        return f"block sizes must be among {blocks}" + (
            f" (block_m also {extra_first})" if extra_first else "")
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
            (True, False), (False, True), (False, True), PROGRAMS_PER_SM, (False, True),
            (False, True),
        )
    ]


def search_space(problem: Problem, device: DeviceInfo | str | None = None) -> list[Variant]:
    """The valid variants for `problem` on `device`, in a stable order."""
    dev = device_info(device)
    return [v for v in all_points() if why_invalid(v, problem, dev) is None]


def _fa3(bm: int, bn: int, warps: int, stages: int, *, programs_per_sm: int = 0,
         pingpong: bool = False, heads: bool = False) -> Variant:
    return Variant("fa3", bm, bn, warps, stages, programs_per_sm=programs_per_sm,
                   pingpong=pingpong, head_units=heads)


def _fa2(bm: int, bn: int, warps: int, stages: int, *, ws: bool = False,
         tma: bool = True) -> Variant:
    return Variant("fa2", bm, bn, warps, stages, split_mask=True, warp_specialize=ws,
                   use_tma=tma)


V = TypeVar("V")


@dataclass(frozen=True)
class Pick(Generic[V]):
    """One row of a portfolio or defaults table: a point, one line of why it is there, and
    the problems it is for. Head dims are padded ones (what the kernels tile with); None in
    `causal` or `hopper` means either. The variant's own rules still apply on top."""

    variant: V
    why: str
    min_d: int = 0
    max_d: int = MAX_HEAD_DIM
    min_keys: int = 0
    causal: bool | None = None
    dtypes: tuple[str, ...] = ("fp16", "bf16", "fp32", "fp8")
    hopper: bool | None = None
    #: Only head dims the kernels tile exactly (64, not 40 or 48; 128, not 80 or 96).
    exact_d: bool = False
    #: Only problems without modifiers (window, softcap, sinks, packed). With `exact_d`:
    #: only problems measured plainly.
    unmodified: bool = False
    #: Only packed (True) or only unpacked (False) problems; None: either.
    packed: bool | None = None

    def serves(self, problem: Problem, dev: DeviceInfo) -> bool:
        """Whether this row is meant for `problem` on `dev` (before the validity rules)."""
        if self.exact_d and problem.head_dim != problem.padded_head_dim:
            return False
        if self.unmodified and problem.modifiers:
            return False
        return (self.min_d <= problem.padded_head_dim <= self.max_d
                and problem.seq_k >= self.min_keys and problem.dtype in self.dtypes
                and self.causal in (None, problem.causal)
                and self.packed in (None, problem.varlen)
                and self.hopper in (None, dev.is_hopper))


#: The dtypes whose untuned default may be an fa3 kernel (see DEFAULTS).
FA3_DEFAULT_DTYPES = ("fp16", "bf16")
#: Keys from which the untuned default takes fa3 over fa2 at head dim 64 (see DEFAULTS).
FA3_DEFAULT_MIN_KEYS_D64 = 4096
#: Keys from which the untuned default takes three consumers at head dim 64 without the mask.
FA3_THREE_CONSUMERS_MIN_KEYS = 2048

#: What the tuner measures right after the default on Hopper, in this order, before it
#: samples: a sampler rarely lands on these points in a space this size. fa3 leads (persistent
#: first), then the fa2 points that won exhaustive sweeps. Measurements: docs/forward-portfolio.md.
HOPPER_PORTFOLIO: tuple[Pick[Variant], ...] = (
    # Padded head dim 64 and below.
    Pick(_fa3(192, 128, 4, 3, programs_per_sm=1, pingpong=True), "three consumers taking turns: "
         "the fastest D64 point without the mask from 2k keys", max_d=64, causal=False),
    Pick(_fa3(192, 128, 4, 3, programs_per_sm=1), "three 64-row consumers (FlashAttention 3's "
         "D64 tile): they spill under the causal mask, yet ran fastest at D64 N16k causal",
         max_d=64),
    Pick(_fa3(128, 128, 4, 3, programs_per_sm=1), "two consumers, persistent: shipped at D64 "
         "N1k causal", max_d=64),
    Pick(_fa3(128, 128, 4, 2, programs_per_sm=1), "the same on a 2-stage ring (the D64 default "
         "from 4k keys)", max_d=64),
    Pick(_fa3(192, 128, 4, 4, programs_per_sm=1), "three consumers on a 4-stage ring: with "
         "the mask split off, the fastest D64 N8k causal point of the fa3 sweep", max_d=64),
    Pick(_fa3(128, 64, 4, 3, programs_per_sm=1), "64-key tiles end at each consumer's "
         "diagonal: the D64 N512 causal pair winner", max_d=64),
    Pick(_fa3(128, 128, 4, 3, programs_per_sm=1, heads=True), "whole heads per program: "
         "level with cuDNN at D64 N512 causal", max_d=64),
    Pick(_fa3(128, 128, 4, 2, programs_per_sm=1, heads=True), "whole heads on a 2-stage ring",
         max_d=64),
    Pick(_fa3(128, 128, 4, 3), "one-tile fa3, the first fa3 kernel's best point", max_d=64),
    Pick(_fa3(128, 128, 4, 4), "one-tile fa3, deeper ring", max_d=64),
    Pick(_fa3(128, 128, 4, 2), "one-tile fa3, shallower ring", max_d=64),
    Pick(_fa3(128, 64, 4, 4), "one-tile fa3 on 64-key tiles", max_d=64),
    Pick(_fa3(128, 128, 8, 3), "one 128-row consumer: measured against two 64-row ones",
         max_d=64),
    Pick(_fa2(64, 128, 4, 2), "fa2 sweep: fastest at D64 N16k", max_d=64),
    Pick(_fa2(128, 64, 8, 4), "fa2 sweep: D64 N16k causal's tile, with TMA", max_d=64),
    Pick(_fa2(128, 128, 4, 3), "fa2 sweep: 128-key tiles with TMA", max_d=64),
    Pick(_fa2(128, 64, 4, 3), "fa2 sweep: fastest at D64 N4k", max_d=64),
    Pick(_fa2(128, 64, 8, 3, ws=True, tma=False), "fa2 sweep: fastest at D64 N4k causal",
         max_d=64),
    Pick(_fa2(128, 64, 8, 4, tma=False), "fa2 sweep: fastest at D64 N16k causal", max_d=64),
    Pick(_fa2(64, 64, 4, 3, tma=False), "the last fa2 winner (D64 N512 causal)", max_d=64),
    # Head dim 256 (192 pads to it): 64-key tiles on a 2-stage ring (3 stages do not fit);
    # the persistent kernel there has one Q buffer, which also stages O.
    Pick(_fa3(128, 64, 4, 2, programs_per_sm=1, pingpong=True), "persistent D256, two "
         "consumers taking turns: 0.97-1.11x cuDNN at N512-4k but N512 causal (0.89)",
         min_d=256),
    Pick(_fa3(128, 64, 4, 2), "one-tile fa3, two 64-row consumers: 0.92-1.01x cuDNN at "
         "gemma2-9b shapes (the N512 causal winner), where fa2's best reached 0.74-0.77x",
         min_d=256),
    Pick(_fa3(128, 64, 4, 2, programs_per_sm=1), "persistent D256 without turns", min_d=256),
    Pick(_fa3(128, 64, 8, 2), "one 128-row consumer at D256 (0.83-0.90x cuDNN)", min_d=256),
    Pick(_fa3(64, 64, 4, 2), "one 64-row consumer at D256 (0.74-0.83x cuDNN)", min_d=256),
    # Padded head dim 128 and above (80 and 96 pad to 128; fa3 rules drop them there).
    Pick(_fa3(128, 128, 4, 2, programs_per_sm=1, pingpong=True), "two consumers taking turns: "
         "the fastest D128 point from N1k (the D128 default)", min_d=128),
    Pick(_fa3(128, 128, 4, 2, programs_per_sm=1), "K and V released apart: at or above cuDNN "
         "without the mask from N512", min_d=128),
    Pick(_fa3(128, 128, 4, 2), "one-tile fa3, shallower ring: the fastest D128 point without "
         "the mask at N8k-16k, where one Q tile's keys outlast any prologue", min_d=128),
    Pick(_fa3(128, 64, 4, 3, programs_per_sm=1), "64-key tiles: the D128 N512 causal winner",
         min_d=128),
    Pick(_fa3(128, 64, 4, 3, programs_per_sm=1, pingpong=True), "the same, taking turns",
         min_d=128),
    Pick(_fa3(128, 128, 4, 3), "one-tile fa3: its best D128 point", min_d=128),
    Pick(_fa3(128, 64, 4, 4, programs_per_sm=1), "64-key tiles, deeper ring: short D128 keys",
         min_d=128),
    Pick(_fa3(128, 64, 4, 3), "one-tile fa3 on 64-key tiles: short causal keys", min_d=128),
    Pick(_fa3(128, 64, 4, 4), "one-tile fa3, 64-key tiles, deeper ring", min_d=128),
    Pick(_fa3(128, 128, 8, 2), "one 128-row consumer: measured against two 64-row ones",
         min_d=128),
    Pick(_fa2(128, 128, 8, 3, ws=True), "fa2 sweep: fastest at D128 N16k and N2k causal",
         min_d=128),
    Pick(_fa2(128, 128, 8, 3), "fa2 sweep: fastest at D128 N16k causal and N2k", min_d=128),
    Pick(_fa2(256, 64, 8, 4, ws=True), "fa2 sweep: a 256-row tile", min_d=128),
    Pick(_fa2(128, 64, 4, 2), "fa2 sweep: TMA's largest gain (405 -> 510 TFLOP/s)",
         min_d=128),
    Pick(_fa2(64, 64, 4, 3), "fa2 sweep: a small tile", min_d=128),
    Pick(_fa2(256, 64, 8, 3), "fa2 sweep: a 256-row tile, 3 stages", min_d=128),
)

#: The untuned default: the first row that serves the problem and is valid for it, from the
#: fastest general choice on recent GPUs down to the smallest tile, which every problem
#: admits. Measurements: docs/forward-portfolio.md.
DEFAULTS: tuple[Pick[Variant], ...] = (
    # fa3 is the untuned default for the plain 16-bit problems it was measured on, for
    # packed sequences at D128, and for the head dims padded to 256; fp8, the head dims
    # padded to 64 or 128 (40, 80, 96, ...) and other modified problems run fa3 when tuned,
    # not untuned.
    Pick(Variant("fa3", 192, 128, 4, 3, programs_per_sm=1, pingpong=True), "D64 without the "
         "mask: three consumers taking turns", max_d=64, min_keys=FA3_THREE_CONSUMERS_MIN_KEYS,
         causal=False, dtypes=FA3_DEFAULT_DTYPES, exact_d=True, unmodified=True),
    Pick(Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True), "D128: two consumers "
         "taking turns, persistent", min_d=128, dtypes=FA3_DEFAULT_DTYPES, exact_d=True,
         unmodified=True),
    # Packed sequences at D128 (with softcap or sinks too; a window's rules refuse it): the
    # H200's tuned winner, causal and not, and ahead of the H100's on its own A/B.
    Pick(Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True), "D128 packed "
         "sequences: the persistent kernel's tile schedule, taking turns", min_d=128,
         max_d=128, dtypes=FA3_DEFAULT_DTYPES, exact_d=True, packed=True),
    Pick(Variant("fa3", 128, 128, 4, 2, programs_per_sm=1), "D64: fa3 pays from 4k keys; shorter "
         "programs leave its TMA prologue exposed", max_d=64, min_keys=FA3_DEFAULT_MIN_KEYS_D64,
         dtypes=FA3_DEFAULT_DTYPES, exact_d=True, unmodified=True),
    Pick(Variant("fa3", 128, 64, 4, 2, programs_per_sm=1, pingpong=True), "D256: persistent, "
         "two consumers taking turns on 64-key tiles; the head dims padded to 256 too (the "
         "D192 keys' winner, bf16 and fp16, H100), where fa2's untuned tile is the slowest "
         "kernel", min_d=256, dtypes=FA3_DEFAULT_DTYPES, unmodified=True),
    Pick(Variant("fa2", 128, 64, 8, 3), "fa2's tuned D128 tile", min_d=128, hopper=True),
    Pick(Variant("fa2", 128, 64, 8, 2), "fa2's D128 tile, 2 stages off Hopper", min_d=128,
         hopper=False),
    Pick(Variant("fa2", 128, 64, 4, 3), "fa2's tuned D64 tile", max_d=64, hopper=True),
    Pick(Variant("fa2", 128, 64, 4, 2), "fa2's D64 tile, 2 stages off Hopper", max_d=64,
         hopper=False),
    Pick(Variant("fa2", 128, 32, 8, 2), "narrower key tile: less shared memory"),
    Pick(Variant("fa2", 64, 64, 4, 2), "smaller tiles, for short or wide problems"),
    Pick(Variant("fa2", 64, 32, 4, 2), "smaller still"),
    Pick(Variant("fa2", 32, 32, 4, 2), "smaller still"),
    Pick(Variant("fa2", 32, 16, 2, 1), "short sequences"),
    Pick(Variant("fa2", 16, 32, 2, 1), "short query blocks"),
    Pick(Variant("fa2", 16, 16, 2, 1), "the smallest tile: every problem admits it"),
)


def portfolio(problem: Problem, device: DeviceInfo | str | None = None) -> list[Variant]:
    """The valid points of the Hopper portfolio for `problem` (none on other devices).

    Head dims between 64 and 128 (80, 96) pad to 128 and take the D128 rows; points that a
    rule excludes (shared memory at D=256, TMA on rows that are not 16-byte multiples) drop.
    """
    dev = device_info(device)
    if not dev.is_hopper:
        return []
    return [pick.variant for pick in HOPPER_PORTFOLIO
            if pick.serves(problem, dev) and why_invalid(pick.variant, problem, dev) is None]


class NoDefaultFits(AssertionError):
    """No row of the defaults is valid for a problem on a device. On the GPUs flashgen
    serves that is a bug (hence an AssertionError); an export meets it for devices it only
    describes (the generic 64 KiB one) and records the kind as having no default."""


def default_variant(problem: Problem, device: DeviceInfo | str | None = None,
                    fa3: bool = True) -> Variant:
    """A hand-picked variant that is valid for any problem: the answer when nothing was tuned
    (the first row of DEFAULTS that serves `problem` and is valid for it). `fa3` False skips
    the Gluon rows: the portable Triton default."""
    dev = device_info(device)
    for pick in DEFAULTS:
        v = pick.variant
        if (pick.serves(problem, dev) and (fa3 or v.loop_order != "fa3")
                and why_invalid(v, problem, dev) is None):
            return v
    raise NoDefaultFits(f"no default variant fits {problem}")  # the 16x16 tile always fits
