"""The decode family (`attention_with_kvcache`) against the float64 reference on each sequence's
valid cache: ragged lengths, shuffled block tables, Nq 1 and 3, GQA 4:1, odd head dims; and
its bad-input errors. CPU tests run tiny shapes through the interpreter (fp32/fp16); `gpu`
tests run real sizes in bf16 with page sizes 16 and 256.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import flashgen
from flashgen import DecodeVariant
from flashgen.kernels.decode_render import decode_kernel_hash, render_decode
from flashgen.kernels.decode_space import (
    decode_portfolio,
    decode_search_space,
    default_decode_variant,
    why_invalid_decode,
)
from flashgen.kernels.hardware import INTERPRETER
from flashgen.kernels.problem import DecodeProblem
from flashgen.tune.check import make_inputs
from flashgen.tune.decode_bench import compare_kvcache, make_kvcache

interpreter = pytest.mark.interpreter
gpu = pytest.mark.gpu


def _check(problem: DecodeProblem, lengths: list[int], variant: DecodeVariant | None,
           device: str = "cpu", seed: int = 0) -> None:
    cache = make_kvcache(problem, device, seed, seqlens=lengths)
    out, lse = flashgen.attention_with_kvcache(
        cache.q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table,
        causal=problem.causal, return_lse=True, variant=variant)
    assert out.shape == cache.q.shape and out.dtype == cache.q.dtype
    got = compare_kvcache(out, cache, problem.causal, lse=lse)
    assert got.ok, f"{problem} {variant}: {got.reason}"


@interpreter
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nq,splits", [(1, 3), (3, 0), (3, 1), (5, 2)])
def test_contiguous_ragged(causal: bool, nq: int, splits: int) -> None:
    """GQA 4:1, head dim 24 (padded to 32), a (B, N, H, D) cache viewed as (B, H, N, D),
    every sequence its own length; three splits, automatic, and one (no combine); Nq 5 packs
    20 rows into two 16-row tiles (a sequence of 5 keys: every key a query's own)."""
    p = DecodeProblem(3, 8, 2, nq, 40, 24, "fp32", causal)
    _check(p, [40, 5, 23], DecodeVariant(16, 16, splits, 1, 1))


@interpreter
@pytest.mark.parametrize("causal,nq,splits,page", [(True, 1, 3, 0), (False, 3, 0, 0),
                                                   (True, 5, 2, 16), (False, 1, 3, 0)])
def test_fused_combine(causal: bool, nq: int, splits: int, page: int) -> None:
    """The split pass's last program merges the splits (one launch): ragged lengths, one
    of them too short to reach every split (empty splits weigh nothing), Nq 5 over two row
    tiles, pages; the automatic count (one split for 48 keys here) writes the output
    straight. Twice on one problem: the
    merging programs left the counters at zero for the next call."""
    p = DecodeProblem(3, 8, 2, nq, 48, 24, "fp32", causal, page_size=page)
    for seed in (0, 1):
        _check(p, [48, 5, 23], DecodeVariant(16, 16, splits, 1, 1, fused_combine=True),
               seed=seed)


@interpreter
def test_fused_combine_merges_in_several_loads() -> None:
    """Head dim 200 (256 padded) on one warp loads 4 splits of a row at a time
    (`merge_width`): 9 splits take three loads, the running rescale between them; a
    sequence of 3 keys leaves 8 splits empty, one of 1 key all but one."""
    from flashgen.runtime.kvcache import merge_width

    assert merge_width(256, 1) == 4
    p = DecodeProblem(2, 4, 2, 1, 160, 200, "fp32", False)
    _check(p, [160, 3], DecodeVariant(16, 16, 9, 1, 1, fused_combine=True))
    _check(DecodeProblem(2, 4, 2, 1, 160, 200, "fp32", True), [1, 150],
           DecodeVariant(16, 16, 9, 1, 1, fused_combine=True))


def test_fused_combine_is_one_kernel_and_leaves_plain_kernels_alone() -> None:
    """A fused variant launches one kernel (its own text); an unfused one renders as
    before the knob existed, so stored rows keep their kernel hashes."""
    from flashgen.kernels.decode_render import decode_roles

    p = DecodeProblem(1, 8, 2, 1, 512, 128, "fp16", True)
    plain, fused = DecodeVariant(16, 64, 0, 4, 2), DecodeVariant(16, 64, 0, 4, 2, True)
    assert decode_roles(fused) == ("decode",)
    assert decode_roles(plain) == ("decode", "decode_combine")
    assert "atomic_add" in render_decode("decode", fused, p)
    assert "COUNTS," not in render_decode("decode", plain, p)
    assert decode_kernel_hash(plain, p) != decode_kernel_hash(fused, p)
    assert "nothing to merge" in why_invalid_decode(DecodeVariant(16, 64, 1, 4, 2, True), p,
                                                    INTERPRETER)
    assert str(fused) == "decode m16 n64 xauto w4 s2 fused"


@interpreter
@pytest.mark.parametrize("page,block_n,splits,nq", [(16, 16, 2, 3), (8, 16, 0, 3),
                                                    (16, 32, 2, 3), (16, 16, 2, 1)])
def test_paged_shuffled(page: int, block_n: int, splits: int, nq: int) -> None:
    """A shuffled block table over spare pages; pages of 8 under 16-key tiles take the
    per-key page gather, as do 32-key tiles over pages of 16. fp16, Nq 3 (speculative
    decoding) or 1 (a generated token), causal, odd head dim 40."""
    p = DecodeProblem(2, 8, 2, nq, 48, 40, "fp16", True, page_size=page)
    _check(p, [48, 19], DecodeVariant(16, block_n, splits, 1, 1))


@interpreter
@pytest.mark.parametrize("page,block_n,splits,nq,leftpad", [
    (0, 16, 3, 1, False), (0, 32, 0, 3, True),  # contiguous; left-padded rows
    (8, 16, 2, 3, False), (16, 32, 0, 1, False),  # tiles spanning pages (the gather)
    (32, 16, 2, 3, False),  # two tiles a page: the second starts mid-page
])
@pytest.mark.parametrize("narrow", [True, False])
def test_hoisted_rows(page: int, block_n: int, splits: int, nq: int, leftpad: bool,
                      narrow: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row offsets split into a loop-invariant part and a step's part give the same keys as
    offsets recomputed each step: contiguous and left-padded caches, tiles spanning pages,
    and pages holding two tiles; a shuffled table, ragged lengths, fp16. In int32 (these
    caches are small) and, as for caches past 2^31 elements, in int64."""
    from flashgen.runtime import kvcache

    if not narrow:
        monkeypatch.setattr(kvcache, "narrow_offsets", lambda *a: False)
    p = DecodeProblem(3, 8, 2, nq, 64, 40, "fp16", True, page_size=page)
    variant = DecodeVariant(16, block_n, splits, 1, 1, hoisted=True)
    if not leftpad:
        _check(p, [64, 19, 5], variant)
        return
    c = make_kvcache(p, "cpu", 7, seqlens=[40, 9, 23])
    pads = [5, 0, 17]
    k, v, lens = _left_padded(c, pads)
    out = flashgen.attention_with_kvcache(c.q, k, v, lens, variant=variant,
                                          cache_leftpad=torch.tensor(pads, dtype=torch.int32))
    got = compare_kvcache(out, c, True)
    assert got.ok, got.reason


def test_narrow_offsets_bounds_the_farthest_element() -> None:
    """int32 offsets only where the farthest element a hoisted kernel reaches from its
    head's base is under 2^31: pages x page stride + slots x slot stride + D, per cache."""
    from flashgen.runtime.kvcache import narrow_offsets

    paged = (16 * 8 * 128, 128, 8 * 128, 1)  # (pages, 16 slots, 8 heads, D 128)
    assert narrow_offsets(paged, paged, 2**31 // (16 * 8 * 128), 16, 128)
    assert not narrow_offsets(paged, paged, 2**31 // (16 * 8 * 128) + 1, 16, 128)
    contiguous = (2**40, 128, 8 * 128, 1)  # any batch: the kernel adds it in int64
    assert narrow_offsets(contiguous, contiguous, 1, 2**21, 128)
    assert not narrow_offsets(contiguous, contiguous, 1, 2**21 + 1, 128)
    assert not narrow_offsets(contiguous, (2**40, 128, 2**31, 1), 1, 2, 128)  # V alone


def test_hoisted_is_its_own_kernel_and_leaves_others_alone() -> None:
    """A hoisted variant renders its own kernel (the step computes no slot offsets); one
    without the knob renders as before it existed, so stored rows stay current."""
    for page in (0, 16):
        p = DecodeProblem(1, 8, 2, 1, 512, 128, "fp16", True, page_size=page)
        plain, hoisted = DecodeVariant(16, 64, 0, 4, 2), DecodeVariant(16, 64, 0, 4, 2,
                                                                       hoisted=True)
        assert decode_kernel_hash(plain, p) != decode_kernel_hash(hoisted, p)
        assert "_slot_offsets" not in render_decode("decode", plain, p)
        assert ("_slot_offsets" in render_decode("decode", hoisted, p)) == bool(page)
        assert "k_key" in render_decode("decode", hoisted, p) or page
    assert str(hoisted) == "decode m16 n64 xauto w4 s2 hoisted"
    assert "hoisted must be true or false" in why_invalid_decode(
        DecodeVariant(16, 64, 0, 4, 2, hoisted=1), p, INTERPRETER)  # type: ignore[arg-type]


@interpreter
def test_default_variant_and_wide_group() -> None:
    """The default variant on MQA (8 query heads on one K/V head, Nq 3: 24 packed rows in a
    32-row tile) with a short cache."""
    p = DecodeProblem(2, 8, 1, 3, 20, 16, "fp32", True)
    _check(p, [20, 3], None)


@interpreter
def test_attention_dispatches_small_nq_to_decode() -> None:
    """`attention` with one query against 256 keys runs the decode family, bottom-right
    causal as the forward promises, and `explain` says so."""
    q, k, v = make_inputs(1, 4, 1, 1, 256, 16, torch.float32, seed=3, layout="bnhd")
    choice = flashgen.explain(q, k, v, causal=True)
    assert "decode family" in choice.reason and isinstance(choice.variant, DecodeVariant)
    from flashgen.tune.check import compare
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    assert compare(out, q, k, v, True, lse=lse).ok
    q2, k2, v2 = make_inputs(1, 4, 1, 32, 256, 16, torch.float32)  # Nq 32: the forward
    assert not isinstance(flashgen.explain(q2, k2, v2).variant, DecodeVariant)


def test_space_rules_and_default() -> None:
    p = DecodeProblem(1, 32, 8, 1, 4096, 128, "fp16", True, page_size=16)
    space = decode_search_space(p, INTERPRETER)
    assert space and all(v.block_m == 16 for v in space)  # 4 query heads x 1 query
    assert default_decode_variant(p, INTERPRETER) == DecodeVariant(16, 64, 0, 4, 2,
                                                                   hoisted=True)
    portfolio = decode_portfolio(p, INTERPRETER)
    assert len(portfolio) >= 5 and all(v.hoisted for v in portfolio)
    assert all(why_invalid_decode(v, p, INTERPRETER) is None for v in portfolio)
    assert "num_warps must be among" in why_invalid_decode(DecodeVariant(16, 64, 0, 3), p,
                                                           INTERPRETER)
    short = DecodeProblem(1, 4, 1, 1, 64, 64, "fp16", True)
    assert "more than the 2 key tiles" in why_invalid_decode(DecodeVariant(16, 32, 4), short,
                                                             INTERPRETER)
    assert "block_m 32 is longer" in why_invalid_decode(DecodeVariant(32, 32), short,
                                                        INTERPRETER)


def test_kernel_hash_covers_structure_only() -> None:
    """Splits, warps and stages are launch knobs (same kernel); the page size is a constexpr
    argument (same source); paging and tiles change the kernel."""
    p = DecodeProblem(1, 8, 2, 1, 512, 128, "fp16", True)
    base = DecodeVariant(16, 64, 0, 4, 2)
    assert decode_kernel_hash(base, p) == decode_kernel_hash(DecodeVariant(16, 64, 8, 8, 3), p)
    assert decode_kernel_hash(base, p) != decode_kernel_hash(DecodeVariant(16, 64, 1, 4, 2), p)
    paged = DecodeProblem(1, 8, 2, 1, 512, 128, "fp16", True, page_size=64)
    assert decode_kernel_hash(base, paged) == decode_kernel_hash(
        base, DecodeProblem(1, 8, 2, 1, 512, 128, "fp16", True, page_size=256))
    assert decode_kernel_hash(base, paged) != decode_kernel_hash(base, p)
    assert "BLOCK_TABLE + off_b" in render_decode("decode", base, paged)
    assert "BLOCK_TABLE + off_b" not in render_decode("decode", base, p)


def _inputs(page: int = 0) -> dict:
    p = DecodeProblem(2, 4, 2, 2, 32, 16, "fp32", True, page_size=page)
    c = make_kvcache(p, seqlens=[32, 9])
    return {"q": c.q, "k_cache": c.k, "v_cache": c.v, "cache_seqlens": c.seqlens,
            "block_table": c.block_table}


def _call(**args: object) -> None:
    a = dict(args)
    flashgen.attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"),
                                    a.pop("cache_seqlens"), **a)


@pytest.mark.parametrize("change,error,words", [
    ({"cache_seqlens": torch.tensor([33, 9], dtype=torch.int32)}, ValueError,
     "longer than the cache"),
    ({"cache_seqlens": torch.tensor([-1, 9], dtype=torch.int32)}, ValueError, "negative"),
    ({"cache_seqlens": torch.tensor([32, 9])}, TypeError, "must be int32"),
    ({"cache_seqlens": torch.tensor([32], dtype=torch.int32)}, ValueError, "shape (batch,)"),
    ({"cache_seqlens": torch.tensor([32, 1], dtype=torch.int32)}, ValueError,
     "shorter than Nq = 2"),
    ({"q": torch.randn(2, 3, 2, 16)}, ValueError, "multiple of key/value heads"),
    ({"q": torch.randn(2, 4, 2, 8)}, ValueError, "head dims differ"),
    ({"q": torch.randn(2, 4, 2, 16, dtype=torch.float16)}, TypeError, "share a dtype"),
    ({"v_cache": torch.randn(2, 2, 31, 16)}, ValueError, "shapes differ"),
    ({"k_cache": torch.randn(3, 2, 32, 16), "v_cache": torch.randn(3, 2, 32, 16)}, ValueError,
     "batch sizes differ"),
    ({"q": torch.randn(3, 4, 2, 16)}, ValueError, "batch sizes differ: q 3, k_cache 2"),
    ({"cache_seqlens": torch.tensor([5], dtype=torch.int32)}, ValueError,
     "cache_seqlens must have shape"),
    ({"k_cache": "k"}, TypeError, "must be a torch.Tensor"),
    ({"scale": float("nan")}, ValueError, "finite"),
])
def test_bad_input_contiguous(change: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        _call(**(_inputs() | change))


def test_a_gradient_asked_of_the_kvcache_call_is_warned_about() -> None:
    args = _inputs()
    args["q"] = args["q"].clone().requires_grad_()
    with pytest.warns(UserWarning, match="inference only"):
        _call(**args)
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _call(**args)
    assert not [w for w in seen if "inference only" in str(w.message)]


def test_bad_input_paged() -> None:
    good = _inputs(page=16)
    _call(**good)  # a plan for this shape exists: the value checks must still run
    table = good["block_table"]
    with pytest.raises(TypeError, match="block_table must be int32"):
        _call(**(good | {"block_table": table.long()}))
    with pytest.raises(ValueError, match="block_table must have shape"):
        _call(**(good | {"block_table": table[:1]}))
    odd = torch.randn(6, 12, 2, 16)
    with pytest.raises(ValueError, match="must be a power of two, got 12"):
        _call(**(good | {"k_cache": odd, "v_cache": odd}))
    bad = table.clone()
    bad[1, 0] = 99
    with pytest.raises(ValueError, match="names page 99, outside the"):
        _call(**(good | {"block_table": bad}))
    with pytest.raises(ValueError, match="longer than the cache"):  # 2 pages of 16 keys
        _call(**(good | {"cache_seqlens": torch.tensor([33, 9], dtype=torch.int32)}))
    # A contiguous (B, Hkv, Nmax, D) cache passed with a block table: the error says how
    # its dims were read.
    flat = _inputs()
    with pytest.raises(ValueError, match=r"read as paged.*gives Hkv 32, D 16"):
        _call(**(flat | {"block_table": table}))


def test_invalid_explicit_variant_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"decode variant .* is invalid"):
        _call(**_inputs(), variant=DecodeVariant(16, 64, 0, 4, 2))  # 64 keys: 32 in cache
    with pytest.raises(TypeError, match=r"^variant must be a flashgen\.DecodeVariant"):
        _call(**_inputs(), variant=flashgen.Variant())


#: The fixed-split variant the GPU tests run: 16 packed rows (Nq 1 pads a tile of 4 heads,
#: Nq 4 fills one), 64-key tiles (across four pages of 16).
GPU_FIXED_SPLITS = DecodeVariant(16, 64, 7, 4, 3)
#: The split pass merging its own splits, with the launcher's count.
GPU_FUSED = DecodeVariant(16, 64, 0, 4, 3, fused_combine=True)
#: Row offsets hoisted out of the K/V loop (int32 at these sizes), 128-key tiles.
GPU_HOISTED = DecodeVariant(16, 128, 5, 8, 3, hoisted=True)


def test_the_gpu_tests_variant_is_valid_on_hopper() -> None:
    """Checked here, so a GPU run is not spent on an invalid explicit variant."""
    from flashgen.kernels.hardware import DeviceInfo
    from flashgen.kernels.modes import space_of

    h100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)
    for page, nq, dtype in itertools.product((0, 16, 256), (1, 4), ("bf16", "fp16")):
        p = DecodeProblem(4, 32, 8, nq, 8192, 128, dtype, True, page_size=page)
        assert space_of("decode").why_invalid(GPU_FIXED_SPLITS, p, h100) is None
        assert space_of("decode").why_invalid(GPU_FUSED, p, h100) is None
        assert space_of("decode").why_invalid(GPU_HOISTED, p, h100) is None


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("page", [0, 16, 256])
@pytest.mark.parametrize("nq", [1, 4])
def test_gpu_real_sizes(dtype: str, page: int, nq: int) -> None:
    """Llama 3 8B heads (32:8, D128), ragged lengths up to 8k, default and fixed splits."""
    p = DecodeProblem(4, 32, 8, nq, 8192, 128, dtype, True, page_size=page)
    lengths = [8192, 4097, 777, nq + 5]
    for variant in (None, GPU_FIXED_SPLITS, GPU_FUSED, GPU_HOISTED):
        _check(p, lengths, variant, device="cuda")


@gpu
@pytest.mark.parametrize("variant,page,lse", [
    (GPU_FIXED_SPLITS, 0, False), (GPU_FUSED, 16, False), (GPU_HOISTED, 256, True),
    (DecodeVariant(16, 64, 1, 4, 3), 0, True)])
def test_gpu_fast_launch_reads_each_calls_own_inputs(
        variant: DecodeVariant, page: int, lse: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a layout's third call on, the launches skip `launch.Bound` (the fast launch,
    `kvcache.prepare_decode`): four caches of one layout in turn, three rounds; the last
    round launches nothing through `Bound`, and every call matches the reference on its own
    cache and equals its first round's output bitwise (LSE too)."""
    from flashgen.runtime import launch

    p = DecodeProblem(4, 32, 8, 1, 4096, 128, "bf16", True, page_size=page)
    caches = [make_kvcache(p, "cuda", s, seqlens=[4096, 1000 + s, 17, 4000], capacity=4096)
              for s in range(4)]
    general = launch.Bound.launch
    through: list[int] = []
    monkeypatch.setattr(launch.Bound, "launch",
                        lambda self, *a: through.append(1) or general(self, *a))
    firsts: list[tuple] = []
    for round_ in range(3):
        through.clear()
        for i, c in enumerate(caches):
            got = flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens,
                                                  block_table=c.block_table, return_lse=lse,
                                                  variant=variant)
            out, out_lse = got if lse else (got, None)
            check = compare_kvcache(out, c, True, lse=out_lse)
            assert check.ok, f"round {round_}, cache {i}: {check.reason}"
            if round_ == 0:
                firsts.append((out, out_lse))
            else:
                assert torch.equal(out, firsts[i][0])
                assert out_lse is None or torch.equal(out_lse, firsts[i][1])
    assert not through


@gpu
def test_gpu_fused_combine_repeats_bitwise() -> None:
    """Back-to-back fused calls share their stream's counters, which each merge sets back
    to zero: 50 calls on the default stream, 20 on a side stream, and 5 replays of a CUDA
    graph (which zeroes its own) all equal the first call bitwise (the merge order is
    fixed), and the first matches the reference."""
    p = DecodeProblem(8, 32, 8, 1, 8192, 128, "bf16", True)
    c = make_kvcache(p, "cuda", 5, seqlens=[8192, 4097, 777, 6, 8192, 1, 3000, 64])
    call = lambda: flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens,
                                                   variant=GPU_FUSED)
    first = call()
    got = compare_kvcache(first, c, True)
    assert got.ok, got.reason
    outs = [call() for _ in range(50)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs += [call() for _ in range(20)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for _ in range(5):
        graph.replay()
        outs.append(captured.clone())
    torch.cuda.synchronize()
    assert len(outs) == 75 and all(torch.equal(o, first) for o in outs)


@gpu
def test_gpu_split_scratch_serves_back_to_back_calls() -> None:
    """The partial rows go to one scratch buffer per stream, reused by every call on it: two
    problems alternating 20 times on the default stream, 10 on a side stream and in 3
    replays of a CUDA graph (which gets its own buffer) all equal their first call bitwise,
    and the first calls match the reference."""
    from flashgen.runtime.kvcache import split_scratch

    dev = torch.device("cuda")
    kept = split_scratch(1000, dev)
    assert split_scratch(900, dev) is kept
    grown = split_scratch(kept.numel() + 1, dev)
    assert grown is not kept and split_scratch(10, dev) is grown  # the grown one is kept
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert split_scratch(10, dev) is not grown  # each stream its own
    other: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: other.append(split_scratch(10, dev)))
    worker.start()
    worker.join()
    assert other[0] is not grown  # and each thread
    caches = [make_kvcache(DecodeProblem(b, 32, 8, 1, 8192, 128, "bf16", True), "cuda", b,
                           seqlens=lengths)
              for b, lengths in ((4, [8192, 4097, 777, 6]), (2, [5000, 8192]))]
    calls = [lambda c=c: flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens,
                                                         variant=GPU_FIXED_SPLITS)
             for c in caches]
    firsts = [call() for call in calls]
    for first, c in zip(firsts, caches, strict=True):
        got = compare_kvcache(first, c, True)
        assert got.ok, got.reason
    outs: list[list[torch.Tensor]] = [[], []]
    for _ in range(20):
        for i, call in enumerate(calls):
            outs[i].append(call())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(10):
            for i, call in enumerate(calls):
                outs[i].append(call())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert split_scratch(10, dev) is not split_scratch(10, dev)  # fresh while capturing
        captured = [call() for call in calls]
    for _ in range(3):
        graph.replay()
        for i in range(2):
            outs[i].append(captured[i].clone())
        calls[0]()  # an eager call between replays, on the kept buffer
    torch.cuda.synchronize()
    for first, got in zip(firsts, outs, strict=True):
        assert len(got) == 33 and all(torch.equal(o, first) for o in got)


