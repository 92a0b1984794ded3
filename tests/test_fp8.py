"""FP8 inputs (issue 32): the quantization (random Hadamard rotation, block scales), its
measured accuracy on FlashAttention 3's outlier inputs, the fp8 error bound of the tuner's
gate, the named errors of `flashgen.attention` for fp8 inputs, and the fa2 fp8 forward
checked against that gate: on the CPU through Triton's interpreter (which computes e4m3
products exactly; flashgen fixes its rounding to e4m3 for fp8 calls, `runtime.interpreter`),
and on a GPU."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

import flashgen
from flashgen.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    QUANT_BLOCK,
    Quantized,
    dequantize,
    hadamard,
    padded_dim,
    quantize,
    rotate,
    unrotate,
)
from flashgen.runtime.inputs import check_fp8_device
from flashgen.tune import reference
from flashgen.tune.check import ERROR_FACTOR, compare_fp8, fp8_bound
from flashgen.tune.emulation import SCHEMES, emulate_fp8_attention, outlier_inputs, scheme_error


def sylvester(d: int) -> torch.Tensor:
    """The d x d Hadamard matrix built by its definition, H_2n = [[H, H], [H, -H]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("d", [1, 2, 16, 128])
def test_hadamard_is_the_normalised_sylvester_matrix(d: int) -> None:
    x = torch.randn(3, 5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(hadamard(x), x @ sylvester(d) / math.sqrt(d))


def test_rotation_keeps_q_kt_and_inverts() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 3, 40, 64, dtype=torch.float64, generator=gen) for _ in range(2))
    rq, rk = rotate(q, seed=7), rotate(k, seed=7)
    assert (rq - q).abs().max() > 0.1  # it does move them
    torch.testing.assert_close(rq @ rk.transpose(-1, -2), q @ k.transpose(-1, -2))
    torch.testing.assert_close(unrotate(rq, seed=7), q)
    # Another seed is another rotation, and a mismatched pair breaks Q K^T.
    assert (rotate(k, seed=8) - rk).abs().max() > 0.1


def test_hadamard_refuses_a_dim_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(torch.zeros(2, 96))


