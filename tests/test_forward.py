"""Every loop order and a sample of tile shapes against the float64 reference on odd shapes.

CPU tests run through the Triton interpreter (tiny shapes; bf16 is excluded there because the
3.6 interpreter computes bf16 dots wrongly). `gpu` tests run real kernels on bigger shapes.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

import flashgen
from flashgen.kernels.hardware import INTERPRETER
from flashgen.tune.check import compare, make_inputs

interpreter = pytest.mark.interpreter
gpu = pytest.mark.gpu

# Small tiles keep many programs and loop trips in play even on tiny shapes.
CPU_VARIANTS = {
    "fa2": [
        flashgen.Variant("fa2", 16, 16, 2, 1),
        flashgen.Variant("fa2", 32, 16, 4, 2),
        flashgen.Variant("fa2", 16, 32, 2, 3),
        flashgen.Variant("fa2", 64, 32, 4, 2),
        flashgen.Variant("fa2", 16, 32, 2, 2, split_mask=False),
        flashgen.Variant("fa2", 32, 16, 4, 3, warp_specialize=True),
        flashgen.Variant("fa2", 16, 32, 2, 2, use_tma=True),
        flashgen.Variant("fa2", 32, 16, 4, 2, split_mask=False, use_tma=True),
        flashgen.Variant("fa2", 16, 16, 2, 2, programs_per_sm=1),
        flashgen.Variant("fa2", 16, 32, 2, 1, use_tma=True, programs_per_sm=2),
    ],
    "fa1": [
        flashgen.Variant("fa1", 16, 16, 2, 1),
        flashgen.Variant("fa1", 32, 16, 4, 2),
        flashgen.Variant("fa1", 16, 32, 2, 1),
        flashgen.Variant("fa1", 64, 32, 4, 2),
    ],
}


def _fitting(order: str, index: int, problem: flashgen.Problem) -> flashgen.Variant:
    """The index-th sample variant of this loop order that is valid for the problem."""
    candidates = CPU_VARIANTS[order]
    for shift in range(len(candidates)):
        v = candidates[(index + shift) % len(candidates)]
        if flashgen.why_invalid(v, problem, INTERPRETER) is None:
            return v
    raise AssertionError("the 16x16 sample fits every problem")


def _run_and_check(
    order: str,
    index: int,
    causal: bool,
    nq: int,
    nk: int,
    d: int,
    dtype: torch.dtype,
    heads: tuple[int, int],
    layout: str,
    device: str = "cpu",
    variant: flashgen.Variant | None = None,
) -> None:
    hq, hkv = heads
    q, k, v = make_inputs(1, hq, hkv, nq, nk, d, dtype, device, seed=index, layout=layout)
    problem = flashgen.Problem.from_tensors(q, k, v, causal)
    variant = variant or _fitting(order, index, problem)
    out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True, variant=variant)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == q.stride()
    result = compare(out, q, k, v, causal, lse=lse)
    assert result.ok, f"{variant} on {problem} ({layout}): {result.reason}"


# Main grid: loop order x causal x odd lengths x odd head dims. dtype, GQA and layout rotate
# with the case index so every combination appears without multiplying the grid.
GRID = list(itertools.product(("fa2", "fa1"), (False, True), (1, 33, 77, 130), (40, 64, 80)))


@interpreter
@pytest.mark.parametrize(("order", "causal", "n", "d"), GRID)
def test_self_attention_grid(order: str, causal: bool, n: int, d: int) -> None:
    index = GRID.index((order, causal, n, d))
    dtype = (torch.float32, torch.float16)[index % 2]
    heads = ((2, 2), (4, 2), (3, 1))[index % 3]
    layout = ("bhnd", "bnhd")[(index // 2) % 2]
    _run_and_check(order, index, causal, n, n, d, dtype, heads, layout)


CROSS = list(
    itertools.product(("fa2", "fa1"), (False, True), ((33, 77), (77, 33), (1, 130), (130, 1)))
)


@interpreter
@pytest.mark.parametrize(("order", "causal", "lengths"), CROSS)
def test_cross_attention(order: str, causal: bool, lengths: tuple[int, int]) -> None:
    # Nq != Nk: with causal the diagonal is aligned bottom-right; Nq > Nk leaves early
    # queries with no visible key, which must give 0 output and -inf LSE.
    index = CROSS.index((order, causal, lengths))
    dtype = (torch.float32, torch.float16)[index % 2]
    _run_and_check(order, index, causal, *lengths, 40, dtype, (4, 2), "bhnd")


@interpreter
@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_dtype_gqa_layout(
    order: str, dtype: torch.dtype, heads: tuple[int, int], layout: str
) -> None:
    _run_and_check(order, 1, True, 45, 45, 48, dtype, heads, layout)


@interpreter
@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_every_sample_variant(order: str) -> None:
    for index, variant in enumerate(CPU_VARIANTS[order]):
        _run_and_check(
            order,
            index,
            bool(index % 2),
            70,
            70,
            32,
            torch.float32,
            (2, 1),
            "bhnd",
            variant=variant,
        )


@interpreter
@pytest.mark.parametrize("d", [16, 24, 112, 256])
def test_head_dim_range(d: int) -> None:
    _run_and_check("fa2", 0, False, 20, 20, d, torch.float32, (1, 1), "bhnd")


@interpreter
def test_custom_scale_and_lse() -> None:
    q, k, v = make_inputs(2, 2, 2, 40, 40, 32, torch.float32, seed=3)
    out, lse = flashgen.attention(q, k, v, scale=0.3, return_lse=True)
    assert compare(out, q, k, v, scale=0.3, lse=lse).ok
    # The default scale is 1/sqrt(D); 0.3 must make a different result.
    assert not torch.allclose(out, flashgen.attention(q, k, v))


@interpreter
def test_default_variant_runs_without_lse() -> None:
    q, k, v = make_inputs(1, 2, 2, 33, 33, 64, torch.float16, seed=5)
    out = flashgen.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    assert compare(out, q, k, v, causal=True).ok


# ---------------------------------------------------------------------------------- GPU
GPU_SHAPES = [(128, 64), (1000, 64), (4096, 64), (1000, 128), (4096, 128)]


@gpu
@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "d"), GPU_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_matches_reference(
    order: str, dtype: torch.dtype, n: int, d: int, causal: bool
) -> None:
    heads = (4, 2) if n < 4096 else (2, 2)
    q, k, v = make_inputs(1, *heads, n, n, d, dtype, "cuda", seed=n + d)
    problem = flashgen.Problem.from_tensors(q, k, v, causal)
    variant = flashgen.default_variant(problem, q.device)
    if order == "fa1":
        variant = flashgen.Variant("fa1", 64, 64, 4, 2)
    out, lse = flashgen.attention(q, k, v, causal=causal, return_lse=True, variant=variant)
    result = compare(out, q, k, v, causal, lse=lse)
    assert result.ok, f"{variant} on {problem}: {result.reason}"


@gpu
@pytest.mark.parametrize("d", [40, 80, 96, 112, 160, 192, 224, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_odd_head_dims(d: int, dtype: torch.dtype) -> None:
    _run_and_check(
        "fa2",
        d,
        True,
        333,
        517,
        d,
        dtype,
        (8, 2),
        "bnhd",
        device="cuda",
        variant=flashgen.default_variant(
            flashgen.Problem(
                1,
                8,
                2,
                333,
                517,
                d,
                {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype],
                True,
            ),
            "cuda",
        ),
    )


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize(
    "variant",
    [
        flashgen.Variant("fa2", 128, 64, 8, 3, use_tma=True),
        flashgen.Variant("fa2", 128, 64, 8, 3, warp_specialize=True, use_tma=True),
        flashgen.Variant("fa2", 64, 128, 4, 2, split_mask=False, use_tma=True),
        flashgen.Variant("fa2", 128, 64, 8, 3, programs_per_sm=1),
        flashgen.Variant("fa2", 128, 128, 8, 2, warp_specialize=True, use_tma=True,
                         programs_per_sm=2),
    ],
    ids=str,
)
def test_gpu_tma(variant: flashgen.Variant, layout: str, causal: bool) -> None:
    q, k, v = make_inputs(2, 8, 2, 1000, 1100, 128, torch.bfloat16, "cuda", seed=7,
                          layout=layout)
    # Every variant here is a valid point of the search space (`why_invalid` is None on
    # Hopper), so dispatch may serve it: a crash fails the test, as a wrong result does.
    out = flashgen.attention(q, k, v, causal=causal, variant=variant)
    result = compare(out, q, k, v, causal)
    assert result.ok, f"{variant}: {result.reason}"


@gpu
@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_gpu_search_space_sample(order: str) -> None:
    """A spread of the real search space compiles and matches on the GPU."""
    problem = flashgen.Problem(2, 4, 2, 777, 777, 64, "bf16", True)
    space = [v for v in flashgen.search_space(problem, "cuda") if v.loop_order == order]
    sample = space[:: max(1, len(space) // 8)]
    q, k, v = make_inputs(2, 4, 2, 777, 777, 64, torch.bfloat16, "cuda", seed=11)
    for variant in sample:
        out = flashgen.attention(q, k, v, causal=True, variant=variant)
        result = compare(out, q, k, v, causal=True)
        assert result.ok, f"{variant}: {result.reason}"


@interpreter
def test_persistent_grid_caps_programs() -> None:
    from flashgen.runtime.forward import fa2_grid

    cpu = torch.device("cpu")  # the interpreter counts as one SM
    plain = flashgen.Variant("fa2", 16, 16, 2, 1)
    assert fa2_grid(plain, 100, 6, cpu) == (7, 6)
    assert fa2_grid(replace(plain, programs_per_sm=1), 100, 6, cpu) == (1, 6)
    # Every program walks its head's tiles; the result is the same as one program per tile.
    q, k, v = make_inputs(1, 3, 1, 70, 90, 32, torch.float32, seed=5)
    for causal in (False, True):
        want = flashgen.attention(q, k, v, causal=causal, variant=plain)
        got = flashgen.attention(q, k, v, causal=causal, variant=replace(plain, programs_per_sm=2))
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@interpreter
def test_tma_needs_aligned_rows() -> None:
    # D = 44 in fp16 is 88-byte rows: not a multiple of 16, so the rule excludes TMA.
    p = flashgen.Problem(1, 2, 2, 32, 32, 44, "fp16")
    assert "16-byte rows" in flashgen.why_invalid(flashgen.Variant("fa2", 16, 16, 2, 1,
                                                                    use_tma=True), p, INTERPRETER)
    # Aligned head dim, but a sliced (offset) view breaks the base alignment: an explicit
    # TMA variant refuses, dispatch would run its pointer twin.
    q, k, v = make_inputs(1, 2, 2, 33, 33, 40, torch.float16)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)
    tma = flashgen.Variant("fa2", 16, 16, 2, 1, use_tma=True)
    with pytest.raises(ValueError, match="uses TMA"):
        flashgen.attention(shifted, k, v, variant=tma)
    from flashgen.serve import prepare_forward

    problem = flashgen.Problem.from_tensors(q, k, v)
    out, _ = prepare_forward(tma, problem, strict=False)(shifted, k, v, 40**-0.5)
    assert compare(out, q, k, v).ok


#: Compiles fa2 variants (JSON lines on stdin) for sm90 with Triton's own compiler, no GPU and
#: no interpreter, printing "ok" or "crash" for each.
_SM90_COMPILE = """
import importlib.util, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
import flashgen
from flashgen.export.aot import arg_names, signature
from flashgen.kernels.render import render
problem = flashgen.Problem.from_dict(__import__("json").loads(sys.argv[1]))
for line in sys.stdin:
    v = flashgen.Variant.from_json(line)
    src = render(v, problem)
    path = Path(tempfile.mkdtemp()) / "k.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("k", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module.attn_fwd
    sig, consts, divisible = signature(arg_names(src), problem.dtype, problem.head_dim)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options(
        {"num_warps": v.num_warps, "num_stages": v.num_stages})
    try:
        triton.compile(triton.compiler.ASTSource(fn, sig, consts, attrs), target=target,
                       options=options.__dict__)
        print("ok", flush=True)
    except Exception:
        print("crash", flush=True)
