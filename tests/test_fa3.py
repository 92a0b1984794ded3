"""The fa3 (Gluon, Hopper) forward: its rules, its twin, a compile for sm90a on the CPU, and
on the GPU its answers against the reference.

The Triton interpreter cannot run Gluon, so on the CPU the kernel is compiled for an H100's
target (no GPU needed) and its PTX is checked for the Hopper machinery the design relies on;
the numbers are checked on the GPU machine (`gpu` tests).
"""

from __future__ import annotations

from dataclasses import replace
from types import FunctionType, SimpleNamespace

import pytest
import torch

import flashgen
from flashgen.kernels.fwd_space import (
    FA3_TILES,
    default_variant,
    portfolio,
    shared_memory_bytes,
)
from flashgen.kernels.hardware import INTERPRETER, DeviceInfo, device_info
from flashgen.kernels.render import (
    _load_module,
    _templates,
    normalised,
    render,
    render_context,
    render_with,
    source_hash,
)
from flashgen.kernels.render import template_name as render_template_name
from flashgen.runtime.forward import fa3_grid
from flashgen.runtime.table import head_units_leave_programs_idle
from flashgen.tune.check import compare, make_inputs
from flashgen.tune.gluon_compile import report_in_subprocess, spill_store_bytes

HOPPER = DeviceInfo("H-test", (9, 0), 132, 232448)
AMPERE = DeviceInfo("A-test", (8, 0), 108, 232448)  # as much shared memory as Hopper


def _problem(d: int = 128, dtype: str = "fp16", causal: bool = False) -> flashgen.Problem:
    return flashgen.Problem(2, 8, 8, 4096, 4096, d, dtype, causal)


def test_fa3_is_a_hopper_16bit_variant_with_its_own_tiles() -> None:
    v = flashgen.Variant("fa3", 128, 128, 4, 3)
    assert flashgen.why_invalid(v, _problem(), HOPPER) is None
    assert flashgen.why_invalid(v, _problem(64, "bf16", True), HOPPER) is None
    assert "Hopper" in flashgen.why_invalid(v, _problem(), AMPERE)
    assert "Hopper" in flashgen.why_invalid(v, _problem(), INTERPRETER)
    small = flashgen.Variant("fa3", 128, 64, 4, 2)  # fits shared memory even in fp32
    assert "fp32" in flashgen.why_invalid(small, _problem(dtype="fp32"), HOPPER)
    assert "head dims" in flashgen.why_invalid(small, _problem(d=32), HOPPER)
    assert flashgen.why_invalid(small, _problem(d=96), HOPPER) is None  # padded to 128
    bad_tile = flashgen.Variant("fa3", 256, 128, 8, 2)
    assert "block_m, num_warps" in flashgen.why_invalid(bad_tile, _problem(), HOPPER)
    assert "fa2 knobs" in flashgen.why_invalid(
        flashgen.Variant("fa3", 128, 128, 4, 3, use_tma=True), _problem(), HOPPER)
    # Three D128 stages of 128-key tiles fill shared memory; four do not fit.
    assert "shared memory" in flashgen.why_invalid(
        flashgen.Variant("fa3", 128, 128, 4, 4), _problem(), HOPPER)
    space = flashgen.search_space(_problem(), HOPPER)
    fa3 = {(v.block_m, v.num_warps) for v in space if v.loop_order == "fa3"}
    assert fa3 == set(FA3_TILES)


def test_fa3_persistent_is_one_program_per_sm_with_its_own_o_buffer() -> None:
    persistent = flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1)
    assert flashgen.why_invalid(persistent, _problem(), HOPPER) is None
    assert "fa3 programs_per_sm is 0" in flashgen.why_invalid(
        flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=2), _problem(), HOPPER)
    # A second Q buffer and O's own cost two Q tiles of shared memory: three D128 stages of
    # 128-key tiles fit the one-tile kernel, not the persistent one.
    assert flashgen.why_invalid(flashgen.Variant("fa3", 128, 128, 4, 3), _problem(), HOPPER) is None
    assert "shared memory" in flashgen.why_invalid(
        flashgen.Variant("fa3", 128, 128, 4, 3, programs_per_sm=1), _problem(), HOPPER)
    assert render_template_name(persistent) == "attn_fwd_fa3_persistent.py.jinja"
    assert render_template_name(replace(persistent, programs_per_sm=0)) == "attn_fwd_fa3.py.jinja"
    # One program per SM, at most one per tile; the kernel is told B * H_Q to walk the tiles.
    sm = device_info("cpu").sm_count
    assert fa3_grid(persistent, 1000, 48, torch.device("cpu")) == ((min(8 * 48, sm),), (48,))
    assert fa3_grid(replace(persistent, programs_per_sm=0), 1000, 48, torch.device("cpu")) == (
        (8, 48), ())