@pytest.mark.parametrize("block", [QUANT_BLOCK, 32, None])
def test_quantize_shapes_dtypes_and_rounding(block: int | None) -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 300, 64, generator=gen)
    k, v = (torch.randn(2, 2, 200, 64, generator=gen) * 5 for _ in range(2))  # GQA
    if block in (QUANT_BLOCK, None):
        qz = quantize(q, k, v, block=block, incoherent=False)
    else:  # not attention's block: for dequantize and accuracy studies only, said so
        with pytest.warns(UserWarning, match=f"one descale per {QUANT_BLOCK} rows"):
            qz = quantize(q, k, v, block=block, incoherent=False)
    for x, t, d in ((q, qz.q, qz.descale_q), (k, qz.k, qz.descale_k), (v, qz.v, qz.descale_v)):
        assert t.dtype == FP8_DTYPE and t.shape == x.shape and d.dtype == torch.float32
        want = () if block is None else (x.shape[0], x.shape[1], -(-x.shape[2] // block))
        assert tuple(d.shape) == want
        back = dequantize(t, d, block)
        scale = d if block is None else d.repeat_interleave(block, -1)[..., : x.shape[2], None]
        # Each block's largest value lands on FP8_MAX, and every value is off by at most half
        # an e4m3 step: 2^-4 relative (3 mantissa bits), or 2^-10 of the scale (subnormals).
        if block is None:
            assert (x / scale).abs().max().item() == pytest.approx(FP8_MAX, rel=1e-6)
        else:  # block by block: a per-tensor scale would leave most blocks below it
            rows = -(-x.shape[2] // block) * block
            padded = torch.nn.functional.pad((x / scale).abs(), (0, 0, 0, rows - x.shape[2]))
            peaks = padded.reshape(*x.shape[:2], rows // block, -1).amax(-1)
            torch.testing.assert_close(peaks, torch.full_like(peaks, FP8_MAX), rtol=1e-6,
                                       atol=0)
        assert ((back - x).abs() <= torch.maximum(x.abs() / 16, scale / 1024) * 1.0001).all()


def test_a_padded_head_dim_comes_back_padded_and_gives_the_same_attention() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 48, generator=gen) for _ in range(3))
    qz = quantize(q, k, v)
    assert padded_dim(48) == 64 and qz.q.shape[-1] == qz.k.shape[-1] == qz.v.shape[-1] == 64
    out = emulate_fp8_attention(qz, scale=48 ** -0.5, p_fp8=False)
    truth = reference.attention(q, k, v, dtype=torch.float64)[0]
    assert (out[..., 48:] == 0).all()
    assert (out[..., :48] - truth).abs().max() < 0.1  # fp8 inputs: a few e4m3 steps


def test_quantize_names_bad_input() -> None:
    x = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="block"):
        quantize(x, x, x, block=0)
    with pytest.raises(TypeError, match="float16, bfloat16"):
        quantize(x.to(FP8_DTYPE), x, x)
    with pytest.raises(ValueError, match="4-D"):
        quantize(x[0], x, x)
    k = torch.randn(1, 1, 6, 16)
    with pytest.raises(ValueError, match="same shape"):
        quantize(x, x, k)
    with pytest.raises(ValueError, match="batch sizes differ"):
        quantize(torch.randn(2, 1, 8, 16), x, x)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        quantize(torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    with pytest.raises(ValueError, match="head dim"):
        quantize(x[..., :0], x[..., :0], x[..., :0])
    with pytest.raises(TypeError, match="seed must be an int"):
        quantize(x, x, x, seed="a")  # type: ignore[arg-type]


def test_block_and_incoherent_fp8_has_much_lower_error_than_per_tensor() -> None:
    """The accuracy claim of docs/fp8.md on one seeded draw of FA3's outlier inputs, at a
    length where it holds (the gain grows with N: 1.4x at 256 keys, 1.8x at 1024, 2.4x at
    4096 in benchmarks/fp8_accuracy.py)."""
    q, k, v = outlier_inputs(1, 1, 2048, 128, seed=0)
    per_tensor, block, both = (scheme_error(q, k, v, s) for s in SCHEMES)
    assert per_tensor / both >= 1.5, (per_tensor, block, both)
    assert both < block < per_tensor


def test_the_fp8_bound_passes_an_honest_kernel_and_fails_wrong_ones() -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 200, 64, generator=gen)
    k, v = (torch.randn(1, 2, 200, 64, generator=gen) for _ in range(2))
    qz = quantize(q, k, v)
    # Honest: fp32 products on the dequantized inputs (P not even rounded), output in bf16.
    honest = emulate_fp8_attention(qz, True, p_fp8=False).to(torch.bfloat16)
    result = compare_fp8(honest, qz, causal=True)
    assert result.ok, result.reason
    assert result.bound == pytest.approx(fp8_bound(qz, torch.bfloat16, causal=True))
    # Wrong: the causal mask forgotten; V's descales ignored (a kernel that never scales V).
    assert not compare_fp8(emulate_fp8_attention(qz, False).bfloat16(), qz, causal=True).ok
    unscaled = qz._replace(descale_v=torch.ones_like(qz.descale_v))
    assert not compare_fp8(emulate_fp8_attention(unscaled, True).bfloat16(), qz, True).ok
    assert not compare_fp8(torch.full_like(honest, float("nan")), qz, True).ok
    # The fp8 bound is loose (P in fp8 costs a few percent): a kernel reading block 0's
    # descale for every block passes when the blocks' ranges are alike, so gate inputs need
    # blocks of different magnitudes, as real activations have. Then it fails.
    q[..., QUANT_BLOCK:, :] *= 8
    qz = quantize(q, k, v)
    first = qz._replace(descale_q=qz.descale_q[..., :1].expand_as(qz.descale_q).contiguous())
    assert not compare_fp8(emulate_fp8_attention(first, True).bfloat16(), qz, True).ok
    assert compare_fp8(emulate_fp8_attention(qz, True).bfloat16(), qz, True).ok


# --- flashgen.attention's named errors for fp8 inputs ---------------------------------------

def fp8_inputs(hq: int = 4, hkv: int = 2, n: int = 200) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, hq, n, 64, generator=gen)
    k, v = (torch.randn(1, hkv, n, 64, generator=gen) for _ in range(2))
    return tuple(quantize(q, k, v))