@gpu
@pytest.mark.parametrize("variant", [GPU_FIXED_SPLITS, GPU_FUSED])
def test_gpu_compiled_with_cuda_graph_trees(variant: DecodeVariant) -> None:
    """torch.compile's "reduce-overhead" (CUDA graph trees: what a static-cache
    `generate()` compiles) takes the call: warm-up, recording and replays all give the eager
    call's output. A scratch buffer kept past the call made torch refuse the graph ("tensor(s)
    in the cudagraph pool not tracked as outputs")."""
    c = make_kvcache(DecodeProblem(2, 32, 8, 1, 8192, 128, "bf16", True), "cuda", 3,
                     seqlens=[8192, 3001])

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lens: torch.Tensor) -> torch.Tensor:
        return flashgen.attention_with_kvcache(q, k, v, lens, variant=variant) * 1

    eager = call(c.q, c.k, c.v, c.seqlens)
    got = compare_kvcache(eager, c, True)
    assert got.ok, got.reason
    torch._dynamo.reset()
    compiled = torch.compile(call, mode="reduce-overhead", fullgraph=True)
    for _ in range(5):
        out = compiled(c.q, c.k, c.v, c.seqlens).clone()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@interpreter
@pytest.mark.parametrize("splits", [1, 3])
def test_output_without_the_lse_is_the_same(splits: int) -> None:
    """return_lse=False puts the LSE in scratch: the output is the one with it."""
    p = DecodeProblem(2, 4, 2, 1, 40, 16, "fp32", True)
    c = make_kvcache(p, "cpu", 3, seqlens=[40, 9])
    variant = DecodeVariant(16, 16, splits, 1, 1)
    out, _ = flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, return_lse=True,
                                             variant=variant)
    alone = flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, variant=variant)
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, out)