def test_persistent_causal_kernels_alone_take_the_row_bound_mask() -> None:
    # The causal kernel masks against each row's last visible key (`_mask_bound`); the one
    # without the mask keeps `_mask_scores` for the ragged tail, so it renders as it did
    # before the row-bound mask and its tuned rows stay current (same kernel hash).
    # Partitions follow the consumer count: one `_consume` each, then the producer.
    for m, consumers in ((128, 2), (192, 3)):
        v = flashgen.Variant("fa3", m, 128, 4, 2, programs_per_sm=1)
        assert (v.fa3_rows, v.fa3_consumers) == (64, consumers)
        # The code alone: the template's header comment names both masks.
        causal = normalised(render(v, _problem(64, causal=True)))
        full = normalised(render(v, _problem(64)))
        assert "= _mask_bound(s" in causal and "= _mask_scores(s" not in causal
        assert "_mask_bound" not in full and "= _mask_scores(s" in full
        for source in (causal, full):
            assert source.count("(_consume, (") == consumers
            assert source.count("(_produce, (") == 1


def _tile_order(variant: flashgen.Variant, problem: flashgen.Problem,
                programs: int) -> list[list[tuple[int, int]]]:
    """The (head, Q tile) sequence each program of the persistent kernel walks, got by
    running the rendered kernel's own `_units`, `_unit_len` and `_tile` as plain Python
    (Gluon cannot run on the CPU; these helpers are scalar integer code)."""
    source = render(variant, problem)
    module = _load_module(source_hash(source), source)
    shim = SimpleNamespace(cdiv=lambda a, b: -(-a // b), minimum=min)
    units, unit_len, tile = (FunctionType(getattr(module, name).fn.__code__,
                                          {**getattr(module, name).fn.__globals__, "gl": shim})
                             for name in ("_units", "_unit_len", "_tile"))
    num_m = -(-problem.seq_q // variant.block_m)
    bh = problem.batch * problem.heads_q
    order = []
    for pid in range(programs):
        tiles = []
        for u in range(pid, units(num_m, bh), programs):
            for h in range(unit_len(u, num_m)):
                b, head, row = tile(u, h, num_m, problem.heads_q, variant.block_m)
                tiles.append((b * problem.heads_q + head, row // variant.block_m))
        order.append(tiles)
    return order


@pytest.mark.parametrize("heads", [False, True], ids=["pairs", "heads"])
@pytest.mark.parametrize(
    "shape, programs",
    [((32, 32, 32, 512, 512, 64), 132), ((2, 66, 66, 1000, 1000, 64), 132),
     ((3, 7, 7, 384, 384, 64), 20), ((1, 3, 3, 256, 256, 64), 4),
     ((4, 16, 4, 700, 530, 64), 132), ((1, 8, 8, 512, 512, 64), 32)],
    ids=str,
)
def test_persistent_causal_tile_order_covers_every_tile_once(
    shape: tuple[int, ...], programs: int, heads: bool
) -> None:
    # Under the mask a program walks tile pairs (the longest of a head with its shortest)
    # or, with head_units, whole heads: their pairs in turn, so each tile after the first
    # reads K/V that program has just read. Either way every tile runs once.
    variant = flashgen.Variant("fa3", 128, 128, 4, 3, programs_per_sm=1, head_units=heads)
    problem = flashgen.Problem(*shape, "fp16", True)
    order = _tile_order(variant, problem, programs)
    num_m = -(-problem.seq_q // 128)
    walked = [t for tiles in order for t in tiles]
    assert sorted(walked) == [(bh, m) for bh in range(shape[0] * shape[1])
                              for m in range(num_m)]
    first = [tiles[:num_m] for tiles in order if tiles]
    bh = shape[0] * shape[1]
    assert sum(map(bool, order)) == min(programs, bh if heads else bh * -(-num_m // 2))
    if heads:  # one head per unit, long and short tiles in turn
        assert all(len({bh for bh, _ in unit}) == 1 for unit in first)
        assert [m for _, m in first[0]] == [num_m - 1, 0, num_m - 2, 1, num_m - 3, 2,
                                            num_m - 4, 3][:num_m]
    else:  # a pair: the longest tile of a head, then its shortest
        assert [m for _, m in order[0][:2]] == [num_m - 1, 0][:num_m]


def test_head_units_is_a_causal_knob_of_persistent_fa3() -> None:
    heads = flashgen.Variant("fa3", 128, 128, 4, 3, programs_per_sm=1, head_units=True)
    bench = flashgen.Problem(32, 32, 32, 512, 512, 64, "fp16", True)  # fa-bench's cell
    assert str(heads) == "fa3 m128 n128 w4 s3 p1 heads"
    assert flashgen.why_invalid(heads, bench, HOPPER) is None
    assert "causal" in flashgen.why_invalid(heads, replace(bench, causal=False), HOPPER)
    assert "persistent grid" in flashgen.why_invalid(replace(heads, programs_per_sm=0), bench,
                                                     HOPPER)
    assert not heads.pointer_twin().head_units
    # Dispatch serves it only with heads enough to keep every program as busy as pairs
    # would: a small batch (8 heads of 4 tiles: 8 busy programs, 16 with pairs) takes
    # another winner. It stays valid there (explicit variants and checks run it).
    small = replace(bench, batch=1, heads_q=8, heads_kv=8)
    assert flashgen.why_invalid(heads, small, HOPPER) is None
    assert "fewer of the 32 programs busy" in head_units_leave_programs_idle(
        heads, small, HOPPER.sm_count)
    assert head_units_leave_programs_idle(heads, bench, HOPPER.sm_count) is None
    # In the D64 portfolio, for the causal mask only; the kernels without the knob render
    # as before it existed (their tuned rows stay current: same kernel hash).
    assert heads in portfolio(bench, HOPPER)
    assert not any(v.head_units for v in portfolio(replace(bench, causal=False), HOPPER))
    assert not any(v.head_units for v in portfolio(replace(bench, head_dim=128), HOPPER))
    pairs = render(replace(heads, head_units=False), bench)
    assert "return BH * gl.cdiv(num_m, 2)" in pairs and "    return BH\n" not in pairs
    assert "    return BH\n" in render(heads, bench)


def test_portfolio_and_default_lead_with_fa3_on_hopper() -> None:
    # The tuner measures fa3 first on Hopper (every candidate passes the reference check
    # before it can win). Untuned, fa3 serves D128 and long D64; short D64, fp32, other head
    # dims and other GPUs keep fa2 (docs/forward-portfolio.md).
    for d in (64, 128):
        assert portfolio(_problem(d), HOPPER)[0].loop_order == "fa3"
        assert default_variant(_problem(d), HOPPER).loop_order == "fa3"
    short = flashgen.Problem(8, 32, 32, 2048, 2048, 64, "fp16", True)
    assert default_variant(short, HOPPER).loop_order == "fa2"
    # Without the mask, D64 takes three consumers from 2k keys. Under it the portfolio keeps
    # the plain (not ping-pong) 3- and 4-stage points: they spill there, yet led D64 N16k and
    # N8k causal in sweeps (docs/forward-portfolio.md, items 9 and 11).
    three = default_variant(replace(short, causal=False), HOPPER)
    assert (three.loop_order, three.block_m, three.programs_per_sm, three.pingpong) == (
        "fa3", 192, 1, True)
    assert default_variant(replace(short, seq_q=1024, seq_k=1024, causal=False),
                           HOPPER).loop_order == "fa2"
    assert any(v.block_m == 192 for v in portfolio(replace(short, causal=False), HOPPER))
    assert [v.num_stages for v in portfolio(short, HOPPER) if v.block_m == 192] == [3, 4]
    assert not any(v.pingpong for v in portfolio(short, HOPPER) if v.block_m == 192)
    d128 = default_variant(flashgen.Problem(8, 16, 16, 512, 512, 128, "bf16", True), HOPPER)
    assert (d128.loop_order, d128.block_m, d128.pingpong) == ("fa3", 128, True)
    # Two consumers at D64 run slower taking turns: the D64 default does not.
    assert not default_variant(replace(short, seq_q=4096, seq_k=4096), HOPPER).pingpong
    assert default_variant(_problem(128, "fp32"), HOPPER).loop_order == "fa2"
    assert default_variant(_problem(96), HOPPER).loop_order == "fa2"
    assert default_variant(_problem(128), "cpu").loop_order == "fa2"


def test_pingpong_is_a_knob_of_persistent_fa3_with_consumers_to_take_turns() -> None:
    def reason(v: flashgen.Variant) -> str | None:
        return flashgen.why_invalid(v, _problem(), HOPPER)

    pp = flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True)
    assert reason(pp) is None and str(pp).endswith(" pp")
    three = replace(pp, block_m=192, num_stages=3)
    assert flashgen.why_invalid(three, _problem(64), HOPPER) is None
    assert "persistent grid" in reason(replace(pp, programs_per_sm=0))
    assert "two or three" in reason(replace(pp, block_m=64))  # one 64-row consumer
    assert "two or three" in reason(replace(pp, num_warps=8))  # one 128-row consumer
    assert "pingpong" in reason(flashgen.Variant("fa2", 128, 64, 4, 3, pingpong=True))
    assert "pingpong" in reason(flashgen.Variant("fa1", 64, 64, 4, 2, pingpong=True))
    # Only the persistent template reads the knob, and only with it do turns get taken.
    assert "PINGPONG: gl.constexpr = True" in render(pp, _problem())
    assert "PINGPONG: gl.constexpr = False" in render(replace(pp, pingpong=False), _problem())
    assert pp.pointer_twin() == flashgen.Variant("fa2", 128, 128, 4, 2)


def test_pointer_twin_keeps_the_tiles_and_drops_tma() -> None:
    v = flashgen.Variant("fa3", 128, 64, 4, 3)
    twin = v.pointer_twin()
    assert v.needs_tma and not twin.needs_tma
    assert (twin.loop_order, twin.block_m, twin.block_n, twin.num_warps, twin.num_stages) == (
        "fa2", 128, 64, 4, 3)
    tma = flashgen.Variant("fa2", 128, 64, 8, 3, use_tma=True)
    assert tma.pointer_twin() == flashgen.Variant("fa2", 128, 64, 8, 3)
    # fa3's persistent grid is its own schedule; the twin runs fa2's one program per tile.
    persistent = flashgen.Variant("fa3", 128, 64, 4, 3, programs_per_sm=1)
    assert persistent.pointer_twin() == v.pointer_twin()
    # fa2 has no 192-row tile (its ranges are powers of two): the twin takes 128 rows.
    assert flashgen.Variant("fa3", 192, 128, 4, 3, programs_per_sm=1).pointer_twin() == (
        flashgen.Variant("fa2", 128, 128, 4, 3))
    fa2_persistent = flashgen.Variant("fa2", 128, 64, 8, 3, use_tma=True, programs_per_sm=1)
    assert fa2_persistent.pointer_twin().programs_per_sm == 1


@pytest.mark.parametrize(
    ("block_m", "block_n", "warps", "stages", "d", "causal", "programs_per_sm", "pingpong"),
    [(128, 128, 4, 3, 128, False, 0, False), (128, 64, 4, 4, 128, True, 0, False),
     (128, 128, 8, 2, 64, True, 0, False), (64, 128, 4, 2, 64, False, 0, False),
     (128, 64, 4, 3, 128, True, 1, False), (128, 128, 4, 2, 64, True, 1, False),
     # 128-key tiles at D128 spilled 192-248 bytes while P was carried in fp32
     (128, 128, 4, 2, 128, False, 1, False),
     (128, 128, 4, 2, 128, False, 1, True), (128, 64, 4, 3, 64, True, 1, True)],
)
def test_fa3_compiles_for_hopper_with_its_machinery(
    block_m: int, block_n: int, warps: int, stages: int, d: int, causal: bool,
    programs_per_sm: int, pingpong: bool,
) -> None:
    pytest.importorskip("triton.experimental.gluon")
    variant = flashgen.Variant("fa3", block_m, block_n, warps, stages,
                               programs_per_sm=programs_per_sm, pingpong=pingpong)
    problem = _problem(d, "bf16", causal)
    assert flashgen.why_invalid(variant, problem, HOPPER) is None
    found = report_in_subprocess(variant, problem)
    assert found["wgmma"] and found["tma"]  # warpgroup MMA; TMA loads and the O store
    assert found["setmaxnreg"]  # the producer warp hands its registers to the consumers
    assert found["wait_one"]  # the softmax runs while the P V product is in flight
    if not programs_per_sm:
        # ... in the machine code too: ptxas had moved the P V wait ahead of the softmax
        # until _hold_softmax pinned it (the persistent kernel runs faster without the pin).
        assert found["exp_under_pv"] and all(found["exp_under_pv"]), found["exp_under_pv"]
    # P reaches the P V product packed as the softmax wrote it, never repacked in the loop.
    assert found["byte_permutes"] == 0, found["byte_permutes"]
    assert found["shared"] <= HOPPER.shared_memory
    assert any("0 bytes spill stores" in line for line in found["ptxas"]), found["ptxas"]


# ---- GPU: answers against the float64 reference ----------------------------------------------

FA3_POINTS = [flashgen.Variant("fa3", 128, 128, 4, 3), flashgen.Variant("fa3", 128, 64, 4, 2),
              flashgen.Variant("fa3", 128, 128, 8, 2), flashgen.Variant("fa3", 64, 64, 4, 4),
              # persistent grid: two consumers, one consumer, 8-warp consumers, three
              flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1),
              flashgen.Variant("fa3", 64, 64, 4, 3, programs_per_sm=1),
              flashgen.Variant("fa3", 128, 64, 8, 2, programs_per_sm=1),
              flashgen.Variant("fa3", 192, 128, 4, 2, programs_per_sm=1),
              flashgen.Variant("fa3", 192, 64, 4, 2, programs_per_sm=1),
              # consumers taking turns: two, two on 64-key tiles (empty turns for the tiles
              # the first consumer skips under the mask), three
              flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True),
              flashgen.Variant("fa3", 128, 64, 4, 3, programs_per_sm=1, pingpong=True),
              flashgen.Variant("fa3", 192, 128, 4, 3, programs_per_sm=1, pingpong=True),
              # whole heads per unit under the causal mask (pairs without it)
              flashgen.Variant("fa3", 128, 128, 4, 3, programs_per_sm=1, head_units=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", FA3_POINTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",  # (B, Hq, Hkv, Nq, Nk, D): ragged tails, Nq != Nk both ways, GQA, one tile
    [(1, 4, 4, 300, 300, 128), (2, 6, 2, 257, 520, 128), (1, 2, 1, 700, 333, 64),
     (2, 3, 3, 1024, 1024, 64), (1, 2, 2, 33, 33, 64)],
    ids=str,
)
def test_fa3_matches_the_reference_on_gpu(
    variant: flashgen.Variant, dtype: torch.dtype, causal: bool, shape: tuple[int, ...]
) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    q, k, v = make_inputs(*shape, dtype, "cuda", seed=sum(shape))
    problem = flashgen.Problem.from_tensors(q, k, v, causal=causal)
    reason = flashgen.why_invalid(variant, problem)
    if reason:  # e.g. a 128-row tile for 33 queries: dispatch refuses it by design
        pytest.skip(reason)
    out, lse = flashgen.attention(q, k, v, causal=causal, variant=variant, return_lse=True)
    check = compare(out, q, k, v, causal, None, lse)
    assert check.ok, check.reason


def test_fa3_runs_d256_on_64_key_tiles_both_grids() -> None:
    problem = _problem(256, "bf16", True)
    points = [v for v in flashgen.search_space(problem, HOPPER) if v.loop_order == "fa3"]
    assert points and all(v.block_n == 64 for v in points)
    # The persistent kernel has one Q buffer there and no O buffer: Q 64 KB, K/V 128 KB.
    persistent = flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1, pingpong=True)
    assert persistent in points
    assert shared_memory_bytes(persistent, problem) == 2 * 256 * (128 + 2 * 64 * 2)
    assert "shared memory" in flashgen.why_invalid(
        flashgen.Variant("fa3", 128, 64, 4, 3, programs_per_sm=1), problem, HOPPER)
    assert "shared memory" in flashgen.why_invalid(
        flashgen.Variant("fa3", 128, 128, 4, 2), problem, HOPPER)
    # Three consumers have 160 registers a thread: a 64 x 256 fp32 O is 128 of them.
    assert "three consumers" in flashgen.why_invalid(
        flashgen.Variant("fa3", 192, 64, 4, 2, programs_per_sm=1), problem, HOPPER)
    assert "up to 128" in flashgen.why_invalid(
        flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1), _problem(256, "fp8", True),
        HOPPER)


@pytest.mark.parametrize("variant", [flashgen.Variant("fa3", 64, 64, 4, 2),
                                     flashgen.Variant("fa3", 128, 64, 4, 2)], ids=str)
def test_fa3_d256_compiles_for_hopper_without_spills(variant: flashgen.Variant) -> None:
    problem = _problem(256, "bf16", True)
    found = report_in_subprocess(variant, problem)
    assert found["wgmma"] and found["tma"] and all(found["exp_under_pv"])
    assert found["shared"] <= HOPPER.shared_memory
    assert any("0 bytes spill stores" in line for line in found["ptxas"]), found["ptxas"]


def test_fa3_d256_persistent_compiles_for_hopper() -> None:
    """The one-buffer D256 persistent kernel: its shared memory is Q (which stages O too) and
    the K/V ring alone, and the causal mask's row bounds spill a few bytes at most (the GPU
    tests run it without the mask too). With `o_through_q` off, O leaves from registers and
    the launcher passes its pointer."""
    variant = flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1, pingpong=True)
    problem = _problem(256, "bf16", True)
    found = report_in_subprocess(variant, problem)
    assert found["wgmma"] and found["tma"] and found["setmaxnreg"]
    assert shared_memory_bytes(variant, problem) <= found["shared"] <= HOPPER.shared_memory
    assert found["shared"] < shared_memory_bytes(variant, problem) + 1024
    assert any("spill stores" in line for line in found["ptxas"]), found["ptxas"]
    assert spill_store_bytes(found["ptxas"]) <= 64, found["ptxas"]
    assert "O_POINTER" not in render(variant, problem)
    assert "O_POINTER = True" in render_with(_templates(), variant, problem,
                                             {"o_through_q": False})


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [flashgen.Variant("fa3", 64, 64, 4, 2),
                                     flashgen.Variant("fa3", 64, 64, 4, 3),
                                     flashgen.Variant("fa3", 128, 64, 4, 2),
                                     flashgen.Variant("fa3", 128, 64, 8, 2),
                                     flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1),
                                     flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1,
                                                      pingpong=True),
                                     flashgen.Variant("fa3", 64, 64, 4, 2, programs_per_sm=1)],
                         ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa3_d256_matches_the_reference_on_gpu(variant: flashgen.Variant,
                                               causal: bool) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    q, k, v = make_inputs(2, 4, 2, 700, 530, 256, torch.bfloat16, "cuda", seed=7 + causal)
    out, lse = flashgen.attention(q, k, v, causal=causal, variant=variant, return_lse=True)
    check = compare(out, q, k, v, causal, None, lse)
    assert check.ok, check.reason


def test_fa3_pads_head_dims_with_16_byte_rows_but_serves_them_only_tuned() -> None:
    # 80, 96, 112 tile as 128, 40 and 48 as 64 (and 192 as 256, on 64-key tiles): TMA
    # zero-fills the columns past D.
    assert any(v.loop_order == "fa3" for v in flashgen.search_space(_problem(192, "bf16"),
                                                                     HOPPER))
    for d, padded in ((40, 64), (48, 64), (80, 128), (96, 128), (112, 128)):
        problem = _problem(d, "bf16", True)
        assert problem.padded_head_dim == padded
        points = [v for v in flashgen.search_space(problem, HOPPER) if v.loop_order == "fa3"]
        assert any(v.programs_per_sm for v in points), d
        assert portfolio(problem, HOPPER)[0].loop_order == "fa3"
        # Untuned, the padded dims keep fa2 until their fa3 kernels have been measured.
        assert default_variant(problem, HOPPER).loop_order == "fa2"
    # A row TMA cannot address: 36 x 2 bytes is no multiple of 16.
    assert "16-byte rows" in flashgen.why_invalid(
        flashgen.Variant("fa3", 128, 128, 4, 2), _problem(36, "fp16", False), HOPPER)
    assert "shared memory" in flashgen.why_invalid(
        flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1),
        _problem(192, "bf16", False), HOPPER)


