"""The backward kernels against float64 autograd of the reference, on odd shapes.

Gradients come from `run_backward` fed with the forward kernel's own output and LSE, as the
autograd layer will feed it. CPU tests run through the Triton interpreter (tiny shapes; bf16 is
left to the `gpu` tests because the 3.6 interpreter computes bf16 dots wrongly).
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import replace

import pytest
import torch

import flashgen
from flashgen.kernels.bwd_render import BWD_KERNELS, bwd_kernel_hash, bwd_roles, render_bwd
from flashgen.kernels.bwd_space import (
    HOPPER_BWD_PORTFOLIO,
    all_bwd_points,
    bwd_pointer_twin,
    bwd_portfolio,
    bwd_search_space,
    bwd_shared_memory_bytes,
    default_bwd_variant,
    why_invalid_bwd,
)
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.hardware import INTERPRETER, DeviceInfo
from flashgen.kernels.problem import DTYPE_NAMES
from flashgen.runtime.backward import fa3_tile_rows
from flashgen.runtime.forward import padded_head_dim
from flashgen.serve import run_backward
from flashgen.tune.check import CheckResult, make_inputs
from flashgen.tune.gluon_compile import spill_store_bytes
from flashgen.tune.grads import compare_grads, reference_grads

interpreter = pytest.mark.interpreter
gpu = pytest.mark.gpu

# Small tiles keep several programs, loop trips and the causal split in play on tiny shapes;
# owned and streamed tiles of different sizes catch a swapped pair in the dQ kernel.
CPU_VARIANTS = [
    BwdVariant(16, 32, 4, 1),
    BwdVariant(32, 16, 2, 2),
    BwdVariant(16, 16, 2, 1, "atomic"),
    BwdVariant(16, 64, 4, 2),
    BwdVariant(32, 32, 4, 1, "atomic"),
    BwdVariant(64, 32, 4, 3),
]


def _fitting(index: int, problem: flashgen.Problem) -> BwdVariant:
    """The index-th sample variant that is valid for the problem."""
    for shift in range(len(CPU_VARIANTS)):
        v = CPU_VARIANTS[(index + shift) % len(CPU_VARIANTS)]
        if why_invalid_bwd(v, problem, INTERPRETER) is None:
            return v
    raise AssertionError("the 16x16 sample fits every problem")


def _upstream_grad(q: torch.Tensor, seed: int, layout: str) -> torch.Tensor:
    """A seeded dO shaped like q, in the same memory layout as the inputs."""
    gen = torch.Generator().manual_seed(seed + 1000)
    b, h, n, d = q.shape
    if layout == "bnhd":
        return torch.randn(b, n, h, d, generator=gen).to(q.device, q.dtype).transpose(1, 2)
    return torch.randn(b, h, n, d, generator=gen).to(q.device, q.dtype)


def _backward(
    index: int,
    causal: bool,
    nq: int,
    nk: int,
    d: int,
    dtype: torch.dtype,
    heads: tuple[int, int],
    layout: str,
    device: str = "cpu",
    variant: BwdVariant | None = None,
    batch: int = 1,
    scale: float | None = None,
) -> tuple[CheckResult, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor]:
    """Forward with flashgen, backward with `variant`; returns (check, grads, (q, k, v), do)."""
    hq, hkv = heads
    q, k, v = make_inputs(batch, hq, hkv, nq, nk, d, dtype, device, seed=index, layout=layout)
    do = _upstream_grad(q, index, layout)
    problem = flashgen.Problem.from_tensors(q, k, v, causal)
    variant = variant or _fitting(index, problem)
    out, lse = flashgen.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    grads = run_backward(do, q, k, v, out, lse, variant, problem, scale)
    for grad, like in zip(grads, (q, k, v), strict=True):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert grad.stride() == like.stride(), "gradients keep their input's memory layout"
    result = compare_grads(grads, q, k, v, do, causal, scale)
    assert result.ok, f"{variant} on {problem} ({layout}): {result.reason}"
    return result, grads, (q, k, v), do


# Main grid: causal x odd lengths x odd head dims. dtype, GQA, layout and the sample variant
# (including both dq modes) rotate with the case index so every combination appears without
# multiplying the grid.
GRID = list(itertools.product((False, True), (1, 33, 77), (40, 64, 80)))


@interpreter
@pytest.mark.parametrize(("causal", "n", "d"), GRID)
def test_self_attention_grid(causal: bool, n: int, d: int) -> None:
    index = GRID.index((causal, n, d))
    dtype = (torch.float32, torch.float16)[index % 2]
    heads = ((2, 2), (4, 2), (4, 1))[index % 3]
    layout = ("bhnd", "bnhd")[(index // 2) % 2]
    _backward(index, causal, n, n, d, dtype, heads, layout)


CROSS = list(itertools.product((False, True), ((33, 77), (77, 33), (1, 77), (77, 1))))


@interpreter
@pytest.mark.parametrize(("causal", "lengths"), CROSS)
def test_cross_attention(causal: bool, lengths: tuple[int, int]) -> None:
    # Nq != Nk: with causal the diagonal is aligned bottom-right, and Nq > Nk leaves early
    # queries with no visible key (LSE -inf), which must give zero gradient, never NaN.
    index = CROSS.index((causal, lengths))
    dtype = (torch.float32, torch.float16)[index % 2]
    layout = ("bhnd", "bnhd")[(index // 2) % 2]
    _backward(index, causal, *lengths, 40, dtype, (4, 2), layout)


@interpreter
@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
def test_rows_without_keys_get_zero_gradient(dq_mode: str) -> None:
    # Causal with Nq = 50 > Nk = 20: query i sees keys j <= i - 30, so rows 0..29 see nothing.
    variant = BwdVariant(16, 16, 2, 1, dq_mode)  # type: ignore[arg-type]
    _, (dq, dk, dv), _, _ = _backward(
        3, True, 50, 20, 32, torch.float32, (2, 1), "bhnd", variant=variant
    )
    assert torch.count_nonzero(dq[:, :, :30]) == 0
    assert torch.count_nonzero(dq[:, :, 30:]) > 0
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@interpreter
@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
def test_very_negative_scores_beside_padding_keys(dq_mode: str) -> None:
    # Every score is -120 (so LSE ~ -119): a padding key's score of 0 would give
    # P = exp(0 - LSE) = inf, which must never reach a stored gradient as inf * 0 = NaN.
    q = torch.ones(1, 2, 5, 24)
    k = -torch.ones(1, 1, 3, 24)
    v = torch.randn(1, 1, 3, 24, generator=torch.Generator().manual_seed(0))
    do = torch.randn(1, 2, 5, 24, generator=torch.Generator().manual_seed(1))
    problem = flashgen.Problem.from_tensors(q, k, v)
    out, lse = flashgen.attention(q, k, v, scale=5.0, return_lse=True)
    variant = BwdVariant(16, 16, 2, 1, dq_mode)  # type: ignore[arg-type]
    grads = run_backward(do, q, k, v, out, lse, variant, problem, 5.0)
    result = compare_grads(grads, q, k, v, do, scale=5.0)
    assert result.ok, result.reason


@interpreter
@pytest.mark.parametrize("index", range(len(CPU_VARIANTS)))
def test_every_sample_variant(index: int) -> None:
    # A batch of 2 and a custom scale here too: batch strides and the scale's placement.
    _backward(
        index, bool(index % 2), 70, 45, 32, torch.float32, (4, 2), "bnhd",
        variant=CPU_VARIANTS[index], batch=2, scale=0.3,
    )  # fmt: skip


@interpreter
@pytest.mark.parametrize(("causal", "nq", "nk", "heads", "layout"), [
    (False, 70, 45, (4, 2), "bnhd"), (True, 70, 45, (4, 1), "bhnd"),
    (True, 50, 20, (2, 1), "bhnd"), (False, 1, 33, (2, 2), "bnhd")])
def test_fused_delta(causal: bool, nq: int, nk: int, heads: tuple[int, int],
                     layout: str) -> None:
    """The dQ kernel works out delta for its rows and runs before dK/dV (no preprocessing
    launch): GQA, MQA, cross lengths, rows that see no key (causal, Nq > Nk), one query."""
    variant = BwdVariant(16, 32, 4, 1, fused_delta=True)
    _backward(nq + nk, causal, nq, nk, 40, torch.float32, heads, layout, variant=variant,
              batch=2, scale=0.3)


def test_fused_delta_is_two_kernels_and_only_with_a_dq_kernel() -> None:
    p = flashgen.Problem(1, 4, 2, 64, 64, 64, "fp16")
    fused = BwdVariant(32, 64, 4, 2, fused_delta=True)
    assert bwd_roles(fused) == ("dkdv", "dq")
    assert "fused-delta" in str(fused)
    assert "stride_on" in render_bwd("dq", fused, p)
    assert "stride_on" not in render_bwd("dq", BwdVariant(32, 64, 4, 2), p)
    assert bwd_kernel_hash(fused, p) != bwd_kernel_hash(BwdVariant(32, 64, 4, 2), p)
    for bad in (BwdVariant(32, 64, 4, 2, "atomic", fused_delta=True),
                BwdVariant(128, 64, 4, 2, "atomic", fa3="both", fused_delta=True)):
        assert "fused_delta runs in the dQ kernel" in (why_invalid_bwd(bad, p) or "")
    # The Gluon dQ kernel takes it too, as a Jinja branch: without it the text is as before.
    gluon = BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64)
    gluon_fused = replace(gluon, fused_delta=True)
    longer = flashgen.Problem(1, 4, 2, 1000, 1000, 64, "bf16")
    assert why_invalid_bwd(gluon_fused, longer, HOPPER) is None
    assert bwd_roles(gluon_fused) == ("dkdv", "dq")
    assert "stride_on" in render_bwd("dq", gluon_fused, longer)
    assert "stride_on" not in render_bwd("dq", gluon, longer)
    assert bwd_kernel_hash(gluon_fused, longer) != bwd_kernel_hash(gluon, longer)


@interpreter
@pytest.mark.parametrize("d", [1, 16, 112, 256])
def test_head_dim_range(d: int) -> None:
    _backward(d, d == 112, 20, 24, d, torch.float16, (2, 1), "bnhd")


@interpreter
def test_default_variant_on_the_interpreter() -> None:
    q, k, v = make_inputs(1, 2, 2, 33, 33, 64, torch.float16, seed=5)
    problem = flashgen.Problem.from_tensors(q, k, v, True)
    _backward(5, True, 33, 33, 64, torch.float16, (2, 2), "bhnd", variant=default_bwd_variant(
        problem, INTERPRETER
    ))  # fmt: skip


@interpreter
@pytest.mark.parametrize(("dtype", "slip"), [(torch.float16, 0.02), (torch.float32, 1e-4)])
def test_wrong_gradient_fails_the_check(dtype: torch.dtype, slip: float) -> None:
    """The comparison is not vacuous: a small error in any one gradient is caught."""
    result, grads, (q, k, v), do = _backward(7, True, 33, 33, 40, dtype, (4, 2), "bhnd")
    assert result.ok
    for which in range(3):
        wrong = list(grads)
        # One element off by `slip` of the gradient's scale: far above a dtype rounding.
        wrong[which] = grads[which].clone()
        wrong[which][0, 0, -1, 0] += slip * grads[which].abs().max()
        bad = compare_grads(tuple(wrong), q, k, v, do, causal=True)
        assert not bad.ok and ("dq", "dk", "dv")[which] in bad.reason
    # A plausible bug: the forgotten softmax scale in dK.
    bad = compare_grads((grads[0], grads[1] * 8.0, grads[2]), q, k, v, do, causal=True)
    assert not bad.ok
    # Wrong masking: the non-causal gradients are not the causal ones.
    assert not compare_grads(grads, q, k, v, do, causal=False).ok
    nan = grads[2].clone()
    nan[0, 0, 0, 0] = float("nan")
    assert "NaN" in compare_grads((grads[0], grads[1], nan), q, k, v, do, causal=True).reason


def test_reference_grads_match_torch_sdpa() -> None:
    """The oracle's gradients agree with PyTorch's own attention backward (float64, GQA)."""
    q, k, v = make_inputs(1, 4, 2, 9, 13, 8, torch.float64, seed=1)
    do = _upstream_grad(q, 1, "bhnd")
    ours = reference_grads(q, k, v, do, causal=False)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, enable_gqa=True)
    out.backward(do)
    for mine, theirs in zip(ours, (t.grad for t in leaves), strict=True):
        torch.testing.assert_close(mine, theirs)


# ------------------------------------------------------------------- variants and space
PROBLEMS = [
    flashgen.Problem(1, 8, 2, 77, 130, 40, "fp16", True),
    flashgen.Problem(2, 16, 16, 4096, 4096, 128, "bf16", False),
    flashgen.Problem(1, 4, 4, 1, 33, 256, "fp32", True),
    flashgen.Problem(1, 4, 1, 2048, 512, 64, "fp16", True),
]
SMALL_GPU = DeviceInfo("small-gpu", (8, 0), 108, 101376)


def test_bwd_variant_is_frozen_hashable_and_round_trips() -> None:
    v = BwdVariant(32, 64, 4, 2, "atomic")
    assert hash(v) == hash(BwdVariant.from_dict(v.to_dict()))
    assert BwdVariant.from_json(v.to_json()) == v
    with pytest.raises(AttributeError):
        v.block_streamed = 64  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown backward variant parameters"):
        BwdVariant.from_dict({**v.to_dict(), "dqmode": "atomic"})


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("device", [INTERPRETER, SMALL_GPU], ids=lambda d: d.name)
def test_space_holds_exactly_the_valid_points(
    problem: flashgen.Problem, device: DeviceInfo
) -> None:
    space = bwd_search_space(problem, device)
    assert space, "every problem has at least one valid backward variant"
    excluded = [v for v in all_bwd_points() if v not in set(space)]
    assert excluded, "the rules must exclude something on these problems"
    for v in excluded:
        assert why_invalid_bwd(v, problem, device)
    for v in space:
        assert bwd_shared_memory_bytes(v, problem) <= device.shared_memory
        assert v.block_streamed <= max(16, 1 << (problem.seq_q - 1).bit_length())
        assert v.block_owned <= max(16, 1 << (problem.seq_k - 1).bit_length())
    assert default_bwd_variant(problem, device) in space


def test_bwd_rules_name_the_reason() -> None:
    p = flashgen.Problem(1, 1, 1, 8, 300, 64, "fp16")
    assert "queries need" in why_invalid_bwd(BwdVariant(64, 16, 2, 1), p)
    # The separate dQ kernel owns block_owned queries; the atomic mode has no such kernel.
    assert "dQ kernel" in why_invalid_bwd(BwdVariant(16, 64, 4, 1), p)
    assert why_invalid_bwd(BwdVariant(16, 64, 4, 1, "atomic"), p) is None
    big = flashgen.Problem(1, 1, 1, 4096, 4096, 256, "fp16")
    assert "shared memory" in why_invalid_bwd(BwdVariant(128, 128, 8, 4), big, SMALL_GPU)
    assert "registers" in why_invalid_bwd(BwdVariant(32, 128, 4, 1), big)
    assert "warps" in why_invalid_bwd(BwdVariant(16, 16, 8, 1), big)
    assert "dq_mode" in why_invalid_bwd(BwdVariant(dq_mode="both"), big)  # type: ignore[arg-type]


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_every_bwd_variant_renders_to_valid_python(problem: flashgen.Problem) -> None:
    for v in bwd_search_space(problem, INTERPRETER):
        for kernel in BWD_KERNELS:
            source = render_bwd(kernel, v, problem)  # type: ignore[arg-type]
            tree = ast.parse(source)
            names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert f"attn_bwd_{kernel}" in names
            assert "{%" not in source and "{{" not in source
            if kernel == "dkdv":
                assert f"BLOCK_M: tl.constexpr = {v.block_streamed}" in source
                assert f"BLOCK_N: tl.constexpr = {v.block_owned}" in source
                assert f"ATOMIC_DQ: tl.constexpr = {v.dq_mode == 'atomic'}" in source
            elif kernel == "dq":  # the owned/streamed pair swaps in the dQ kernel
                assert f"BLOCK_M: tl.constexpr = {v.block_owned}" in source
                assert f"BLOCK_N: tl.constexpr = {v.block_streamed}" in source


def test_bwd_render_and_kernel_hash_ignore_lengths() -> None:
    v, p = BwdVariant(32, 64, 4, 2), PROBLEMS[0]
    for kernel in BWD_KERNELS:
        first = render_bwd(kernel, v, p)  # type: ignore[arg-type]
        same = render_bwd(kernel, v, p.with_(seq_q=999, seq_k=5, batch=7, heads_q=16))  # type: ignore[arg-type]
        assert same == first
    assert render_bwd("dq", v, p) != render_bwd("dq", v, p.with_(causal=False))
    assert bwd_kernel_hash(v, p) == bwd_kernel_hash(v, p.with_(seq_q=999, batch=7))
    from flashgen.kernels.render import _templates

    assert {f"attn_bwd_{k}.py.jinja" for k in BWD_KERNELS} <= set(_templates())


# ------------------------------------------------------------- fa3 (Gluon) backward, CPU
HOPPER = DeviceInfo("H-test", (9, 0), 132, 232448)
AMPERE = DeviceInfo("A-test", (8, 0), 108, 232448)


def _fa3_problem(d: int, dtype: str = "bf16", causal: bool = True) -> flashgen.Problem:
    return flashgen.Problem(2, 8, 2, 1000, 1000, d, dtype, causal)


def test_fa3_backward_points_exist_only_where_the_gluon_kernels_run() -> None:
    for d in (64, 128):
        space = bwd_search_space(_fa3_problem(d), HOPPER)
        assert {v.fa3 for v in space} == {"none", "dq", "both"}
        for device in (AMPERE, INTERPRETER):
            assert {v.fa3 for v in bwd_search_space(_fa3_problem(d), device)} == {"none"}
        assert bwd_portfolio(_fa3_problem(d), HOPPER)
        assert not bwd_portfolio(_fa3_problem(d), AMPERE)
    for point in (pick.variant for pick in HOPPER_BWD_PORTFOLIO):  # each serves some problem
        assert any(why_invalid_bwd(point, _fa3_problem(d, t, c), HOPPER) is None
                   for d in (64, 128, 256) for t in ("fp16", "bf16") for c in (False, True)
                   ), point
    # Head dims below a tile are padded by TMA (rows of 16-byte multiples); D100's rows are
    # 200 bytes, fp32 has no fa3 at all. Above D128 both Gluon kernels run (the wide dK/dV
    # kernel); the Triton dK/dV kernel's accumulators need 8 warps there, so no "dq".
    assert {v.fa3 for v in bwd_search_space(_fa3_problem(96), HOPPER)} == {"none", "dq", "both"}
    for d in (192, 256):
        assert {v.fa3 for v in bwd_search_space(_fa3_problem(d), HOPPER)} == {"none", "both"}
    assert "own 64 rows" in (why_invalid_bwd(BwdVariant(64, 128, 4, 2, fa3="both"),
                                             _fa3_problem(256), HOPPER) or "")
    assert "32 or 64 query rows" in (why_invalid_bwd(BwdVariant(128, 64, 4, 1, fa3="both"),
                                                     _fa3_problem(256), HOPPER) or "")
    assert "no packed layout" in (why_invalid_bwd(BwdVariant(64, 64, 4, 2, fa3="both"),
                                                  _fa3_problem(256).with_(varlen=True), HOPPER)
                                  or "")
    assert why_invalid_bwd(BwdVariant(64, 64, 4, 2, fa3="both"),
                           _fa3_problem(256).with_(window=True, softcap=True), HOPPER) is None
    for problem in (_fa3_problem(100), _fa3_problem(64, "fp32")):
        assert {v.fa3 for v in bwd_search_space(problem, HOPPER)} == {"none"}
    assert "16-byte rows" in (why_invalid_bwd(BwdVariant(64, 128, 4, 2, fa3="both"),
                                              _fa3_problem(100), HOPPER) or "")
    assert "spills" in (why_invalid_bwd(BwdVariant(128, 128, 4, 2, fa3="both"),
                                        _fa3_problem(96), HOPPER) or "")
    reasons = {
        BwdVariant(64, 128, 4, 2, "atomic", "dq"): "does not launch",
        BwdVariant(32, 128, 4, 2, "atomic", "both"): "64 query rows or more",
        BwdVariant(64, 128, 4, 2, "atomic", "both", 128): "needs fa3 'dq' or 'both'",
        BwdVariant(64, 128, 8, 2, fa3="dq"): "num_warps",
        BwdVariant(64, 32, 4, 2, fa3="both"): "block_owned",
        BwdVariant(16, 128, 4, 2, fa3="dq"): "32 rows",
        BwdVariant(128, 128, 4, 2, fa3="both"): "spills",
        BwdVariant(64, 128, 4, 2, fa3="all"): "unknown fa3",
        BwdVariant(32, 128, 4, 3, dq_block_streamed=64): "needs fa3",
        BwdVariant(64, 128, 4, 2, fa3="both", dq_block_streamed=64): "repeats block_streamed",
        BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=96): "must be among",
    }
    for variant, why in reasons.items():
        assert why in (why_invalid_bwd(variant, _fa3_problem(128), HOPPER) or ""), variant
    # The Gluon dK/dV kernel that adds dQ itself: valid, and no dQ kernel is a Gluon one.
    fused = BwdVariant(64, 128, 4, 2, "atomic", "both")
    assert why_invalid_bwd(fused, _fa3_problem(128), HOPPER) is None
    assert fused.gluon("dkdv") and not fused.gluon("dq") and not fused.deterministic
    # The Triton dK/dV kernel of the "dq" mode keeps its own register rule.
    assert why_invalid_bwd(BwdVariant(64, 128, 4, 2, fa3="dq"), _fa3_problem(128), HOPPER)


def test_fa3_backward_defaults_and_twins() -> None:
    for causal in (False, True):
        for d in (64, 128):
            assert default_bwd_variant(_fa3_problem(d, causal=causal), HOPPER) == BwdVariant(
                64, 128, 4, 2, fa3="both", smem_stats=True, lpt=causal)
    # Keys too short for a 64-key dQ tile fall back to the Triton kernels.
    short = flashgen.Problem(1, 2, 2, 40, 40, 64, "fp16", False)
    assert default_bwd_variant(short, HOPPER).fa3 == "none"
    assert default_bwd_variant(_fa3_problem(128, causal=False), HOPPER).fa3 == "both"
    assert default_bwd_variant(_fa3_problem(128), HOPPER, fa3=False).fa3 == "none"
    assert default_bwd_variant(_fa3_problem(128), AMPERE).fa3 == "none"
    # Rows stored before the knob existed load as all-Triton variants.
    assert BwdVariant.from_json('{"block_streamed": 32, "block_owned": 64}').fa3 == "none"
    for d in (64, 128):
        problem = _fa3_problem(d)
        for variant in bwd_search_space(problem, HOPPER):
            if variant.fa3 != "none":
                twin = bwd_pointer_twin(variant, problem, HOPPER)
                assert twin.fa3 == "none"
                assert why_invalid_bwd(twin, problem, HOPPER) is None
    # A twin launches the kernels its variant does (an exported package ships those only):
    # a fused_delta point's twin is fused too, whichever Triton tiles it falls back to.
    for d in (64, 96, 128, 256):
        for n in (40, 1000):
            problem = flashgen.Problem(2, 8, 2, n, n, d, "bf16", True)
            for variant in [*bwd_search_space(problem, HOPPER), *bwd_portfolio(problem, HOPPER)]:
                twin = bwd_pointer_twin(variant, problem, HOPPER)
                assert bwd_roles(twin) == bwd_roles(variant), (variant, twin)
    # Tiles no Triton kernel takes at D256 fall back to the Triton default, fused as well.
    too_big = BwdVariant(128, 128, 4, 2, fused_delta=True)
    assert bwd_pointer_twin(too_big, _fa3_problem(256), HOPPER) == BwdVariant(
        32, 64, 8, 2, fused_delta=True)
    same = BwdVariant(32, 128, 4, 3, fa3="dq")
    assert bwd_pointer_twin(same, _fa3_problem(64), HOPPER) == BwdVariant(32, 128, 4, 3)
    own_dq = BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=128)
    assert bwd_pointer_twin(own_dq, _fa3_problem(64), HOPPER) == BwdVariant(32, 128, 4, 3)


def test_the_gluon_dq_kernel_streams_its_own_tile() -> None:
    """dq_block_streamed reaches the dQ kernel's template, TMA tiles and the shared-memory rule, and
    nothing else: the Triton dK/dV kernel of the "dq" mode renders as without it."""
    problem = _fa3_problem(64)
    own, follows = (BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=m) for m in (128, 0))
    assert (own.streamed("dq"), own.streamed("dkdv")) == (128, 32)
    triton_dq = BwdVariant(32, 128, 4, 3, dq_block_streamed=64)
    # 0 follows block_streamed; a Triton dQ kernel ignores the knob
    assert (follows.streamed("dq"), triton_dq.streamed("dq")) == (32, 32)
    assert fa3_tile_rows("dq", own) == (64, 128, 128, 64, 64)
    assert fa3_tile_rows("dkdv", own) == (32, 64, 64, 32, 64, 64)
    assert "BLOCK_N: gl.constexpr = 128" in render_bwd("dq", own, problem)
    assert render_bwd("dkdv", own, problem) == render_bwd("dkdv", follows, problem)
    assert bwd_shared_memory_bytes(own, problem) > bwd_shared_memory_bytes(follows, problem)
    assert "fa3-dq dq-x128" in str(own) and "dq-x" not in str(follows)
    # The dQ kernel's keys bound its tile, as block_streamed's are bounded.
    short = flashgen.Problem(1, 2, 2, 100, 40, 64, "fp16", False)
    assert "dq_block_streamed 128 is longer" in (why_invalid_bwd(own, short, HOPPER) or "")
    assert BwdVariant.from_json('{"block_streamed": 32, "fa3": "dq"}').dq_block_streamed == 0


def test_a_renamed_knob_is_named_with_its_new_name() -> None:
    """block_m/block_n swapped meaning between the dK/dV and dQ kernels, and the forward's
    persistent meant programs per SM in fa2 but a flag in fa3; each old name now says what
    it is called."""
    for cls, old, new in ((BwdVariant, "block_m", "block_streamed"),
                          (BwdVariant, "dq_block_m", "dq_block_streamed"),
                          (flashgen.Variant, "persistent", "programs_per_sm")):
        with pytest.raises(ValueError, match=f"'{old}' is now called '{new}'"):
            cls.from_dict({old: 64})


def test_fa3_backward_renders_gluon_for_its_kernels_only() -> None:
    problem = _fa3_problem(64)
    dq_only, both = BwdVariant(32, 128, 4, 3, fa3="dq"), BwdVariant(64, 128, 4, 2, fa3="both")
    triton = BwdVariant(32, 128, 4, 3)
    assert render_bwd("dkdv", dq_only, problem) == render_bwd("dkdv", triton, problem)
    assert render_bwd("preprocess", both, problem) == render_bwd("preprocess", triton, problem)
    for kernel, variant in (("dq", dq_only), ("dq", both), ("dkdv", both)):
        source = render_bwd(kernel, variant, problem)  # type: ignore[arg-type]
        assert "gl.warp_specialize" in source and f"def attn_bwd_{kernel}(" in source
        ast.parse(source)
    # The owned tile is block_owned in both kernels: 128 keys in dK/dV, 128 query rows in dQ.
    assert "BLOCK_N: gl.constexpr = 128" in render_bwd("dkdv", both, problem)
    assert "BLOCK_M: gl.constexpr = 128" in render_bwd("dq", both, problem)
    assert "BLOCK_N: gl.constexpr = 32" in render_bwd("dq", dq_only, problem)


@pytest.mark.parametrize(
    ("kernel", "variant", "d", "dtype", "causal"),
    [("dkdv", BwdVariant(64, 128, 4, 2, fa3="both"), 128, "bf16", True),
     ("dkdv", BwdVariant(64, 128, 4, 3, fa3="both"), 64, "bf16", False),
     ("dkdv", BwdVariant(64, 64, 4, 2, fa3="both"), 128, "bf16", False),
     ("dkdv", BwdVariant(128, 128, 4, 2, fa3="both"), 64, "fp16", True),
     ("dkdv", BwdVariant(128, 128, 4, 2, fa3="both", dq_block_streamed=64), 64, "bf16", False),
     ("dq", BwdVariant(32, 128, 4, 3, fa3="dq"), 64, "bf16", True),
     ("dq", BwdVariant(64, 128, 4, 2, fa3="both"), 128, "bf16", False),
     ("dq", BwdVariant(128, 128, 4, 2, fa3="dq"), 128, "bf16", True),
     ("dq", BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=128), 64, "bf16", False),
     ("dkdv", BwdVariant(64, 128, 4, 2, "atomic", "both"), 128, "bf16", True),
     ("dkdv", BwdVariant(64, 128, 4, 2, "atomic", "both"), 64, "bf16", False),
     ("dkdv", BwdVariant(128, 128, 4, 2, "atomic", "both"), 64, "fp16", True),
     ("dkdv", BwdVariant(64, 64, 4, 2, "atomic", "both"), 128, "bf16", False),
     # Padded head dims: 128-wide tiles, TMA's zero fill.
     ("dkdv", BwdVariant(64, 128, 4, 2, fa3="both"), 96, "bf16", True),
     ("dq", BwdVariant(64, 128, 4, 2, fa3="both"), 80, "fp16", False),
     ("dkdv", BwdVariant(64, 128, 4, 2, "atomic", "both"), 112, "bf16", False),
     # delta worked out in the dQ kernel (O read beside dO's tile)
     ("dq", BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64, fused_delta=True), 64,
      "bf16", True),
     ("dq", BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True), 80, "fp16", False),
     # Above D128: the wide dK/dV kernel (two consumers split the head dim), the dQ kernel
     ("dkdv", BwdVariant(64, 64, 4, 2, fa3="both"), 256, "bf16", True),
     ("dkdv", BwdVariant(32, 64, 4, 3, fa3="both", dq_block_streamed=64), 192, "fp16", False),
     ("dq", BwdVariant(64, 64, 4, 2, fa3="both", fused_delta=True), 256, "bf16", True),
     # programs launched heaviest first (causal)
     ("dkdv", BwdVariant(64, 128, 4, 2, "atomic", "both", smem_stats=True, lpt=True), 128,
      "bf16", True),
     ("dq", BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True, lpt=True), 128, "bf16",
      True)],
)
def test_fa3_backward_compiles_for_hopper(kernel: str, variant: BwdVariant, d: int,
                                          dtype: str, causal: bool) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from flashgen.tune.gluon_compile import report_in_subprocess

    problem = _fa3_problem(d, dtype, causal)
    found = report_in_subprocess(variant, problem, kernel)
    assert found["wgmma"] and found["tma"]  # warpgroup MMA; TMA loads and the stores
    assert found["setmaxnreg"]  # the producer warp hands its registers to the consumers
    # exponentials while the second score product runs (split_d: its two halves)
    assert found["wait_partial"]
    assert found["shared"] <= HOPPER.shared_memory
    if kernel == "dkdv" and variant.block_streamed == 128 and variant.dq_mode == "separate":
        # The 128-row step issues S^T alone; with S^T and dP^T in flight together this
        # kernel spilled 428-952 bytes (sm_90a, Triton 3.6), with S^T alone 8 in fp16 and
        # 84-96 in bf16 (452-496 before bf16's P was rounded by packed conversions).
        assert spill_store_bytes(found["ptxas"]) <= 128, found["ptxas"]
    if kernel == "dkdv" and padded_head_dim(d) > 128:
        # Each consumer holds 64 x 128 of dK and dV: 84 bytes spilled on 64-query steps,
        # none on 32 (sm_90a, Triton 3.6).
        assert spill_store_bytes(found["ptxas"]) <= 96, found["ptxas"]
    if variant.fused_delta:
        # delta costs no spills and no shared memory
        # beyond its layout change (a few hundred bytes; sm_90a, Triton 3.6).
        assert spill_store_bytes(found["ptxas"]) == 0, found["ptxas"]
        plain = report_in_subprocess(replace(variant, fused_delta=False), problem, kernel)
        assert found["shared"] - plain["shared"] <= 1024
    if variant.dq_mode == "atomic":
        # dQ by TMA reduce, and no fp32 atomics from registers (which ran the backward at
        # about 0.6x). Spills (sm_90a, bf16): 320 bytes at D128 on 64-row steps (the
        # separate kernel 236), 192 at D64 on 128-row steps, none at D64 on 64-row steps.
        assert found["opcodes"].get("UTMAREDG.4D.ADD")
        assert not any(op.startswith("REDG") for op in found["opcodes"])
        bound = {(128, 64): 400, (64, 128): 256}.get((padded_head_dim(d),
                                                      variant.block_streamed), 0)
        if variant.block_owned == 64:
            bound = 96  # one consumer: 60 bytes at D128
        assert spill_store_bytes(found["ptxas"]) <= bound, found["ptxas"]


@pytest.mark.parametrize("mods", [{"window": True}, {"window": True, "softcap": True,
                                                    "sinks": True}], ids=["window", "all"])
def test_wide_fa3_dkdv_compiles_with_window_and_softcap(mods: dict[str, bool]) -> None:
    """The wide D256 dK/dV kernel with a window and softcap (packed sequences take the
    Triton kernels), compiled for sm90a: warpgroup products, tanh as one special-function op
    a score where capped, spills as the plain kernel's (92 bytes with everything)."""
    pytest.importorskip("triton.experimental.gluon")
    from flashgen.tune.gluon_compile import report_in_subprocess

    variant = BwdVariant(64, 64, 4, 2, fa3="both")
    problem = flashgen.Problem(2, 16, 8, 2048, 2048, 256, "bf16", True, **mods)
    assert why_invalid_bwd(variant, problem, HOPPER) is None
    found = report_in_subprocess(variant, problem, "dkdv")
    assert found["wgmma"] and found["tma"] and found["wait_one"]
    assert found["shared"] <= HOPPER.shared_memory
    assert spill_store_bytes(found["ptxas"]) <= 96, found["ptxas"]
    assert bool(found["opcodes"].get("MUFU.TANH")) == mods.get("softcap", False)