def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dq: object, dk: object,
         dv: object, **kw: object) -> object:
    return flashgen.attention(q, k, v, descale_q=dq, descale_k=dk, descale_v=dv, **kw)


def test_fp8_on_the_cpu_without_the_interpreter_is_a_named_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(TypeError, match=r"fp8 tensor cores.*interpreter"):
        check_fp8_device(torch.device("cpu"))


def test_fp8_without_descales_is_a_named_error() -> None:
    q, k, v, dq, dk, _ = fp8_inputs()
    with pytest.raises(ValueError, match="descale_v is missing"):
        call(q, k, v, dq, dk, None)
    with pytest.raises(ValueError, match="descale_q is missing"):
        flashgen.attention(q, k, v)


@pytest.mark.parametrize("bad", ["shape", "heads", "dtype", "type"])
def test_a_bad_descale_is_a_named_error(bad: str) -> None:
    q, k, v, dq, dk, dv = fp8_inputs()
    wrong = {"shape": torch.ones(1, 2, 3),  # k has 2 heads, 200 rows: (1, 2, 2) wanted
             "heads": torch.ones(1, 4, 2),
             "dtype": dk.half(),
             "type": 0.5}[bad]
    error, needle = ((TypeError, "float32") if bad == "dtype" else
                     (TypeError, "torch.Tensor") if bad == "type" else
                     (ValueError, r"\(1, 2, 2\)"))
    with pytest.raises(error, match=needle):
        call(q, k, v, dq, wrong, dv)


def test_e5m2_is_a_named_error() -> None:
    q, k, v, *ds = fp8_inputs()
    with pytest.raises(TypeError, match=r"float8_e5m2.*not support"):
        call(q, k.float().to(torch.float8_e5m2), v, *ds)


def test_mixed_fp8_and_bf16_is_a_named_error() -> None:
    q, k, v, *ds = fp8_inputs()
    with pytest.raises(TypeError, match="mixed fp8"):
        call(q, k, v.float().bfloat16(), *ds)


def test_descales_or_out_dtype_without_fp8_are_named_errors() -> None:
    q = torch.randn(1, 2, 16, 16)
    with pytest.raises(ValueError, match="descale_k is only for fp8"):
        call(q, q, q, None, torch.ones(()), None)
    with pytest.raises(ValueError, match="out_dtype is only for fp8"):
        flashgen.attention(q, q, q, out_dtype=torch.float16)


def test_fp8_out_dtype_must_be_bf16_or_fp16() -> None:
    with pytest.raises(TypeError, match="out_dtype"):
        call(*fp8_inputs(), out_dtype=torch.float32)


def test_fp8_needs_compute_capability_8_9() -> None:
    cuda = torch.device("cuda")
    with pytest.raises(TypeError, match=r"compute capability 8\.9.*has 8\.0"):
        check_fp8_device(cuda, capability=(8, 0))
    for capable in ((8, 9), (9, 0), (10, 0)):
        check_fp8_device(cuda, capability=capable)


# ---- the fa2 fp8 forward ------------------------------------------------------------------