@interpreter
@pytest.mark.parametrize("page", [0, 16])
def test_no_lengths_means_every_sequence_holds_the_whole_cache(page: int) -> None:
    """cache_seqlens=None: the call of full lengths (Nmax each; a paged cache's max_pages x
    page_size), bitwise, output and LSE; under causal a cache shorter than Nq is named, and
    cache_leftpad without lengths too."""
    p = DecodeProblem(2, 4, 2, 3, 48, 16, "fp32", True, page_size=page)
    c = make_kvcache(p, "cpu", 5)
    variant = DecodeVariant(16, 16, 2, 1, 1)
    full = torch.full((2,), 48, dtype=torch.int32)
    want = flashgen.attention_with_kvcache(c.q, c.k, c.v, full, block_table=c.block_table,
                                           return_lse=True, variant=variant)
    got = flashgen.attention_with_kvcache(c.q, c.k, c.v, None, block_table=c.block_table,
                                          return_lse=True, variant=variant)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    check = compare_kvcache(got[0], c, True, lse=got[1])
    assert check.ok, check.reason
    if page:
        return
    with pytest.raises(ValueError, match="fewer than Nq = 3"):
        flashgen.attention_with_kvcache(c.q, c.k[:, :, :2], c.v[:, :, :2], None)
    with pytest.raises(ValueError, match="cache_leftpad needs cache_seqlens"):
        flashgen.attention_with_kvcache(c.q, c.k, c.v, None, cache_leftpad=full * 0)