@pytest.mark.parametrize("variant", [flashgen.Variant("fa3", 128, 128, 4, 2),
                                     flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1,
                                                      pingpong=True)], ids=str)
def test_fa3_padded_head_dim_compiles_for_hopper(variant: flashgen.Variant) -> None:
    """D96 renders the D128 kernel without its head-dim assert: the same machine code (the
    padding is the descriptors' business), unspilled."""
    found = report_in_subprocess(variant, _problem(96, "bf16", False))
    assert found == report_in_subprocess(variant, _problem(128, "bf16", False))
    assert found["wgmma"] and found["tma"]
    assert any("0 bytes spill stores" in line for line in found["ptxas"]), found["ptxas"]


def test_split_d_only_where_the_tile_is_a_quarter_zeros() -> None:
    """The fa3 kernels at 16-bit head dims 129-192 issue their products over the 256 tile's
    first 192 columns; other head dims, packed calls and fp8 render as before, and so does
    the persistent kernel whose O leaves from registers (`o_through_q` off)."""
    one_tile = flashgen.Variant("fa3", 128, 64, 4, 2)
    persistent = flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1)
    for d, dtype, expected in ((160, "bf16", True), (192, "fp16", True), (128, "bf16", False),
                               (256, "bf16", False), (192, "fp8", False)):
        assert render_context(one_tile, _problem(d, dtype, True))["split_d"] is expected, d
    assert render_context(persistent, _problem(192, "bf16", True))["split_d"]
    assert "D_B" in render(persistent, _problem(192, "bf16", True))
    assert "D_B" not in render_with(_templates(), persistent, _problem(192, "bf16", True),
                                    {"o_through_q": False})
    packed = replace(_problem(192, "bf16", True), varlen=True)
    assert not render_context(one_tile, packed)["split_d"]
    assert "D_B" in render(one_tile, _problem(192, "bf16", False))
    assert "D_B" not in render(one_tile, _problem(256, "bf16", False))