def blocky_inputs(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, *,
                  seed: int = 5) -> tuple[torch.Tensor, ...]:
    """Inputs whose 128-row blocks differ in magnitude (8x), so a kernel reading the wrong
    block's descale fails the gate (`fp8_bound`'s docstring)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=gen)
    k, v = (torch.randn(b, hkv, nk, d, generator=gen) for _ in range(2))
    for t in (q, k, v):
        t[:, :, 128:] *= 8
    return q, k, v


FP8_CASES = [
    # b, hq, hkv, nq, nk, d, causal, block
    (1, 2, 1, 150, 200, 64, True, 128),    # GQA, Nq != Nk (bottom-right causal), odd lengths
    (2, 2, 2, 130, 130, 32, False, 128),
    (1, 2, 2, 140, 260, 64, False, None),  # per-tensor descales
    (1, 4, 1, 33, 300, 16, True, 128),     # MQA, three key blocks
    (1, 2, 2, 140, 170, 48, True, None),   # a head dim the kernel pads (no rotation here)
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", FP8_CASES)
def test_the_fp8_forward_passes_the_fp8_gate(case: tuple) -> None:
    b, hq, hkv, nq, nk, d, causal, block = case
    q, k, v = blocky_inputs(b, hq, hkv, nq, nk, d)
    qz = quantize(q, k, v, block=block, incoherent=block is not None)
    out, lse = call(*qz, causal=causal, out_dtype=torch.float16, return_lse=True)
    assert out.dtype == torch.float16 and out.shape == q.shape and lse.shape == q.shape[:3]
    result = compare_fp8(out, qz, causal=causal, block=block)
    assert result.ok, result.reason
    # A kernel that ignored the blocks' descales (block 0's everywhere) would fail.
    if block is not None and max(nq, nk) > 128:
        wrong = quantize(q, k, v, block=block, incoherent=True)
        flat = wrong._replace(descale_k=wrong.descale_k[..., :1].expand_as(wrong.descale_k))
        assert not compare_fp8(out, flat, causal=causal, block=block).ok


@pytest.mark.interpreter
def test_the_interpreter_rounds_to_e4m3_as_the_gpu_while_fp8_runs() -> None:
    """Triton 3.6's interpreter rounds some fp32 values to the wrong e4m3 neighbour (0.4872
    to 0.46875, not 0.5); `exact_e4m3` makes it round as the GPU does, clamps to +-448 as
    cvt.satfinite does, and puts the interpreter's own conversion back afterwards."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from flashgen.runtime.interpreter import exact_e4m3

    x = np.array([0.4872, 0.01535, -0.3, 1.0, 500.0], dtype=np.float32)

    def rounded() -> list[str]:  # as text: NaN (the interpreter's 500.0) equals itself
        raw = interpreter._convert_float(x, tl.float32, tl.float8e4nv, None)
        values = torch.from_numpy(np.asarray(raw).astype(np.uint8)).view(FP8_DTYPE).float()
        return [str(v) for v in values.tolist()]

    before = rounded()
    with exact_e4m3():
        assert rounded() == ["0.5", "0.015625", "-0.3125", "1.0", "448.0"]
    assert rounded() == before


def emulate_modified(deq: list[torch.Tensor], window: tuple[int, int], cap: float,
                     sinks: torch.Tensor, p_fp8: bool) -> torch.Tensor:
    """`emulation.emulate_fp8_attention` with causal, a window, a softcap and sinks: fp32
    attention of the dequantized inputs, P rounded to e4m3 before P V (row sums in fp32)."""
    q, k, v = deq
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = cap * torch.tanh(s / cap)
    i = torch.arange(q.shape[2])[:, None] + k.shape[2] - q.shape[2]
    j = torch.arange(k.shape[2])[None, :]
    s = s.masked_fill((j > i) | (j < i - window[0]), float("-inf"))
    sink = sinks.view(1, -1, 1, 1)
    top = torch.maximum(s.amax(-1, keepdim=True), sink)
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True) + torch.exp(sink - top)
    return ((p.to(FP8_DTYPE).float() if p_fp8 else p) @ v) / total


@pytest.mark.interpreter
def test_fp8_takes_the_modifiers() -> None:
    q, k, v = blocky_inputs(1, 2, 1, 140, 140, 32)
    qz = quantize(q, k, v)
    deq = [dequantize(t, dsc) for t, dsc in ((qz.q, qz.descale_q), (qz.k, qz.descale_k),
                                             (qz.v, qz.descale_v))]
    window, cap, sinks = (40, 0), 20.0, torch.tensor([0.5, -1.0])
    out = call(*qz, causal=True, window=window, softcap=cap, sinks=sinks,
               out_dtype=torch.float16).float()
    exact = emulate_modified(deq, window, cap, sinks, p_fp8=False)
    # The gate's derivation (`fp8_bound`): the factor times the P-in-fp8 emulation's error,
    # plus one rounding to fp16.
    emulated = (emulate_modified(deq, window, cap, sinks, p_fp8=True) - exact).abs().max()
    bound = ERROR_FACTOR * emulated.item() + exact.abs().max().item() * 2.0 ** -11
    assert (out - exact).abs().max().item() <= bound
    plain = call(*qz, causal=True, out_dtype=torch.float16).float()
    assert (plain - exact).abs().max().item() > bound  # the modifiers were applied