@gpu
def test_gpu_growing_cache_hits_its_bucket_and_keeps_its_checks() -> None:
    """GPU lengths skip the checks on a plan hit, and a contiguous cache's plan is looked up
    by its Nmax bucket: lengths 600 and 601 share a plan and both answer right, while k and
    v of different lengths, or an empty cache, in the same bucket still raise."""
    from flashgen.serve import Dispatcher

    dispatcher = Dispatcher([])
    for n in (600, 601):
        p = DecodeProblem(2, 32, 8, 1, n, 128, "bf16", True)
        c = make_kvcache(p, "cuda", n, seqlens=[n, n - 50])
        out = flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, dispatcher=dispatcher)
        got = compare_kvcache(out, c, True)
        assert got.ok, f"Nk {n}: {got.reason}"
    assert len(dispatcher._decode_plans) == 1
    with pytest.raises(ValueError, match="shapes differ"):
        flashgen.attention_with_kvcache(c.q, c.k, c.v[:, :, :600], c.seqlens,
                                        dispatcher=dispatcher)
    with pytest.raises(ValueError, match="empty input"):
        flashgen.attention_with_kvcache(c.q, c.k[:, :, :0], c.v[:, :, :0], c.seqlens * 0,
                                        dispatcher=dispatcher)


@gpu
def test_gpu_dynamic_cache_steps_take_the_fast_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic cache's steps: each a new (B, Hkv, N, D) tensor one key longer (as
    transformers' cache concatenates), 40 steps from 4000 keys, the dispatched variant (its
    plan is the Nk bucket's; an explicit variant's is the exact shape's). Steps whose length
    specialises alike take the fast launch with their own strides and capacity (after the
    first 32, two of each residue mod 16, nothing goes through `launch.Bound`), and every
    step matches the reference."""
    from flashgen.runtime import launch

    p = DecodeProblem(4, 32, 8, 1, 4096, 128, "bf16", True)
    c = make_kvcache(p, "cuda", 11, seqlens=[4096] * 4)
    k_full, v_full = (t.contiguous() for t in (c.k, c.v))
    general = launch.Bound.launch
    through: list[int] = []
    monkeypatch.setattr(launch.Bound, "launch",
                        lambda self, *a: through.append(n) or general(self, *a))
    for n in range(4000, 4040):
        k, v = k_full[:, :, :n].contiguous(), v_full[:, :, :n].contiguous()
        lens = torch.tensor([n, n - 7, n, 3000], dtype=torch.int32, device="cuda")
        out = flashgen.attention_with_kvcache(c.q, k, v, lens)
        step = dataclasses.replace(c, k=k, v=v, seqlens=lens)
        got = compare_kvcache(out, step, True)
        assert got.ok, f"{n} keys: {got.reason}"
    assert through and max(through) < 4032


def test_compiled_calls_keep_no_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `fresh_buffers` (the compiled graph's op runs there) a CUDA stream gets no
    kept buffer: CUDA graph trees refuse an allocation of their pool that outlives the call.
    Outside it the same stream has its key. The CUDA queries are faked: no GPU here."""
    from flashgen.runtime import kvcache

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    cuda = torch.device("cuda", 0)
    assert kvcache._stream_key(cuda) == (0, 7)
    with kvcache.fresh_buffers():
        assert kvcache._stream_key(cuda) is None
        with kvcache.fresh_buffers():  # nested: still fresh, and restored after
            pass
        assert kvcache._stream_key(cuda) is None
    assert kvcache._stream_key(cuda) == (0, 7)
    seen: list[object] = []
    real = kvcache.fresh_buffers

    def spied() -> Any:
        seen.append(kvcache._stream_key(cuda))
        return real()

    # The op takes it: its kvcache call runs with no key for the stream.
    from flashgen.runtime import ops

    def dispatched(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(kvcache._stream_key(cuda))
        return torch.zeros(1), torch.zeros(1)

    monkeypatch.setattr(ops, "fresh_buffers", spied)
    monkeypatch.setattr(ops.default_dispatcher(), "kvcache", dispatched)
    p = DecodeProblem(1, 2, 1, 1, 8, 16, "fp32", True)
    c = make_kvcache(p, "cpu", 1, seqlens=[8])
    ops.attention_kvcache(c.q, c.k, c.v, c.seqlens, None, True, None, "")
    assert seen == [(0, 7), None]


def test_split_scratch_is_not_kept_on_the_cpu() -> None:
    """The interpreter's calls each get their own scratch (no stream orders them)."""
    from flashgen.runtime.kvcache import split_scratch

    cpu = torch.device("cpu")
    assert split_scratch(64, cpu) is not split_scratch(64, cpu)
    assert split_scratch(64, cpu).dtype == torch.float32


@gpu
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_gpu_head_dims(head_dim: int) -> None:
    p = DecodeProblem(2, 28, 4, 1, 4000, head_dim, "bf16", True, page_size=16)
    _check(p, [4000, 1234], None, device="cuda")


@gpu
@pytest.mark.parametrize("mods", [
    {"window": (1000, -1)}, {"softcap": 30.0}, {"sinks": True},
    {"window": (300, 0), "softcap": 20.0, "sinks": True}], ids=str)
@pytest.mark.parametrize("page", [0, 16])
def test_gpu_modifiers_on_the_kv_cache(mods: dict, page: int) -> None:
    """Window, softcap and sinks at Llama 3 8B heads on ragged caches up to 8k keys, bf16,
    default and fixed splits (sinks in the combine, the window's splits from its left edge)."""
    p = DecodeProblem(4, 32, 8, 1, 8192, 128, "bf16", True, page_size=page)
    cache = make_kvcache(p, "cuda", 3, seqlens=[8192, 4097, 777, 6])
    kwargs = dict(mods)
    if kwargs.get("sinks") is True:
        kwargs["sinks"] = torch.randn(32, generator=torch.Generator().manual_seed(1)).cuda()
    for variant in (None, GPU_FIXED_SPLITS, GPU_FUSED, GPU_HOISTED):
        out, lse = flashgen.attention_with_kvcache(
            cache.q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table,
            return_lse=True, variant=variant, **kwargs)
        got = compare_kvcache(out, cache, True, lse=lse, modifiers=kwargs)
        assert got.ok, f"{p} {mods} {variant}: {got.reason}"


@gpu
def test_gpu_left_padded_rows() -> None:
    """cache_leftpad at real sizes (a left-padded batch in a static cache): the unpadded
    cache's answer, the large junk in the pad slots never read."""
    p = DecodeProblem(3, 32, 8, 1, 4096, 128, "bf16", True)
    c = make_kvcache(p, "cuda", 7, seqlens=[4096, 900, 2300])
    pads = [100, 0, 1700]
    k, v, lens = _left_padded(c, pads)
    for variant in (None, GPU_FIXED_SPLITS, GPU_FUSED, GPU_HOISTED):
        out = flashgen.attention_with_kvcache(
            c.q, k, v, lens, cache_leftpad=torch.tensor(pads, dtype=torch.int32).cuda(),
            variant=variant)
        got = compare_kvcache(out, c, True)
        assert got.ok, f"{variant}: {got.reason}"


@gpu
def test_gpu_debug_checks_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASHGEN_DEBUG=1 reads GPU block tables back and names a page out of range."""
    p = DecodeProblem(2, 8, 2, 1, 64, 64, "bf16", True, page_size=16)
    c = make_kvcache(p, "cuda", seqlens=[64, 30])
    bad = c.block_table.clone()
    bad[0, 1] = 10_000
    monkeypatch.setenv("FLASHGEN_DEBUG", "1")
    with pytest.raises(ValueError, match="names page 10000"):
        flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, block_table=bad)


def test_transformers_step_limit_matches_dispatch() -> None:
    """The integration's new-token limit is the runtime's (it may import only flashgen)."""
    from flashgen.integrations.transformers import DECODE_MAX_NEW_TOKENS
    from flashgen.runtime.kvcache import DECODE_MAX_SEQ_Q

    assert DECODE_MAX_NEW_TOKENS == DECODE_MAX_SEQ_Q


@pytest.mark.parametrize("page,variant,dtype,d", [
    (0, DecodeVariant(16, 64, 0, 4, 3), "bf16", 128),
    (-1, DecodeVariant(16, 64, 0, 4, 3), "bf16", 128),  # contiguous, left-padded rows
    (16, DecodeVariant(16, 64, 0, 4, 3), "bf16", 128),  # a tile spans 4 pages: the gather
    (256, DecodeVariant(32, 128, 0, 4, 3), "fp16", 72),  # one page per tile, padded D,
                                                         # Nq 8: 32 packed rows
    (16, DecodeVariant(16, 128, 0, 8, 3, hoisted=True), "bf16", 128),  # hoisted, int32
    (0, DecodeVariant(16, 64, 0, 4, 3, hoisted=True), "bf16", 128),
])
def test_decode_kernels_compile_for_hopper(page: int, variant: DecodeVariant, dtype: str,
                                           d: int) -> None:
    """The interpreter never runs Triton's compiler: compile both kernels for sm_90a (no GPU
    needed) and read ptxas's report."""
    from flashgen.tune.decode_compile import report_in_subprocess

    p = DecodeProblem(8, 32, 8, variant.block_m // 4, 8192, d, dtype, True,
                      page_size=max(page, 0), leftpad=page < 0)
    assert why_invalid_decode(variant, p, "cpu") is None
    found = report_in_subprocess(variant, p)
    for role in ("decode", "decode_combine"):
        assert found[role]["shared"] <= 232448
        assert any("0 bytes spill stores" in line for line in found[role]["ptxas"]), found
    # K and V buffered num_stages deep on paged caches too: each tile's page ids are read a
    # step ahead (read in the step, the pipeliner kept one K/V buffer at any num_stages).
    assert found["decode"]["async_copies"] >= 2 * variant.num_stages, found
    stage = 2 * variant.block_n * p.padded_head_dim * 2  # K and V tiles, 16-bit
    assert found["decode"]["shared"] >= stage * (variant.num_stages - 1), found