def test_fused_delta_gluon_dq_compiles_packed_with_modifiers() -> None:
    """The fused Gluon dQ kernel on packed sequences with window and softcap: O's rows
    counted from the sequence's first (batch stride 0), no spills."""
    pytest.importorskip("triton.experimental.gluon")
    from flashgen.tune.gluon_compile import report_in_subprocess

    variant = BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True)
    problem = flashgen.Problem(2, 8, 2, 700, 700, 128, "bf16", True, varlen=True,
                               window=True, softcap=True)
    assert why_invalid_bwd(variant, problem, HOPPER) is None
    found = report_in_subprocess(variant, problem, "dq")
    assert found["wgmma"] and found["tma"]
    assert spill_store_bytes(found["ptxas"]) == 0, found["ptxas"]


def _tensor_core_columns(report: dict) -> int:
    """The summed width of a kernel's k16 products (each instruction m64 by its n)."""
    return sum(count * int(shape.split("n")[1].split("k")[0])
               for shape, count in report["wgmma_shapes"].items())


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_fa3_backward_split_head_dim_compiles_for_hopper(kernel: str) -> None:
    """D192 on the 256 tile (split_d): the Gluon dK/dV and dQ kernels issue three quarters of
    the D256 kernels' tensor-core work (no product over the zero-filled columns), with the
    same TMA loads and stores and no more spills."""
    pytest.importorskip("triton.experimental.gluon")
    from flashgen.tune.gluon_compile import report_in_subprocess

    variant = BwdVariant(64, 64, 4, 2, fa3="both")
    split = report_in_subprocess(variant, _fa3_problem(192), kernel)
    whole = report_in_subprocess(variant, _fa3_problem(256), kernel)
    assert 4 * _tensor_core_columns(split) == 3 * _tensor_core_columns(whole), (
        split["wgmma_shapes"], whole["wgmma_shapes"])
    assert "m64n256k16" not in split["wgmma_shapes"]
    assert split["tma"] == whole["tma"]
    assert spill_store_bytes(split["ptxas"]) <= spill_store_bytes(whole["ptxas"])