def test_fp8_is_forward_only() -> None:
    q, k, v, *ds = fp8_inputs()
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="forward only"):
        call(q, k, v, *ds)
    # A descale that requires grad (a tracked scale) was accepted, its gradient lost.
    q.requires_grad_(False)
    tracked = [ds[0] * torch.ones((), requires_grad=True), *ds[1:]]
    with pytest.raises(NotImplementedError, match="forward only"):
        call(q, k, v, *tracked)


def test_fp8_variants_are_fa2_and_one_tile_fa3_kernels_with_tiles_inside_a_block() -> None:
    from flashgen.kernels.fwd_space import default_variant, search_space, why_invalid
    from flashgen.kernels.hardware import DeviceInfo
    from flashgen.kernels.problem import Problem
    from flashgen.kernels.variant import Variant

    hopper = DeviceInfo("H-test", (9, 0), 132, 232448)
    p = Problem(2, 8, 2, 4096, 4096, 128, "fp8", True)
    space = search_space(p, hopper)
    assert space and {v.loop_order for v in space} == {"fa2", "fa3"}
    assert any(v.use_tma for v in space) and not all(v.use_tma for v in space)
    assert all(128 % (v.fa3_rows if v.loop_order == "fa3" else v.block_m) == 0
               and 128 % v.block_n == 0 for v in space)
    assert all(v.block_n >= 32 for v in space)
    assert any(v.loop_order == "fa3" and v.pingpong for v in space)
    assert not any(v.head_units for v in space)
    assert why_invalid(default_variant(p, hopper), p, hopper) is None
    assert default_variant(p, hopper).loop_order == "fa2"  # fa3 fp8 is tuned, not a default
    assert why_invalid(Variant("fa3", 128, 128, 4, 2), p, hopper) is None
    assert why_invalid(Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True), p,
                       hopper) is None
    assert "whole heads" in why_invalid(
        Variant("fa3", 128, 128, 4, 3, programs_per_sm=1, head_units=True), p, hopper)
    assert "not fa1" in why_invalid(Variant("fa1", 64, 64, 4, 2), p, hopper)
    assert "quantization block" in why_invalid(Variant("fa2", 256, 64, 8, 2), p, hopper)
    assert "at least 32 keys" in why_invalid(Variant("fa2", 64, 16, 4, 2), p, hopper)
    ampere = DeviceInfo("A-test", (8, 0), 108, 232448)
    assert "8.9" in why_invalid(Variant("fa2", 128, 64, 4, 2), p, ampere)
    # 8-bit products reduce over at least 32 elements: a small head dim tiles with 32.
    assert Problem(1, 2, 2, 64, 64, 16, "fp8", False).padded_head_dim == 32


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [FP8_CASES[0], FP8_CASES[3]])
def test_the_fp8_tma_kernel_reads_v_keys_inner_and_passes_the_gate(
        case: tuple) -> None:
    b, hq, hkv, nq, nk, d, causal, block = case
    q, k, v = blocky_inputs(b, hq, hkv, nq, nk, d)
    qz = quantize(q, k, v, block=block)
    tma = flashgen.Variant("fa2", 32, 32, 4, 2, use_tma=True)
    out = call(*qz, causal=causal, variant=tma)
    result = compare_fp8(out, qz, causal=causal, block=block)
    assert result.ok, result.reason
    # V laid out rows-inner cannot feed the fp8 TMA kernel: an explicit variant says so.
    rows = quantize(q, k, v, block=block, v_keys_inner=False)
    with pytest.raises(ValueError, match="keys-inner"):
        call(*rows, causal=causal, variant=tma)


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_CASES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", [
    None,
    flashgen.Variant("fa2", 128, 64, 8, 3, use_tma=True),
    flashgen.Variant("fa2", 128, 128, 8, 2, use_tma=True, warp_specialize=True),
    flashgen.Variant("fa2", 64, 64, 4, 3, use_tma=True, programs_per_sm=2),
    flashgen.Variant("fa3", 128, 128, 8, 2),
    flashgen.Variant("fa3", 128, 128, 4, 2),
    flashgen.Variant("fa3", 64, 64, 4, 3),
    flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True),
    flashgen.Variant("fa3", 128, 64, 8, 2, programs_per_sm=1),
], ids=["default", "tma", "tma-ws", "tma-persistent", "fa3-1x128", "fa3-2x64", "fa3-1x64",
        "fa3-persistent-pp", "fa3-persistent-1x128"])