@interpreter
def test_decode_bench_checks_and_times_each_competitor(tmp_path: Path) -> None:
    """`bench --mode decode` on the interpreter: flashgen and SDPA's math backend, each
    checked against the reference first; a paged problem reuses its contiguous twin's
    figures for the competitor that takes no block table."""
    from rich.console import Console

    from flashgen.bench.decoding import run_decode_bench
    from flashgen.kernels.presets import decode_problems

    problems = decode_problems(["2,4,1,1,40,16"], [], ["fp32"], [True], [0, 16])
    out = tmp_path / "decode.csv"
    rows = run_decode_bench(problems, torch.device("cpu"), ("flashgen", "sdpa-math"),
                            rep_ms=1, csv_path=out, console=Console(file=io.StringIO()))
    assert [(r.competitor, r.status) for r in rows] == [("flashgen", "ok"),
                                                       ("sdpa-math", "ok")] * 2
    assert rows[3].note == "contiguous twin's figure" and rows[3].us == rows[1].us
    assert all(r.gbps and r.gbps > 0 for r in rows)
    lines = out.read_text().splitlines()
    assert len(lines) == 5 and lines[0].endswith(",note,p20_us,p80_us")
    assert all(r.p20_us is not None and r.p20_us <= r.us <= r.p80_us for r in rows)