@pytest.mark.parametrize("variant", [flashgen.Variant("fa3", 128, 64, 4, 2),
                                     flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1,
                                                      pingpong=True)], ids=str)
def test_fa3_split_head_dim_compiles_for_hopper(variant: flashgen.Variant) -> None:
    """D192 on the 256 tile: Q K^T as a 128- and a 64-column product, P V into a 128- and a
    64-wide accumulator (no n256 product), the same loads and O store, no more spills than
    the D256 kernel (the one-tile one: none, its softmax still under P V)."""
    split = report_in_subprocess(variant, _problem(192, "bf16", True))
    whole = report_in_subprocess(variant, _problem(256, "bf16", True))
    assert "m64n256k16" in whole["wgmma_shapes"], whole["wgmma_shapes"]
    assert set(split["wgmma_shapes"]) == {"m64n64k16", "m64n128k16"}, split["wgmma_shapes"]
    assert spill_store_bytes(split["ptxas"]) <= spill_store_bytes(whole["ptxas"])
    assert split["byte_permutes"] == 0
    assert split["tma"] == whole["tma"]  # the same loads, and O's store
    if not variant.programs_per_sm:
        assert split["exp_under_pv"] and all(split["exp_under_pv"]), split["exp_under_pv"]
        assert spill_store_bytes(split["ptxas"]) == 0, split["ptxas"]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [flashgen.Variant("fa3", 128, 128, 4, 2),
                                     flashgen.Variant("fa3", 128, 64, 4, 3),
                                     flashgen.Variant("fa3", 128, 64, 4, 2),
                                     flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1),
                                     flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1,
                                                      pingpong=True),
                                     flashgen.Variant("fa3", 128, 64, 4, 3, programs_per_sm=1),
                                     flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1,
                                                      pingpong=True)],
                         ids=str)