def test_gpu_fp8_forward_passes_the_fp8_gate(case: tuple, out_dtype: torch.dtype,
                                             variant: Any) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    if variant is not None and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("TMA kernels are served on Hopper")
    b, hq, hkv, nq, nk, d, causal, block = case
    if variant is not None and variant.loop_order == "fa2":  # a query tile no longer than
        # the queries need (a rule)
        variant = dataclasses.replace(variant, block_m=min(variant.block_m,
                                                           max(16, 1 << (nq - 1).bit_length())))
    if variant is not None:
        why = flashgen.why_invalid(variant, flashgen.Problem(b, hq, hkv, nq, nk, d, "fp8",
                                                             causal), "cuda")
        if why:
            pytest.skip(why)  # e.g. fa3 at a head dim it does not take
    q, k, v = (t.cuda() for t in blocky_inputs(b, hq, hkv, nq, nk, d))
    qz = quantize(q, k, v, block=block, incoherent=block is not None)
    out = call(*qz, causal=causal, out_dtype=out_dtype, variant=variant)
    assert out.dtype == out_dtype
    result = compare_fp8(out, qz, causal=causal, block=block)
    assert result.ok, result.reason


@pytest.mark.interpreter
def test_fp8_problems_are_tuned_and_their_winner_served(tmp_path: Any) -> None:
    from flashgen.kernels.hardware import INTERPRETER
    from flashgen.kernels.problem import Problem
    from flashgen.serve import Dispatcher
    from flashgen.store.db import TuningDB
    from flashgen.tune.fwd_bench import KernelBench
    from flashgen.tune.search import TuneOptions, tune_problem

    problem = Problem(1, 2, 1, 150, 150, 32, "fp8", True)
    with TuningDB(tmp_path / "t.db") as db:
        result = tune_problem(problem, KernelBench(problem, "cpu"), db, INTERPRETER,
                              TuneOptions(trials=2))
        rows = [r for r in db.trials() if r.status != "pruned"]
    assert result.measured == 2 and result.winner is not None
    assert all(r.status == "ok" and r.error <= r.bound for r in rows)  # the fp8 gate passed
    assert result.winner.key.dtype == "fp8"
    q, k, v = blocky_inputs(1, 2, 1, 150, 150, 32)
    qz = quantize(q, k, v)
    choice = flashgen.explain(qz.q, qz.k, qz.v, causal=True,
                              dispatcher=Dispatcher([tmp_path / "t.db"]))
    assert choice.how == "exact" and choice.variant == result.winner.variant
    assert choice.backward is None  # forward only


def test_the_kernels_and_the_runtime_agree_on_the_fp8_block() -> None:
    from flashgen.kernels.problem import FP8_BLOCK

    assert FP8_BLOCK == QUANT_BLOCK


@pytest.mark.interpreter
def test_v_with_keys_inner_is_the_same_attention() -> None:
    q, k, v = blocky_inputs(1, 2, 1, 150, 200, 32)
    inner, rows = (quantize(q, k, v, v_keys_inner=flag) for flag in (True, False))
    assert inner.v.stride()[-2:] == (1, 208) and rows.v.stride()[-1] == 1
    assert torch.equal(inner.v.float(), rows.v.float())
    assert torch.equal(call(*inner, causal=True), call(*rows, causal=True))


def test_tuning_fp8_on_a_gpu_without_fp8_tensor_cores_is_one_error_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from flashgen.cli import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0) if i else (8, 0))
    result = CliRunner().invoke(app, ["tune", "--shape", "1,2,1,128,128,64", "--dtype", "fp8",
                                      "--gpus", "1,0"])
    assert result.exit_code == 2
    assert "GPU 0 has 8.0" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("mode", "shape"), [("both", "1,2,1,64,64,32"),
                                             ("bwd", "1,2,1,64,64,32"),
                                             ("decode", "2,4,1,1,48,16")])
