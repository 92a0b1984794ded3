"""Variants, the search space's rules, and rendering: no kernel runs here."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import flashgen
from flashgen.kernels.bwd_space import bwd_portfolio, default_bwd_variant
from flashgen.kernels.fwd_space import (
    all_points,
    default_variant,
    portfolio,
    shared_memory_bytes,
)
from flashgen.kernels.hardware import INTERPRETER, DeviceInfo

PROBLEMS = [
    flashgen.Problem(1, 8, 2, 77, 130, 40, "fp16", True),
    flashgen.Problem(2, 16, 16, 4096, 4096, 128, "bf16", False),
    flashgen.Problem(1, 4, 4, 1, 33, 256, "fp32", True),
]
SMALL_GPU = DeviceInfo("small-gpu", (8, 0), 108, 101376)


def test_variant_is_frozen_hashable_and_round_trips() -> None:
    v = flashgen.Variant("fa1", 32, 64, 4, 2)
    assert hash(v) == hash(flashgen.Variant.from_dict(v.to_dict()))
    assert flashgen.Variant.from_json(json.dumps(v.to_dict())) == v
    with pytest.raises(AttributeError):
        v.block_m = 64  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown variant parameters"):
        flashgen.Variant.from_dict({**v.to_dict(), "blockm": 3})



def test_shared_memory_counts_what_the_h100_sweep_found_over() -> None:
    """The whole-space sweep on an H100 (docs/search-quality.md): at D128 these kernels
    failed to compile for shared memory (262-263 KB against 232 KB) while their one-tile
    or pointer twins ran; the space now drops the first and keeps the second."""
    hopper = DeviceInfo("H-test", (9, 0), 132, 232448)
    p = flashgen.Problem(8, 16, 16, 2048, 2048, 128, "bf16", True)
    over = [flashgen.Variant("fa2", 128, 128, 4, 3, use_tma=True, programs_per_sm=1),
            flashgen.Variant("fa2", 256, 64, 8, 4, use_tma=True, programs_per_sm=2),
            flashgen.Variant("fa1", 256, 128, 8, 2)]
    fits = [flashgen.Variant("fa2", 128, 128, 4, 3, use_tma=True),
            flashgen.Variant("fa2", 128, 128, 4, 3, programs_per_sm=1),
            flashgen.Variant("fa1", 256, 64, 8, 2)]
    for v in over:
        assert "shared memory" in (flashgen.why_invalid(v, p, hopper) or ""), v
    for v in fits:
        assert flashgen.why_invalid(v, p, hopper) is None, v

@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("device", [INTERPRETER, SMALL_GPU], ids=lambda d: d.name)
def test_space_holds_exactly_the_valid_points(
    problem: flashgen.Problem, device: DeviceInfo
) -> None:
    space = flashgen.search_space(problem, device)
    assert space, "every problem has at least one valid variant"
    assert {v.loop_order for v in space} == {"fa1", "fa2"}
    valid = set(space)
    excluded = [v for v in all_points() if v not in valid]
    assert excluded, "the rules must exclude something on these problems"
    for v in excluded:
        assert flashgen.why_invalid(v, problem, device)
    for v in space:
        assert shared_memory_bytes(v, problem) <= device.shared_memory
        assert v.block_m <= max(16, 1 << (problem.seq_q - 1).bit_length())
        assert v.block_n <= max(16, 1 << (problem.seq_k - 1).bit_length())
    assert flashgen.default_variant(problem, device) in space


@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
def test_hopper_portfolio_holds_only_valid_points(head_dim: int) -> None:
    hopper = DeviceInfo("H-test", (9, 0), 132, 232448)
    problem = flashgen.Problem(2, 8, 8, 4096, 4096, head_dim, "bf16", True)
    picks = portfolio(problem, hopper)
    assert all(flashgen.why_invalid(v, problem, hopper) is None for v in picks)
    assert len(set(picks)) == len(picks)
    if head_dim <= 128:
        assert picks, "the portfolio covers the common head dims"
    assert portfolio(problem, SMALL_GPU) == [] and portfolio(problem, INTERPRETER) == []


#: Described GPUs, one per architecture, with the shared memory a block may opt into.
ARCHITECTURES = {
    "ampere-8.0": DeviceInfo("A-test", (8, 0), 108, 166912),
    "ada-8.9": DeviceInfo("L-test", (8, 9), 142, 101376),
    "hopper-9.0": DeviceInfo("H-test", (9, 0), 132, 232448),
    "blackwell-10.0": DeviceInfo("B-test", (10, 0), 148, 232448),
    "blackwell-12.0": DeviceInfo("R-test", (12, 0), 170, 101376),
}


def _hopper_only(v: flashgen.Variant | flashgen.BwdVariant) -> bool:
    """Whether `v` uses a kernel or feature written for Hopper alone: Gluon (fa3) kernels,
    TMA descriptors or the warp-specialized loop."""
    if isinstance(v, flashgen.BwdVariant):
        return v.fa3 != "none"
    return v.loop_order == "fa3" or v.use_tma or v.warp_specialize


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_hopper_kernels_are_offered_on_hopper_only(name: str) -> None:
    """Blackwell (10.x, 12.x) once counted as Hopper (capability >= 9.0) and would have been
    served Gluon/wgmma/TMA kernels; every GPU but 9.x gets the portable Triton variants, by
    default, in the portfolio and in the whole search space, for both passes."""
    from flashgen.kernels.modes import SPACES

    dev = ARCHITECTURES[name]
    hopper = dev.capability[0] == 9
    assert dev.is_hopper == hopper
    for problem in (flashgen.Problem(4, 16, 16, 4096, 4096, 128, "fp16", False),
                    flashgen.Problem(2, 32, 8, 8192, 8192, 64, "bf16", True)):
        # The decode family has no Hopper-only kernel: its points are portable everywhere.
        for space in (SPACES["fwd"], SPACES["bwd"]):
            default = space.default(problem, dev)
            assert _hopper_only(default) == hopper, (space.mode, problem, default)
            picks = space.portfolio(problem, dev)
            assert any(_hopper_only(v) for v in picks) == hopper, (space.mode, problem)
            points = space.points(problem, dev)
            assert any(_hopper_only(v) for v in points) == hopper, (space.mode, problem)
        assert not _hopper_only(flashgen.default_variant(problem, dev, fa3=False))


def test_rules_name_the_reason() -> None:
    p = flashgen.Problem(1, 1, 1, 8, 8, 256, "fp32")
    assert "longer than" in flashgen.why_invalid(flashgen.Variant("fa2", 64, 16, 4, 1), p)
    big = flashgen.Problem(1, 1, 1, 4096, 4096, 256, "fp16")
    reason = flashgen.why_invalid(flashgen.Variant("fa2", 128, 128, 8, 4), big, SMALL_GPU)
    assert "shared memory" in reason


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_every_variant_renders_to_valid_python(problem: flashgen.Problem) -> None:
    for v in flashgen.search_space(problem, INTERPRETER):
        source = flashgen.render(v, problem)
        tree = ast.parse(source)
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "attn_fwd" in names
        assert f"BLOCK_M: tl.constexpr = {v.block_m}" in source
        assert f"BLOCK_N: tl.constexpr = {v.block_n}" in source


def test_render_is_deterministic_and_cached() -> None:
    v, p = flashgen.Variant("fa2", 64, 32, 4, 2), PROBLEMS[0]
    first = flashgen.render(v, p)
    assert flashgen.render(v, p) is first  # served from the content cache
    # Lengths and batch are runtime arguments: they do not change the source.
    assert flashgen.render(v, p.with_(seq_q=999, seq_k=5, batch=7)) == first
    assert flashgen.render(v, p.with_(causal=False)) != first
    assert "if causal" not in first and "{%" not in first


def test_render_works_from_any_directory(tmp_path: Path) -> None:
    code = (
        "import flashgen, hashlib;"
        "p = flashgen.Problem(1, 2, 1, 33, 33, 80, 'fp16', True);"
        "print(hashlib.sha256(flashgen.render(flashgen.Variant(), p).encode()).hexdigest())"
    )
    here = flashgen.render(flashgen.Variant(), flashgen.Problem(1, 2, 1, 33, 33, 80, "fp16", True))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    import hashlib

    assert out == hashlib.sha256(here.encode()).hexdigest()


def test_rendered_kernels_stay_out_of_the_home_cache(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """The suite once wrote hundreds of kernel sources into ~/.cache/flashgen: conftest
    points FLASHGEN_CACHE_DIR at a session folder, which `cache_dir` follows."""
    import inspect

    from flashgen.kernels.render import cache_dir, load_kernel

    home = (Path.home() / ".cache" / "flashgen").resolve()
    problem = PROBLEMS[0]
    kernel = load_kernel(flashgen.default_variant(problem, INTERPRETER), problem)
    written = Path(inspect.getfile(kernel.fn)).resolve()
    assert written.parent == cache_dir().resolve()
    assert not written.is_relative_to(home) and not cache_dir().resolve().is_relative_to(home)
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "here"))
    assert cache_dir() == tmp_path / "here" / "kernels"
    monkeypatch.delenv("FLASHGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "flashgen" / "kernels"


def test_kernel_hash_is_stable_and_ignores_lengths_and_batch() -> None:
    v, p = flashgen.Variant("fa2", 64, 32, 4, 2), PROBLEMS[0]
    assert flashgen.kernel_hash(v, p) == flashgen.kernel_hash(v, p.with_(batch=7, seq_q=5))
    assert len(flashgen.kernel_hash(v, p)) == 16
    assert flashgen.kernel_hash(v, p) != flashgen.kernel_hash(v, p.with_(causal=not p.causal))


def test_problem_parse_and_errors() -> None:
    p = flashgen.Problem.parse("2,32,8,1024,1024,128", "bf16", True)
    assert (p.batch, p.group, p.padded_head_dim) == (2, 4, 128)
    with pytest.raises(ValueError, match="B,Hq,Hkv,Nq,Nk,D"):
        flashgen.Problem.parse("2,32,8,1024")
    with pytest.raises(ValueError, match="B,Hq,Hkv,Nq,Nk,D"):
        flashgen.Problem.parse("2,32,8,1k,1024,128")
    # A negative length is named as one, as zero is (it read as a malformed shape).
    with pytest.raises(ValueError, match="seq_q must be a positive integer, got -32"):
        flashgen.Problem.parse("1,2,1,-32,32,16")
    with pytest.raises(ValueError, match="multiple"):
        flashgen.Problem(1, 6, 4, 8, 8, 64)
    with pytest.raises(ValueError, match="head dim"):
        flashgen.Problem(1, 1, 1, 8, 8, 512)


def test_causal_flops_count_the_visible_half() -> None:
    full = flashgen.Problem(1, 1, 1, 1024, 1024, 64)
    causal = full.with_(causal=True)
    assert causal.flops() == pytest.approx(full.flops() * (1024 + 1) / 2 / 1024)


def test_render_with_other_texts_tells_an_untouched_kernel_from_an_edited_one() -> None:
    # What the kernel-hash tests (tests/test_kernel_hash.py) build on: rendering with other
    # template texts, which only changes the kernels of the family that was edited.
    from flashgen.kernels.render import _templates, render_with

    texts = dict(_templates())
    v, p = flashgen.Variant("fa2", 64, 32, 4, 2), PROBLEMS[0]
    assert render_with(texts, v, p) == flashgen.render(v, p)
    edited = {**texts, "attn_fwd_fa2.py.jinja": texts["attn_fwd_fa2.py.jinja"] + "\n# edited\n"}
    assert render_with(edited, v, p) != flashgen.render(v, p)
    other_family = {**texts, "attn_fwd_fa3.py.jinja": "# another kernel family\n"}
    assert render_with(other_family, v, p) == flashgen.render(v, p)


# ------------------------------------------------- portfolios and defaults, pinned
# The tables in fwd_space and bwd_space are data: reordering or editing a row changes what a
# re-tune measures first and what an untuned shape runs. These lists are that behaviour as it
# stands; change them together with the tables, on purpose.
HOPPER = DeviceInfo("H-test", (9, 0), 132, 232448)

FWD_PORTFOLIO_PINNED = {
    (64, False): [
        "fa3 m192 n128 w4 s3 p1 pp", "fa3 m192 n128 w4 s3 p1", "fa3 m128 n128 w4 s3 p1",
        "fa3 m128 n128 w4 s2 p1", "fa3 m192 n128 w4 s4 p1", "fa3 m128 n64 w4 s3 p1",
        "fa3 m128 n128 w4 s3", "fa3 m128 n128 w4 s4", "fa3 m128 n128 w4 s2",
        "fa3 m128 n64 w4 s4", "fa3 m128 n128 w8 s3", "fa2 m64 n128 w4 s2 tma",
        "fa2 m128 n64 w8 s4 tma", "fa2 m128 n128 w4 s3 tma", "fa2 m128 n64 w4 s3 tma",
        "fa2 m128 n64 w8 s3 ws", "fa2 m128 n64 w8 s4", "fa2 m64 n64 w4 s3",
    ],
    (64, True): [
        "fa3 m192 n128 w4 s3 p1", "fa3 m128 n128 w4 s3 p1", "fa3 m128 n128 w4 s2 p1",
        "fa3 m192 n128 w4 s4 p1", "fa3 m128 n64 w4 s3 p1", "fa3 m128 n128 w4 s3 p1 heads",
        "fa3 m128 n128 w4 s2 p1 heads", "fa3 m128 n128 w4 s3",
        "fa3 m128 n128 w4 s4", "fa3 m128 n128 w4 s2", "fa3 m128 n64 w4 s4",
        "fa3 m128 n128 w8 s3", "fa2 m64 n128 w4 s2 tma", "fa2 m128 n64 w8 s4 tma",
        "fa2 m128 n128 w4 s3 tma", "fa2 m128 n64 w4 s3 tma", "fa2 m128 n64 w8 s3 ws",
        "fa2 m128 n64 w8 s4", "fa2 m64 n64 w4 s3",
    ],
    (128, True): [
        "fa3 m128 n128 w4 s2 p1 pp", "fa3 m128 n128 w4 s2 p1", "fa3 m128 n128 w4 s2",
        "fa3 m128 n64 w4 s3 p1", "fa3 m128 n64 w4 s3 p1 pp", "fa3 m128 n128 w4 s3",
        "fa3 m128 n64 w4 s4 p1", "fa3 m128 n64 w4 s3", "fa3 m128 n64 w4 s4",
        "fa3 m128 n128 w8 s2", "fa2 m128 n128 w8 s3 ws tma", "fa2 m128 n128 w8 s3 tma",
        "fa2 m256 n64 w8 s4 ws tma", "fa2 m128 n64 w4 s2 tma", "fa2 m64 n64 w4 s3 tma",
        "fa2 m256 n64 w8 s3 tma",
    ],
    (96, False): [  # fa3 pads 96 to 128 (TMA zero fill): the D128 rows
        "fa3 m128 n128 w4 s2 p1 pp", "fa3 m128 n128 w4 s2 p1", "fa3 m128 n128 w4 s2",
        "fa3 m128 n64 w4 s3 p1", "fa3 m128 n64 w4 s3 p1 pp", "fa3 m128 n128 w4 s3",
        "fa3 m128 n64 w4 s4 p1", "fa3 m128 n64 w4 s3", "fa3 m128 n64 w4 s4", "fa3 m128 n128 w8 s2",
        "fa2 m128 n128 w8 s3 ws tma", "fa2 m128 n128 w8 s3 tma", "fa2 m256 n64 w8 s4 ws tma",
        "fa2 m128 n64 w4 s2 tma", "fa2 m64 n64 w4 s3 tma", "fa2 m256 n64 w8 s3 tma",
    ],
    (256, True): ["fa3 m128 n64 w4 s2 p1 pp", "fa3 m128 n64 w4 s2", "fa3 m128 n64 w4 s2 p1",
                  "fa3 m128 n64 w8 s2", "fa3 m64 n64 w4 s2", "fa2 m64 n64 w4 s3 tma"],
}

BWD_PORTFOLIO_PINNED = {
    64: [
        # causal: the lpt points first (programs launched heaviest first)
        "bwd-atomic own128x128 w4 s2 fa3 smem-stats lpt",
        "bwd-atomic own128x64 w4 s2 fa3 smem-stats lpt",
        "bwd-separate own128x64 w4 s2 fa3 fused-delta smem-stats lpt",
        "bwd-separate own128x64 w4 s2 fa3 smem-stats lpt",
        "bwd-atomic own128x64 w4 s2 fa3 smem-stats", "bwd-atomic own128x128 w4 s2 fa3 smem-stats",
        "bwd-separate own128x64 w4 s2 fa3 smem-stats",
        "bwd-separate own128x64 w4 s2 fa3 fused-delta smem-stats",
        "bwd-atomic own128x64 w4 s2 fa3", "bwd-atomic own128x128 w4 s2 fa3",
        "bwd-separate own128x64 w4 s2 fa3", "bwd-separate own128x64 w4 s2 fa3 fused-delta",
        "bwd-separate own128x64 w4 s3 fa3", "bwd-separate own128x32 w4 s3 fa3-dq dq-x64",
        "bwd-separate own128x32 w4 s3 fa3-dq dq-x64 fused-delta",
        "bwd-separate own128x32 w4 s3 fa3-dq dq-x128",
        "bwd-separate own128x128 w4 s2 fa3", "bwd-separate own128x128 w4 s2 fa3 dq-x64",
        "bwd-separate own128x32 w4 s3", "bwd-separate own128x32 w4 s3 fused-delta",
    ],
    128: ["bwd-atomic own128x64 w4 s2 fa3 smem-stats lpt",
          "bwd-separate own128x64 w4 s2 fa3 fused-delta smem-stats lpt",
          "bwd-separate own128x64 w4 s2 fa3 smem-stats lpt",
          "bwd-atomic own128x64 w4 s2 fa3 smem-stats",
          "bwd-separate own128x64 w4 s2 fa3 smem-stats",
          "bwd-separate own128x64 w4 s2 fa3 fused-delta smem-stats",
          "bwd-atomic own128x64 w4 s2 fa3", "bwd-separate own128x64 w4 s2 fa3",
          "bwd-separate own128x64 w4 s2 fa3 fused-delta", "bwd-separate own128x64 w4 s3 fa3",
          "bwd-separate own128x64 w8 s2", "bwd-separate own128x64 w8 s2 fused-delta"],
    96: ["bwd-atomic own128x64 w4 s2 fa3 smem-stats lpt",
         "bwd-separate own128x64 w4 s2 fa3 fused-delta smem-stats lpt",
         "bwd-separate own128x64 w4 s2 fa3 smem-stats lpt",
         "bwd-atomic own128x64 w4 s2 fa3 smem-stats",
         "bwd-separate own128x64 w4 s2 fa3 smem-stats",
         "bwd-separate own128x64 w4 s2 fa3 fused-delta smem-stats",
         "bwd-atomic own128x64 w4 s2 fa3", "bwd-separate own128x64 w4 s2 fa3",
         "bwd-separate own128x64 w4 s2 fa3 fused-delta", "bwd-separate own128x64 w4 s3 fa3",
         "bwd-separate own128x64 w8 s2", "bwd-separate own128x64 w8 s2 fused-delta"],
    256: ["bwd-separate own64x64 w4 s2 fa3 fused-delta smem-stats",
          "bwd-separate own64x64 w4 s2 fa3 fused-delta", "bwd-separate own64x64 w4 s2 fa3",
          "bwd-separate own64x32 w4 s3 fa3", "bwd-separate own64x32 w8 s2",
          "bwd-separate own64x32 w8 s2 fused-delta"],
}

#: (device, head dim, dtype, causal, keys) -> (forward default, backward default, backward
#: default without Gluon kernels). Every distinct answer and the key-count thresholds.
DEFAULTS_PINNED = {
    ("H-test", 64, "fp16", False, 1024): (
        "fa2 m128 n64 w4 s3", "bwd-separate own128x64 w4 s2 fa3 smem-stats",
        "bwd-separate own128x32 w4 s3"),
    ("H-test", 64, "fp16", False, 2048): (
        "fa3 m192 n128 w4 s3 p1 pp", "bwd-separate own128x64 w4 s2 fa3 smem-stats",
        "bwd-separate own128x32 w4 s3"),
    ("H-test", 64, "bf16", True, 2048): (
        "fa2 m128 n64 w4 s3", "bwd-separate own128x64 w4 s2 fa3 smem-stats lpt",
        "bwd-separate own128x32 w4 s3"),
    ("H-test", 64, "bf16", True, 4096): (
        "fa3 m128 n128 w4 s2 p1", "bwd-separate own128x64 w4 s2 fa3 smem-stats lpt",
        "bwd-separate own128x32 w4 s3"),
    ("H-test", 40, "fp16", False, 4096): (
        "fa2 m128 n64 w4 s3", "bwd-separate own128x32 w4 s3",
        "bwd-separate own128x32 w4 s3"),
    ("H-test", 128, "bf16", False, 512): (
        "fa3 m128 n128 w4 s2 p1 pp", "bwd-separate own128x64 w4 s2 fa3 smem-stats",
        "bwd-separate own128x64 w8 s2"),
    ("H-test", 96, "fp16", True, 512): (
        "fa2 m128 n64 w8 s3", "bwd-separate own128x64 w8 s2",
        "bwd-separate own128x64 w8 s2"),
    ("H-test", 256, "fp16", False, 512): (
        "fa3 m128 n64 w4 s2 p1 pp", "bwd-separate own64x64 w4 s2 fa3 fused-delta smem-stats",
        "bwd-separate own64x32 w8 s2"),
    # Padded to 256: the same fa3 kernels (products over the first 192 columns here).
    ("H-test", 192, "bf16", True, 2048): (
        "fa3 m128 n64 w4 s2 p1 pp", "bwd-separate own64x64 w4 s2 fa3 fused-delta smem-stats",
        "bwd-separate own64x32 w8 s2"),
    ("H-test", 40, "fp32", False, 512): (
        "fa2 m128 n64 w4 s3", "bwd-separate own64x32 w4 s1", "bwd-separate own64x32 w4 s1"),
    ("H-test", 96, "fp32", False, 512): (
        "fa2 m128 n32 w8 s2", "bwd-separate own32x16 w4 s1", "bwd-separate own32x16 w4 s1"),
    ("H-test", 256, "fp32", True, 512): (
        "fa2 m64 n32 w4 s2", "bwd-separate own32x16 w4 s1", "bwd-separate own32x16 w4 s1"),
    ("small-gpu", 64, "fp16", False, 16384): (
        "fa2 m128 n64 w4 s2", "bwd-separate own128x32 w4 s2",
        "bwd-separate own128x32 w4 s2"),
    ("small-gpu", 128, "bf16", True, 4096): (
        "fa2 m128 n64 w8 s2", "bwd-separate own64x32 w4 s2", "bwd-separate own64x32 w4 s2"),
    ("small-gpu", 256, "fp16", False, 512): (
        "fa2 m64 n32 w4 s2", "bwd-separate own32x32 w4 s1", "bwd-separate own32x32 w4 s1"),
    ("small-gpu", 256, "fp32", False, 512): (
        "fa2 m32 n16 w2 s1", "bwd-separate own32x16 w4 s1", "bwd-separate own32x16 w4 s1"),
    ("cpu-interpreter", 64, "fp16", True, 4096): (
        "fa2 m128 n64 w4 s2", "bwd-separate own128x32 w4 s2",
        "bwd-separate own128x32 w4 s2"),
}


@pytest.mark.parametrize("case", sorted(FWD_PORTFOLIO_PINNED), ids=str)
def test_hopper_portfolio_order_is_pinned(case: tuple[int, bool]) -> None:
    head_dim, causal = case
    problem = flashgen.Problem(2, 8, 2, 2048, 2048, head_dim, "bf16", causal)
    assert [str(v) for v in portfolio(problem, HOPPER)] == FWD_PORTFOLIO_PINNED[case]


@pytest.mark.parametrize("head_dim", sorted(BWD_PORTFOLIO_PINNED))
def test_hopper_backward_portfolio_order_is_pinned(head_dim: int) -> None:
    problem = flashgen.Problem(2, 8, 2, 2048, 2048, head_dim, "bf16", True)
    assert [str(v) for v in bwd_portfolio(problem, HOPPER)] == BWD_PORTFOLIO_PINNED[head_dim]


@pytest.mark.parametrize("case", sorted(DEFAULTS_PINNED), ids=str)
def test_default_choices_are_pinned(case: tuple[str, int, str, bool, int]) -> None:
    name, head_dim, dtype, causal, keys = case
    device = {d.name: d for d in (HOPPER, SMALL_GPU, INTERPRETER)}[name]
    problem = flashgen.Problem(2, 8, 2, keys, keys, head_dim, dtype, causal)
    got = (default_variant(problem, device), default_bwd_variant(problem, device),
           default_bwd_variant(problem, device, fa3=False))
    assert tuple(str(v) for v in got) == DEFAULTS_PINNED[case]


def test_default_without_gluon_is_the_portable_one() -> None:
    for head_dim, expected in ((64, "fa2 m128 n64 w4 s3"), (128, "fa2 m128 n64 w8 s3")):
        problem = flashgen.Problem(2, 8, 2, 8192, 8192, head_dim, "bf16", False)
        assert default_variant(problem, HOPPER).loop_order == "fa3"
        assert str(default_variant(problem, HOPPER, fa3=False)) == expected