@pytest.mark.parametrize(("mode", "d", "spills"), [("separate", 128, 64), ("atomic", 64, 0),
                                                   ("atomic", 128, 112), ("separate", 256, 32)])
def test_smem_stats_takes_the_row_stats_off_the_consumers(mode: str, d: int,
                                                          spills: int) -> None:
    """With smem_stats the Gluon dK/dV kernel's consumers read LSE and delta from shared
    memory (vector loads) where every thread loaded them from global memory each step (64
    loads at D64 and D128, 32 at D256): the staging warp's few global loads are all that
    remain, and spills shrink (sm_90a, bf16: D128 separate 236 -> 40 bytes, D256 84 -> 12,
    D64 atomic none either way; D128 atomic 320 -> 108 with delta read late, 272 beside LSE;
    docs/backward-kernels.md)."""
    pytest.importorskip("triton.experimental.gluon")
    from flashgen.tune.gluon_compile import report_in_subprocess

    variant = BwdVariant(64, 128 if d <= 128 else 64, 4, 2, mode, "both", smem_stats=True)
    problem = _fa3_problem(d, "bf16", True)
    assert why_invalid_bwd(variant, problem, HOPPER) is None
    found = report_in_subprocess(variant, problem, "dkdv")
    assert sum(n for op, n in found["opcodes"].items() if op.startswith("LDG")) <= 8
    assert found["opcodes"].get("LDS.64", 0) >= 16  # 64-bit loads of column pairs
    assert spill_store_bytes(found["ptxas"]) <= spills, found["ptxas"]
    assert found["shared"] <= HOPPER.shared_memory