def test_tuning_fp8_beyond_the_forward_is_one_error_line(mode: str, shape: str) -> None:
    from typer.testing import CliRunner

    from flashgen.cli import app

    result = CliRunner().invoke(app, ["tune", "--device", "cpu", "--shape", shape, "--dtype",
                                      "fp8", "--mode", mode])
    assert result.exit_code == 2 and "forward only" in result.output


@pytest.mark.parametrize("variant", [
    flashgen.Variant("fa3", 128, 128, 8, 2),  # one consumer of 128 rows
    flashgen.Variant("fa3", 128, 128, 4, 2),  # two consumers of 64 rows
    flashgen.Variant("fa3", 64, 64, 4, 3),
    flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True),
    flashgen.Variant("fa3", 128, 64, 8, 2, programs_per_sm=1),
], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_the_fa3_fp8_kernel_compiles_to_8bit_warpgroup_products(variant: Any, d: int) -> None:
    """Compiled for Hopper on any machine (`gluon_compile`): both products are e4m3 WGMMAs,
    P is never repacked (no byte permutes), and the one-tile kernel's softmax runs under
    the P V product. Nothing spills: the persistent kernel carries P in fp16 between its
    softmax and the next step's product (carried in fp32, its two 64-row consumers at D128
    spilled 76-108 bytes a thread)."""
    from flashgen.kernels.hardware import DeviceInfo
    from flashgen.kernels.problem import Problem
    from flashgen.tune.gluon_compile import report_in_subprocess

    hopper = DeviceInfo("H-test", (9, 0), 132, 232448)
    problem = Problem(2, 16, 16, 4096, 4096, d, "fp8", True)
    assert flashgen.why_invalid(variant, problem, hopper) is None
    found = report_in_subprocess(variant, problem)
    assert found["wgmma"] and found["wgmma_e4m3"] == found["wgmma"]
    assert found["tma"] and found["wait_one"] and found["byte_permutes"] == 0
    if not variant.programs_per_sm:  # the pin that holds it there is the one-tile kernel's
        assert found["exp_under_pv"] and all(found["exp_under_pv"]), found["exp_under_pv"]
    assert found["shared"] <= hopper.shared_memory
    assert any("0 bytes spill stores" in line for line in found["ptxas"]), found["ptxas"]



@pytest.mark.parametrize("variant", [
    flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True),
    flashgen.Variant("fa3", 128, 64, 8, 2, programs_per_sm=1),
], ids=str)
def test_the_p_regs_override_reads_k_in_row_groups_and_hands_p_over_in_registers(
        variant: Any) -> None:
    """The persistent fp8 kernel with `p_regs` (off by default; an A/B override): K arrives
    by 5-D TMA, P V takes P from registers (no 8-bit shared-memory stores), at most one byte
    permute a 32-bit operand register at each of a consumer's two P V sites (P carried in
    fp8 across the loop took ~450), and nothing spills under the causal mask."""
    from flashgen.kernels.problem import Problem
    from flashgen.tune.gluon_compile import report_in_subprocess

    found = report_in_subprocess(variant, Problem(2, 16, 16, 4096, 4096, 128, "fp8", True),
                                 overrides={"p_regs": True})
    ops = found["opcodes"]
    assert ops.get("UTMALDG.5D") and found["wgmma_e4m3"] == found["wgmma"]
    assert not any(op.startswith("STS.U") for op in ops), ops
    consumers = variant.block_m // (16 * variant.num_warps)
    assert 0 < found["byte_permutes"] <= 2 * consumers * variant.block_n // 8
    assert any("0 bytes spill stores" in line for line in found["ptxas"]), found["ptxas"]


def _key_of(n: int) -> int:
    """The persistent fp8 kernel's `_key_of`: the key its score column n holds."""
    return (n & -16) | ((n & 6) << 1) | ((n >> 2) & 2) | (n & 1)