def test_decode_table_marks_an_unsteady_median() -> None:
    """A median whose repeats spread past UNSTEADY_SPREAD (a host-bound call, typically) is
    shown "~", as the forward's tables show theirs, and the bench prints the legend."""
    from rich.console import Console

    from flashgen.bench.decoding import DecodeRow, decode_table
    from flashgen.bench.report import print_whole

    p = DecodeProblem(1, 32, 8, 1, 2048, 128, "bf16", True, page_size=16)
    steady = DecodeRow(p, "flashgen", "ok", 14.0, 600.0, "", 13.8, 14.3)
    shaky = DecodeRow(p, "sdpa-cudnn", "ok", 53.8, 600.0, "", 40.0, 70.0)
    assert not steady.unsteady and shaky.unsteady
    assert not DecodeRow(p, "flex", "n/a").unsteady
    out = io.StringIO()
    print_whole(Console(file=out, width=80),
                decode_table([steady, shaky], ("flashgen", "sdpa-cudnn"), 4.3e12))
    row = next(line for line in out.getvalue().splitlines() if "B1 Nk2k" in line)
    assert " 14.0 " in row and "~53.8" in row


@interpreter
def test_an_interrupted_decode_bench_reports_what_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or SIGTERM, which the command turns into one) during the second problem: the
    first problem's rows are printed and kept in the CSV, the half-measured one is not."""
    from rich.console import Console

    from flashgen.bench import decoding
    from flashgen.kernels.presets import decode_problems

    calls: list[str] = []
    real = decoding._measure

    def measure(name: str, problem: DecodeProblem, *args: object) -> object:
        calls.append(name)
        if len(calls) == 4:  # the second problem's second competitor
            raise KeyboardInterrupt
        return real(name, problem, *args)

    monkeypatch.setattr(decoding, "_measure", measure)
    problems = decode_problems(["1,4,1,1,24,16", "1,4,1,1,40,16"], [], ["fp32"], [True], [0])
    out, said = tmp_path / "decode.csv", io.StringIO()
    rows = decoding.run_decode_bench(problems, torch.device("cpu"), ("flashgen", "sdpa-math"),
                                     rep_ms=1, csv_path=out, console=Console(file=said))
    assert [(r.problem, r.competitor) for r in rows] == [(problems[0], "flashgen"),
                                                         (problems[0], "sdpa-math")]
    assert "interrupted" in said.getvalue() and "CSV:" in said.getvalue()
    assert len(out.read_text().splitlines()) == 3  # the header and the first problem's rows