"""


def test_the_warp_specialize_rule_matches_what_triton_crashes_on() -> None:
    """The rule `warp_specialize_crashes_with_4_warps` excludes exactly the points Triton's
    warp-specialization pass crashes on, among neighbours that differ in one knob (compiled
    for sm90 on the CPU). If a Triton release fixes the pass, this fails: drop the rule."""
    import json
    import os
    import subprocess
    import sys

    from flashgen.kernels.fwd_space import warp_specialize_crashes_with_4_warps
    from flashgen.kernels.hardware import DeviceInfo

    pytest.importorskip("triton.backends.nvidia")
    problem = flashgen.Problem(2, 4, 2, 777, 777, 64, "bf16", True)
    crashing = flashgen.Variant("fa2", 64, 64, 4, 2, warp_specialize=True)
    points = [crashing, replace(crashing, num_warps=8), replace(crashing, block_m=32),
              replace(crashing, split_mask=False), replace(crashing, block_m=128, num_stages=3)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE, json.dumps(problem.to_dict())],
                         input="\n".join(v.to_json() for v in points), env=env,
                         capture_output=True, text=True, timeout=300)
    outcomes = [line for line in run.stdout.split() if line in ("ok", "crash")]
    hopper = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)
    ruled = ["crash" if warp_specialize_crashes_with_4_warps(v, problem, hopper) else "ok"
             for v in points]
    assert outcomes == ruled, (json.dumps([str(v) for v in points]), run.stderr[-2000:])
    assert ruled == ["crash", "ok", "ok", "ok", "crash"]


def test_descriptors_skip_only_checks_that_tma_ready_has_made() -> None:
    """The per-call descriptors are built without their constructors' checks (~8 us of host
    time each on the GPU machine), and equal the checked ones field for field."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashgen.runtime.forward import descriptor, tma_ready

    t = torch.empty(2, 4, 256, 64, dtype=torch.float16)
    assert tma_ready(t)
    checked = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 64, 64])
    assert descriptor(t, 64, 64) == checked
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as Gluon

    from flashgen.runtime.forward import _gluon_tile_layout, gluon_descriptor

    layout = _gluon_tile_layout(64, 64, t.dtype)
    assert gluon_descriptor(t, 64) == Gluon(t, list(t.shape), list(t.stride()),
                                             [1, 1, 64, 64], layout)
    with pytest.raises(AssertionError):  # an empty tensor still meets the checks
        descriptor(torch.empty(0, 4, 256, 64, dtype=torch.float16), 64, 64)