@pytest.mark.parametrize("n", [48, 150, 256])
def test_k_row_groups_land_keys_where_the_8bit_operand_wants_them(n: int) -> None:
    """The 5-D descriptor's tile, read as TMA reads it (box order, inner dims first), holds
    at shared-memory row r the key `_key_of(r)` of its batch and head, for every tile; the
    column -> key map is a permutation of each 16 keys; and a layout whose batches or heads
    do not start on a 16-row boundary, or whose memory ends inside a group, gets None."""
    from flashgen.runtime.forward import k_groups_descriptor

    b, h, d, block_n = 2, 3, 32, 32
    rows = torch.randint(0, 120, (b, h, -(-n // 16) * 16, d), dtype=torch.uint8)
    k = rows.view(torch.float8_e4m3fn)[:, :, :n]  # heads' rows padded to 16, as a caller may
    keys = k.view(torch.uint8)  # compared as bytes
    found = k_groups_descriptor(k, block_n, 64)
    assert found is not None
    desc, group_b, group_h = found
    assert desc.block_shape == [block_n // 16, 2, 4, 2, 64]  # TMA zero-fills past D
    view = desc.base
    assert sorted(_key_of(c) for c in range(16)) == list(range(16))
    for bi in range(b):
        for hi in range(h):
            for j in range(-(-n // block_n)):
                g0 = bi * group_b + hi * group_h + j * (block_n // 16)
                # Groups past the last one TMA reads as zeros (the kernel masks those keys).
                tile = view.view(torch.uint8)[g0:g0 + block_n // 16].reshape(-1, d)
                for r in range(tile.shape[0]):
                    key = j * block_n + _key_of(r)
                    if key < n:
                        assert torch.equal(tile[r], keys[bi, hi, key]), (bi, hi, j, r)
    raw = torch.zeros(b, h, 150, d).to(torch.float8_e4m3fn)  # heads of 150 rows
    assert k_groups_descriptor(raw, block_n, d) is None
    alone = torch.zeros(1, 1, 150, d).to(torch.float8_e4m3fn)
    assert k_groups_descriptor(alone, block_n, d) is None  # memory ends inside a group
    assert k_groups_descriptor(torch.zeros(1, 1, 160, d).to(torch.float8_e4m3fn)[:, :, :150],
                               block_n, d) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_CASES)
def test_gpu_the_p_regs_override_passes_the_fp8_gate(case: tuple) -> None:
    """The persistent fp8 kernel with `p_regs` (K in 16-row groups, P V from registers) on
    every fp8 case, K's heads padded to 16 rows; the same K contiguous, where a head starts
    off a 16-row boundary: an explicit (strict) launch is a named error, the runtime's
    non-strict launch runs the pointer twin, and both pass the gate."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fa3 fp8 kernels are Hopper's")
    from flashgen.kernels.render import _load_module, _templates, render_with, source_hash
    from flashgen.runtime.modifiers import Fp8, Mods
    from flashgen.serve import prepare_forward

    b, hq, hkv, nq, nk, d, causal, block = case
    variant = flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1)
    problem = flashgen.Problem(b, hq, hkv, nq, nk, d, "fp8", causal)
    if flashgen.why_invalid(variant, problem, "cuda"):
        pytest.skip(flashgen.why_invalid(variant, problem, "cuda"))
    source = render_with(_templates(), variant, problem, {"p_regs": True})
    kernel = _load_module(source_hash(source), source).attn_fwd
    q, k, v = (t.cuda() for t in blocky_inputs(b, hq, hkv, nq, nk, d))
    qz = quantize(q, k, v, block=block, incoherent=block is not None)
    kd = qz.k.shape[-1]
    rows = torch.zeros(b, hkv, -(-nk // 16) * 16, kd, dtype=qz.k.dtype, device="cuda")
    rows[:, :, :nk] = qz.k
    scale = d ** -0.5
    for k8, grouped in ((rows[:, :, :nk], True), (qz.k.contiguous(), nk % 16 == 0)):
        given = Quantized(qz.q, k8, *qz[2:])
        mods = Mods(fp8=Fp8.of(given.q, given.k, given[3:], None, QUANT_BLOCK))
        strict = prepare_forward(variant, problem, kernel=kernel)
        if grouped:
            out, _ = strict(given.q, given.k, given.v, scale, mods)
        else:
            with pytest.raises(ValueError, match="16-row boundary"):
                strict(given.q, given.k, given.v, scale, mods)
            out, _ = prepare_forward(variant, problem, strict=False, kernel=kernel)(
                given.q, given.k, given.v, scale, mods)
        result = compare_fp8(out, given, causal=causal, block=block)
        assert result.ok, (grouped, result.reason)