def test_smem_stats_only_in_the_gluon_dkdv_kernel() -> None:
    """smem_stats names the Gluon dK/dV kernels' staging warp (the wide D256 one's too): a
    Triton dK/dV kernel has none, and the all-Triton twin drops it."""
    problem = _fa3_problem(128)
    for good, p in ((BwdVariant(64, 128, 4, 2, fa3="both", smem_stats=True), problem),
                    (BwdVariant(64, 64, 4, 2, fa3="both", smem_stats=True), _fa3_problem(256))):
        assert why_invalid_bwd(good, p, HOPPER) is None, good
    for bad in (BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64, smem_stats=True),
                BwdVariant(32, 128, 4, 3, smem_stats=True)):
        assert "smem_stats" in (why_invalid_bwd(bad, problem, HOPPER) or ""), bad
    twin = bwd_pointer_twin(BwdVariant(64, 128, 4, 2, fa3="both", smem_stats=True), problem,
                            HOPPER)
    assert twin.fa3 == "none" and not twin.smem_stats and twin.block_streamed == 64


def test_lpt_only_where_causal_programs_differ_in_work() -> None:
    """lpt reorders the Gluon kernels' programs under the causal mask: a point elsewhere
    (no mask, packed sequences, a window, Triton kernels only) would repeat its twin; the
    untuned causal default takes it; a kernel without it renders as before the knob."""
    causal, full = _fa3_problem(128), _fa3_problem(128, causal=False)
    good = BwdVariant(64, 128, 4, 2, fa3="both", smem_stats=True, lpt=True)
    assert why_invalid_bwd(good, causal, HOPPER) is None
    assert why_invalid_bwd(BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64,
                                      lpt=True), _fa3_problem(64), HOPPER) is None
    for bad, problem in ((good, full), (good, causal.with_(varlen=True)),
                         (good, causal.with_(window=True)),
                         (BwdVariant(64, 128, 8, 2, lpt=True), causal)):
        assert "lpt" in (why_invalid_bwd(bad, problem, HOPPER) or ""), (bad, problem)
    assert default_bwd_variant(causal, HOPPER) == good
    assert default_bwd_variant(full, HOPPER) == replace(good, lpt=False)
    assert str(good).endswith(" smem-stats lpt")
    for kernel in ("dkdv", "dq"):
        plain = render_bwd(kernel, replace(good, lpt=False), causal)
        ordered = render_bwd(kernel, good, causal)
        assert "gl.program_id(0)" in plain and "LPT_ROWS" not in plain
        assert "LPT_ROWS" in ordered and ordered != plain
    # The wide D256 dK/dV kernel keeps grid order; its dQ kernel takes the order.
    wide = BwdVariant(64, 64, 4, 2, fa3="both", fused_delta=True, lpt=True)
    d256 = _fa3_problem(256)
    assert why_invalid_bwd(wide, d256, HOPPER) is None
    assert render_bwd("dkdv", wide, d256) == render_bwd("dkdv", replace(wide, lpt=False), d256)
    assert "LPT_ROWS" in render_bwd("dq", wide, d256)