def test_cached_descriptor_layouts_never_carry_another_tensor() -> None:
    """A descriptor's fields but its base are cached by shape, strides, tile and dtype: each
    call still makes a new descriptor over its own tensor, and a tensor of another shape,
    strides or dtype gets its own fields, equal to what the checked constructor makes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashgen.runtime.forward import descriptor

    a = torch.empty(2, 4, 256, 64, dtype=torch.float16)
    b = torch.empty_like(a)  # same layout, another address
    transposed = torch.empty(2, 256, 4, 64, dtype=torch.float16).transpose(1, 2)
    longer = torch.empty(2, 4, 320, 64, dtype=torch.float16)
    made = [descriptor(t, 64, 64) for t in (a, b, transposed, longer, a)]
    assert len({id(d) for d in made}) == len(made)
    for t, d in zip((a, b, transposed, longer, a), made, strict=True):
        assert d.base is t
        assert d == TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 64, 64])
    assert made[0].strides != made[2].strides and made[0].shape != made[3].shape
    assert descriptor(a, 32, 64).block_shape == [1, 1, 32, 64]
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as Gluon

    from flashgen.runtime.forward import _gluon_tile_layout, gluon_descriptor

    wide = torch.empty(2, 4, 256, 64, dtype=torch.float32)
    for t in (a, b, transposed, wide, a):
        d = gluon_descriptor(t, 64)
        assert d.base is t
        assert d == Gluon(t, list(t.shape), list(t.stride()), [1, 1, 64, 64],
                          _gluon_tile_layout(64, 64, t.dtype))
    assert gluon_descriptor(wide, 64).layout != gluon_descriptor(a, 64).layout


def test_tma_ready_reads_every_address_and_the_strides_by_element_size() -> None:
    """`tma_ready` caches its stride rule by (strides, element size), never the address."""
    from flashgen.runtime.forward import tma_ready

    half = torch.empty(4, 8, dtype=torch.float16)  # rows of 16 bytes
    byte = torch.empty(4, 8, dtype=torch.uint8)  # the same strides, rows of 8 bytes
    for _ in range(2):  # cached or not, the same answers
        assert tma_ready(half) and not tma_ready(byte)
        assert not tma_ready(half.view(-1)[1:].view(-1)[:24].view(3, 8))  # 2 bytes off
        assert tma_ready(half.view(-1)[8:].view(3, 8))  # 16 bytes on
        assert not tma_ready(half.t())  # no unit last stride
        assert not tma_ready(half, byte) and not tma_ready(byte, half)