@pytest.mark.parametrize("d", [40, 80, 96, 112, 160, 192])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa3_padded_head_dims_match_the_reference_on_gpu(variant: flashgen.Variant, d: int,
                                                         causal: bool) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    q, k, v = make_inputs(2, 4, 2, 700, 530, d, torch.bfloat16, "cuda", seed=d + causal)
    reason = flashgen.why_invalid(variant, flashgen.Problem.from_tensors(q, k, v, causal=causal))
    if reason:  # D192 pads to 256: 64-key tiles, 2 stages
        pytest.skip(reason)
    out, lse = flashgen.attention(q, k, v, causal=causal, variant=variant, return_lse=True)
    check = compare(out, q, k, v, causal, None, lse)
    assert check.ok, check.reason


@pytest.mark.gpu
def test_fa3_strided_and_unaligned_inputs_on_gpu() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    variant = flashgen.Variant("fa3", 128, 128, 4, 3)
    # (B, N, H, D) memory viewed as (B, H, N, D): TMA addresses it through strides.
    q, k, v = make_inputs(2, 4, 2, 600, 600, 128, torch.bfloat16, "cuda", 3, layout="bnhd")
    out = flashgen.attention(q, k, v, causal=True, variant=variant)
    assert compare(out, q, k, v, True).ok
    # An explicit TMA variant on inputs TMA cannot address is an error, never a fallback.
    base = torch.randn(2 * 4 * 300 * 128 + 1, device="cuda", dtype=torch.float16)
    odd = base[1:].view(2, 4, 300, 128)
    with pytest.raises(ValueError, match="TMA"):
        flashgen.attention(odd, odd, odd, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [p for p in FA3_POINTS if p.programs_per_sm], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_fa3_persistent_chains_many_tiles_per_program_on_gpu(
    variant: flashgen.Variant, causal: bool, d: int
) -> None:
    # The shapes above give each program one tile at most: here there are more tiles than
    # SMs (384 or more), so every program walks several (under the causal mask, units of
    # two), with Q double-buffered and the K/V ring and O buffer carried from tile to tile;
    # lengths are ragged and unequal (rows that see no key among them), the heads grouped.
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    q, k, v = make_inputs(4, 16, 4, 700, 530, d, torch.float16, "cuda", seed=d + causal)
    problem = flashgen.Problem.from_tensors(q, k, v, causal=causal)
    reason = flashgen.why_invalid(variant, problem)
    if reason:
        pytest.skip(reason)
    assert fa3_grid(variant, 700, 64, q.device)[0][0] < 64 * -(-700 // variant.block_m)
    out, lse = flashgen.attention(q, k, v, causal=causal, variant=variant, return_lse=True)
    check = compare(out, q, k, v, causal, None, lse)
    assert check.ok, check.reason


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 33, 11, 512, 512), (2, 66, 66, 1000, 1000)], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fa3_persistent_whole_heads_on_gpu(
    shape: tuple[int, ...], d: int, dtype: torch.dtype
) -> None:
    # 132 heads, one per program on an H100 or H200: the launches dispatch serves a
    # whole-heads winner on (the tests above run it on a few heads); GQA, a ragged tile.
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a Hopper GPU")
    variant = flashgen.Variant("fa3", 128, 128, 4, 3 if d == 64 else 2, programs_per_sm=1,
                               head_units=True)
    q, k, v = make_inputs(*shape, d, dtype, "cuda", seed=d + shape[3])
    problem = flashgen.Problem.from_tensors(q, k, v, causal=True)
    assert head_units_leave_programs_idle(variant, problem,
                                          device_info(q.device).sm_count) is None
    programs = fa3_grid(variant, shape[3], shape[0] * shape[1], q.device)[0][0]
    order = _tile_order(variant, problem, programs)
    assert all(len({bh for bh, _ in tiles}) == 1 for tiles in order)  # a head a program
    out, lse = flashgen.attention(q, k, v, causal=True, variant=variant, return_lse=True)
    check = compare(out, q, k, v, True, None, lse)
    assert check.ok, check.reason