@interpreter
@pytest.mark.parametrize("mods", [
    {"window": (7, -1)}, {"softcap": 5.0}, {"sinks": True},
    {"window": (5, 0), "softcap": 3.0, "sinks": True}])
@pytest.mark.parametrize("page,nq,splits", [(0, 1, 3), (0, 3, 1), (16, 3, 0)])
def test_modifiers_on_the_kv_cache(mods: dict, page: int, nq: int, splits: int) -> None:
    """Window, softcap and sinks on ragged caches, against the reference per sequence: three
    splits (the window's splits start at the first query's left edge; sinks in the combine),
    one split (sinks folded in the split pass), and the automatic count on pages of 16."""
    p = DecodeProblem(2, 8, 2, nq, 48, 32, "fp32", True, page_size=page)
    cache = make_kvcache(p, "cpu", 3, seqlens=[48, 21])
    kwargs = dict(mods)
    if kwargs.get("sinks") is True:
        kwargs["sinks"] = torch.randn(8, generator=torch.Generator().manual_seed(1))
    for fused in (False, True) if splits != 1 else (False,):
        out, lse = flashgen.attention_with_kvcache(
            cache.q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table,
            return_lse=True, variant=DecodeVariant(16, 16, splits, 1, 1, fused), **kwargs)
        got = compare_kvcache(out, cache, True, lse=lse, modifiers=kwargs)
        assert got.ok, f"{p} {mods} fused={fused}: {got.reason}"


def test_modified_decode_kernels_compile_for_hopper_as_plain_ones_do() -> None:
    """Window, softcap and sinks compiled for sm_90a (Triton's own compiler, no GPU): the
    split pass keeps the plain kernel's shared memory and pipelined K/V copies."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    code = (
        "import json\n"
        "from flashgen.tune.decode_compile import compile_decode\n"
        "from flashgen.kernels.problem import DecodeProblem\n"
        "from flashgen.kernels.decode_variant import DecodeVariant\n"
        "out = {}\n"
        "for mods in ({}, {'window': True, 'softcap': True, 'sinks': True}):\n"
        "    p = DecodeProblem(2, 32, 8, 1, 8192, 128, 'bf16', True, page_size=16, **mods)\n"
        "    ks = compile_decode(DecodeVariant(16, 64, 0, 4, 3), p)\n"
        "    out[bool(mods)] = [ks['decode'].metadata.shared,\n"
        "                       ks['decode'].asm['ttgir'].count('async_copy_global_to_local')]\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["true"] == found["false"] and found["true"][1] > 0, found


@interpreter
def test_compiles_in_one_graph() -> None:
    """Under torch.compile (a static-cache `generate()` compiles its forward) the call is one
    opaque op, no graph break (fullgraph), an explicit variant and the modifiers included;
    traced, the kernel launch failed."""
    p = DecodeProblem(2, 8, 2, 1, 40, 16, "fp32", True)
    c = make_kvcache(p, "cpu", 5, seqlens=[40, 17])
    variant = DecodeVariant(16, 16, 2, 1, 1)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lens: torch.Tensor) -> torch.Tensor:
        out = flashgen.attention_with_kvcache(q, k, v, lens, variant=variant)
        assert isinstance(out, torch.Tensor)
        return out

    torch._dynamo.reset()
    out = torch.compile(call, backend="eager", fullgraph=True)(c.q, c.k, c.v, c.seqlens)
    got = compare_kvcache(out, c, True)
    assert got.ok, got.reason

    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3))
    mods = {"softcap": 5.0, "window": (6, 0), "sinks": sinks}

    def modified(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
        out = flashgen.attention_with_kvcache(q, k, v, lens, **mods)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        return out

    out = torch.compile(modified, backend="eager", fullgraph=True)(c.q, c.k, c.v, c.seqlens)
    got = compare_kvcache(out, c, True, modifiers=mods)
    assert got.ok, got.reason


@interpreter
def test_growing_cache_reuses_its_buckets_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic cache grows a key each generated token: every step is a new shape, but its
    plan is prepared once per Nk bucket (49..64 keys here: one), for the bucket's longest
    cache, so the choice does not depend on which length came first; each answer right. An
    explicit variant is still checked against each call's own length."""
    from flashgen.serve import Dispatcher

    dispatcher = Dispatcher([])
    prepared = []
    real = dispatcher._decode_prepared

    def counting(*args: object, **kwargs: object) -> object:
        prepared.append(args[0])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dispatcher, "_decode_prepared", counting)
    for n in (50, 51, 63, 64, 65):
        p = DecodeProblem(2, 8, 2, 1, n, 16, "fp32", True)
        c = make_kvcache(p, "cpu", n, seqlens=[n, n - 5])
        out = flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, dispatcher=dispatcher)
        got = compare_kvcache(out, c, True)
        assert got.ok, f"Nk {n}: {got.reason}"
    assert [s.seq_k for s in prepared] == [64, 96]
    # Looked up by bucket too: the five lengths are two entries, so a token pays no checks.
    assert len(dispatcher._decode_plans) == 2
    # Still checked where a bucket's plan cannot answer: an empty cache, k and v apart.
    p = DecodeProblem(2, 8, 2, 1, 40, 16, "fp32", True)
    c = make_kvcache(p, "cpu", 2, seqlens=[40, 30])
    with pytest.raises(ValueError, match="empty input"):
        flashgen.attention_with_kvcache(c.q, c.k[:, :, :0], c.v[:, :, :0], c.seqlens * 0,
                                        dispatcher=dispatcher)
    with pytest.raises(ValueError, match="shapes differ"):
        flashgen.attention_with_kvcache(c.q, c.k, c.v[:, :, :39], c.seqlens,
                                        dispatcher=dispatcher)
    p = DecodeProblem(2, 8, 2, 1, 64, 16, "fp32", True)
    four = DecodeVariant(16, 16, 4, 1, 1)  # 4 splits: valid for 64 keys, not for 40
    c = make_kvcache(p, "cpu", 1, seqlens=[64, 30])
    flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, variant=four,
                                    dispatcher=dispatcher)
    p = DecodeProblem(2, 8, 2, 1, 40, 16, "fp32", True)
    c = make_kvcache(p, "cpu", 1, seqlens=[40, 30])
    with pytest.raises(ValueError):
        flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, variant=four,
                                        dispatcher=dispatcher)