@interpreter
def test_fa3_variant_on_unaligned_inputs_runs_its_pointer_twin() -> None:
    """TMA cannot address rows that are not 16-byte aligned: the Triton twin runs instead,
    and computes the same gradients (on the interpreter, which has no Gluon)."""
    q, k, v = make_inputs(1, 2, 1, 40, 40, 64, torch.float32, seed=5)
    _check_unaligned(q, k, v, 5, BwdVariant(16, 64, 4, 1, fa3="dq"))


def _check_unaligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: int,
                     variant: BwdVariant) -> None:
    """`variant`'s causal backward on copies of q, k, v that start one element past a
    16-byte boundary (TMA cannot address them), against the reference."""

    def unaligned(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(
            t.shape).copy_(t)

    q, k, v = (unaligned(t) for t in (q, k, v))
    do = _upstream_grad(q, seed, "bhnd")
    problem = flashgen.Problem.from_tensors(q, k, v, True)
    out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
    grads = run_backward(do, q, k, v, out, lse, variant, problem)
    assert compare_grads(grads, q, k, v, do, True).ok


# ---------------------------------------------------------------------------------- GPU
GPU_SHAPES = [(128, 64), (1000, 64), (2048, 64), (1000, 128), (2048, 128)]


def _problem_for(
    n: int, d: int, dtype: torch.dtype, causal: bool, heads: tuple[int, int]
) -> flashgen.Problem:
    return flashgen.Problem(1, *heads, n, n, d, DTYPE_NAMES[dtype], causal)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "d"), GPU_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_default_variant(dtype: torch.dtype, n: int, d: int, causal: bool) -> None:
    heads = (8, 2) if n <= 1000 else (4, 4)
    variant = default_bwd_variant(_problem_for(n, d, dtype, causal, heads), "cuda")
    _backward(n + d, causal, n, n, d, dtype, heads, "bnhd", "cuda", variant)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_atomic_dq(dtype: torch.dtype, causal: bool) -> None:
    variant = BwdVariant(32, 128, 4, 2, "atomic")
    _backward(1, causal, 1500, 1500, 64, dtype, (8, 2), "bhnd", "cuda", variant, batch=2)


@gpu
@pytest.mark.parametrize("d", [40, 80, 96, 112, 160, 192, 224, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_odd_head_dims_and_cross(d: int, dtype: torch.dtype) -> None:
    problem = flashgen.Problem(1, 8, 2, 333, 517, d, DTYPE_NAMES[dtype], True)
    variant = default_bwd_variant(problem, "cuda")
    _backward(d, True, 333, 517, d, dtype, (8, 2), "bnhd", "cuda", variant)
    _backward(d, True, 517, 333, d, dtype, (8, 2), "bnhd", "cuda", variant)


@gpu
def test_gpu_search_space_sample() -> None:
    """A spread of the real backward space compiles and matches on the GPU."""
    problem = flashgen.Problem(2, 4, 2, 777, 777, 64, "bf16", True)
    space = bwd_search_space(problem, "cuda")
    for variant in space[:: max(1, len(space) // 12)]:
        _backward(11, True, 777, 777, 64, torch.bfloat16, (4, 2), "bhnd", "cuda", variant, 2)


FA3_BWD_POINTS = [*(pick.variant for pick in HOPPER_BWD_PORTFOLIO),
                  BwdVariant(32, 64, 4, 2, fa3="both"),
                  BwdVariant(128, 64, 4, 3, fa3="dq"), BwdVariant(32, 128, 4, 4, fa3="dq"),
                  BwdVariant(64, 128, 4, 2, fa3="both", dq_block_streamed=128),
                  # delta worked out in the Gluon dQ kernel, which runs first
                  BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64, fused_delta=True),
                  BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True),
                  # LSE and delta staged in shared memory by a warp of their own
                  BwdVariant(64, 128, 4, 2, fa3="both", smem_stats=True),
                  BwdVariant(64, 128, 4, 2, "atomic", "both", smem_stats=True),
                  BwdVariant(128, 128, 4, 2, "atomic", "both", smem_stats=True),
                  BwdVariant(64, 64, 4, 2, fa3="both", fused_delta=True, smem_stats=True)]


@gpu
@pytest.mark.parametrize("variant", FA3_BWD_POINTS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fa3_backward(variant: BwdVariant, causal: bool) -> None:
    """The Gluon kernels against the float64 reference: ragged and cross lengths (N_Q above
    and below N_K), GQA, both memory layouts, both 16-bit dtypes, D64, D128 and D256 (and
    head dims padded up to them)."""
    from flashgen.kernels.hardware import device_info

    if not device_info("cuda").is_hopper:
        pytest.skip("the fa3 backward kernels are Gluon kernels for Hopper")
    if variant.lpt and not causal:
        pytest.skip("lpt orders the programs of causal problems only")
    ran = 0
    for i, (d, dtype, nq, nk, layout) in enumerate([
        (64, torch.float16, 333, 517, "bnhd"), (64, torch.bfloat16, 517, 333, "bhnd"),
        (128, torch.bfloat16, 333, 517, "bhnd"), (128, torch.float16, 1000, 1000, "bnhd"),
        (96, torch.bfloat16, 517, 333, "bnhd"), (40, torch.float16, 333, 517, "bhnd"),
        (256, torch.bfloat16, 333, 517, "bhnd"), (256, torch.float16, 517, 333, "bnhd"),
        (192, torch.bfloat16, 1000, 1000, "bhnd"),
    ]):
        problem = flashgen.Problem(2, 8, 2, nq, nk, d, DTYPE_NAMES[dtype], causal)
        if why_invalid_bwd(variant, problem, "cuda") is None:
            _backward(i, causal, nq, nk, d, dtype, (8, 2), layout, "cuda", variant, batch=2)
            ran += 1
    assert ran, f"{variant} fits none of the shapes"


@gpu
@pytest.mark.parametrize("variant", [
    BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True, smem_stats=True, lpt=True),
    BwdVariant(64, 128, 4, 2, "atomic", "both", smem_stats=True, lpt=True)], ids=str)
def test_gpu_lpt_backward_runs_every_program(variant: BwdVariant) -> None:
    """Heads in groups whose last one is partial, lengths off the tile: against the
    reference at N 2100 (dK/dV: 8 key/value heads at GQA 2 in groups of 7, dQ: 16 query
    heads in groups of 15), and at N 8200 (5 heads in groups of 3 and 2; a float64 reference
    there would take tens of GB beside the suite's other workers) the gradients that do not
    depend on the order of fp32 atomics are bitwise those of grid order."""
    from flashgen.kernels.hardware import device_info

    if not device_info("cuda").is_hopper:
        pytest.skip("the fa3 backward kernels are Gluon kernels for Hopper")
    exact = (0, 1, 2) if variant.dq_mode == "separate" else (1, 2)  # dq, dk, dv
    for i, (n, heads, d) in enumerate([(2100, (16, 8), 128), (8200, (5, 5), 64)]):
        if i == 0:
            _, grads, (q, k, v), do = _backward(i, True, n, n, d, torch.bfloat16, heads,
                                                "bhnd", "cuda", variant)
        else:
            q, k, v = make_inputs(1, *heads, n, n, d, torch.bfloat16, "cuda", seed=i,
                                  layout="bhnd")
            do = _upstream_grad(q, i, "bhnd")
        problem = flashgen.Problem.from_tensors(q, k, v, True)
        out, lse = flashgen.attention(q, k, v, causal=True, return_lse=True)
        if i:
            grads = run_backward(do, q, k, v, out, lse, variant, problem, None)
        plain = run_backward(do, q, k, v, out, lse, replace(variant, lpt=False), problem, None)
        for j in exact:
            assert torch.equal(grads[j], plain[j]), (n, ("dq", "dk", "dv")[j])


@gpu
def test_gpu_fa3_backward_unaligned_inputs() -> None:
    from flashgen.kernels.hardware import device_info

    if not device_info("cuda").is_hopper:
        pytest.skip("the fa3 backward kernels are Gluon kernels for Hopper")
    q, k, v = make_inputs(2, 8, 2, 700, 700, 128, torch.bfloat16, "cuda", seed=9)
    _check_unaligned(q, k, v, 9, BwdVariant(64, 128, 4, 2, fa3="both"))