def _left_padded(c: Any, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`c`'s contiguous caches with `pads[b]` slots of large junk before each row's keys, and
    the lengths that then cover them (the pads included)."""
    b, hkv, n, d = c.k.shape
    extra = max(pads)
    gen = torch.Generator().manual_seed(11)
    k = 100 * torch.randn(b, hkv, n + extra, d, generator=gen).to(c.k.device, c.k.dtype)
    v = 100 * torch.randn(b, hkv, n + extra, d, generator=gen).to(c.v.device, c.v.dtype)
    for i, pad in enumerate(pads):
        k[i, :, pad:pad + n] = c.k[i]
        v[i, :, pad:pad + n] = c.v[i]
    return k, v, c.seqlens + torch.tensor(pads, dtype=torch.int32, device=c.seqlens.device)


@interpreter
@pytest.mark.parametrize("causal,nq,splits,window", [
    (True, 1, 3, None), (True, 3, 0, None), (False, 3, 1, None), (True, 1, 2, (8, 0))])
def test_left_padded_rows_match_the_unpadded_call(causal: bool, nq: int, splits: int,
                                                  window: tuple[int, int] | None) -> None:
    """cache_leftpad: each row's keys start past its pad slots (a left-padded batch in a
    static cache). The answer is the unpadded cache's, against the reference: the junk in the
    pads is never read, and the causal alignment and the window follow each row's end."""
    p = DecodeProblem(3, 8, 2, nq, 40, 24, "fp32", causal)
    c = make_kvcache(p, "cpu", 7, seqlens=[40, 9, 23])
    pads = [5, 0, 17]
    k, v, lens = _left_padded(c, pads)
    out = flashgen.attention_with_kvcache(
        c.q, k, v, lens, causal=causal, window=window,
        cache_leftpad=torch.tensor(pads, dtype=torch.int32),
        variant=DecodeVariant(16, 16, splits, 1, 1))
    got = compare_kvcache(out, c, causal, modifiers={"window": window} if window else None)
    assert got.ok, got.reason


@interpreter
def test_strided_lengths_and_pads_are_read_as_values() -> None:
    """cache_seqlens and cache_leftpad views with a stride other than 1 (columns of a
    table): the kernel reads them at stride 1, so the launcher makes them contiguous."""
    p = DecodeProblem(3, 8, 2, 1, 40, 24, "fp32", True)
    c = make_kvcache(p, "cpu", 7, seqlens=[40, 9, 23])
    pads = [5, 0, 17]
    k, v, lens = _left_padded(c, pads)
    lens_col = torch.stack([lens, torch.full_like(lens, 99)], 1)[:, 0]
    pads_col = torch.tensor([[x, 99] for x in pads], dtype=torch.int32)[:, 0]
    assert lens_col.stride(0) == 2 and pads_col.stride(0) == 2
    out = flashgen.attention_with_kvcache(c.q, k, v, lens_col, cache_leftpad=pads_col,
                                          variant=DecodeVariant(16, 16, 2, 1, 1))
    got = compare_kvcache(out, c, True)
    assert got.ok, got.reason


@interpreter
def test_left_padding_bad_input() -> None:
    p = DecodeProblem(2, 4, 1, 1, 32, 16, "fp32", True)
    c = make_kvcache(p, "cpu", 1, seqlens=[32, 20])

    def call(pads: object, **kw: object) -> None:
        flashgen.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, cache_leftpad=pads, **kw)

    with pytest.raises(TypeError, match="cache_leftpad must be int32"):
        call(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"cache_leftpad must have shape \(batch,\)"):
        call(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_leftpad\[1\] = 21 is outside"):
        call(torch.tensor([0, 21], dtype=torch.int32))
    paged = DecodeProblem(2, 4, 1, 1, 32, 16, "fp32", True, page_size=16)
    pc = make_kvcache(paged, "cpu", 1, seqlens=[32, 20])
    with pytest.raises(ValueError, match="cache_leftpad is for contiguous caches"):
        flashgen.attention_with_kvcache(pc.q, pc.k, pc.v, pc.seqlens,
                                        block_table=pc.block_table,
                                        cache_leftpad=torch.zeros(2, dtype=torch.int32))


def test_explain_kvcache_takes_the_calls_modifiers() -> None:
    """`explain_kvcache` took no window, softcap, sinks or cache_leftpad, though those calls
    render kernels of their own; it takes them now, checked as the call checks them."""
    from flashgen.serve import Dispatcher

    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    lengths = torch.tensor([250], dtype=torch.int32)
    dispatcher = Dispatcher([])
    plain = dispatcher.explain_kvcache(q, k, v, lengths)
    modified = dispatcher.explain_kvcache(q, k, v, lengths, window=(31, -1), softcap=5.0,
                                          sinks=torch.zeros(4),
                                          cache_leftpad=torch.tensor([3], dtype=torch.int32))
    assert modified.variant == plain.variant  # untuned: the same default, another kernel
    with pytest.raises(ValueError, match="softcap must be"):
        dispatcher.explain_kvcache(q, k, v, lengths, softcap=-1.0)


def test_a_call_without_queries_is_answered_without_a_kernel() -> None:
    """A batch or Nq of 0 raised "empty input"; like `attention`, the KV-cache call now
    answers it (an empty output and LSE), its inputs checked as any call's. A cache without
    slots stays an error."""
    k = v = torch.randn(2, 2, 64, 16)
    lengths = torch.tensor([10, 20], dtype=torch.int32)
    out, lse = flashgen.attention_with_kvcache(torch.randn(2, 4, 0, 16), k, v, lengths,
                                               return_lse=True)
    assert out.shape == (2, 4, 0, 16) and lse.shape == (2, 4, 0) and lse.dtype == torch.float32
    none = flashgen.attention_with_kvcache(torch.randn(0, 4, 1, 16), k[:0], v[:0], lengths[:0])
    assert none.shape == (0, 4, 1, 16)
    with pytest.raises(ValueError, match="head dims differ"):
        flashgen.attention_with_kvcache(torch.randn(2, 4, 0, 8), k, v, lengths)
    with pytest.raises(ValueError, match="empty input"):
        flashgen.attention_with_kvcache(torch.randn(2, 4, 1, 16), k[:, :, :0], v[:, :, :0],
                                        lengths)
