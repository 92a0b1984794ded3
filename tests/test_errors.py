"""Bad input gets a clear error that names the problem, before any kernel is launched."""

from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.tune.check import compare, make_inputs


def _qkv(**kw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = {"b": 1, "hq": 2, "hkv": 2, "nq": 8, "nk": 8, "d": 16} | kw
    return make_inputs(
        shape["b"], shape["hq"], shape["hkv"], shape["nq"], shape["nk"], shape["d"], torch.float32
    )


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "4-D"),
        (lambda q, k, v: (q, k[:, :1].contiguous(), v), ValueError, "same number of heads"),
        (lambda q, k, v: (q, k, v[:, :, :4]), ValueError, "same sequence length"),
        (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head dims differ"),
        (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, "batch sizes differ"),
        (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "unsupported dtype"),
        (lambda q, k, v: (q.half(), k, v), TypeError, "share a dtype"),
        (lambda q, k, v: (q.to("meta"), k, v), ValueError, "different devices"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "torch.Tensor"),
        (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), ValueError, "empty"),
        (lambda q, k, v: (q[:, :0], k[:, :0], v[:, :0]), ValueError, "no heads"),
    ],
)
def test_bad_inputs(make, error: type[Exception], match: str) -> None:
    q, k, v = make(*_qkv())
    with pytest.raises(error, match=match):
        flashgen.attention(q, k, v)


def test_gqa_ratio_must_divide() -> None:
    q, k, v = _qkv(hq=3, hkv=2)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flashgen.attention(q, k, v)


def test_head_dim_over_256() -> None:
    q, k, v = _qkv(d=264)
    with pytest.raises(ValueError, match="head dim 264"):
        flashgen.attention(q, k, v)


def test_invalid_variant_is_an_error_not_a_fallback() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="invalid for"):
        flashgen.attention(q, k, v, variant=flashgen.Variant("fa2", 128, 16, 4, 2))
    with pytest.raises(TypeError, match=r"flashgen\.Variant"):
        flashgen.attention(q, k, v, variant={"block_m": 16})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loop_order"):
        flashgen.attention(q, k, v, variant=flashgen.Variant("fa4", 16, 16, 2, 1))  # type: ignore[arg-type]


@pytest.mark.interpreter
def test_gate_rejects_wrong_outputs() -> None:
    """The correctness check is not vacuous: small real mistakes fail it."""
    q, k, v = make_inputs(1, 2, 1, 33, 33, 40, torch.float16, seed=1)
    good = flashgen.attention(q, k, v, causal=True)
    assert compare(good, q, k, v, causal=True).ok
    assert not compare(flashgen.attention(q, k, v), q, k, v, causal=True).ok  # wrong mask
    assert not compare(good * 1.01, q, k, v, causal=True).ok
    nan = good.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert "NaN" in compare(nan, q, k, v, causal=True).reason


def test_dispatcher_and_return_lse_are_checked() -> None:
    """A wrong `dispatcher` once failed as an AttributeError deep inside ('str' object has no
    attribute 'forward'), and `return_lse="no"` returned a tuple."""
    q, k, v = _qkv()
    for call in (flashgen.attention, flashgen.explain):
        with pytest.raises(TypeError, match=r"dispatcher must be a flashgen\.Dispatcher"):
            call(q, k, v, dispatcher="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flashgen.attention(q, k, v, return_lse="no")  # type: ignore[arg-type]
    # numpy's bool calls itself "bool": the message names its module.
    import numpy as np

    with pytest.raises(TypeError, match=r"causal must be a bool, got numpy\.bool"):
        flashgen.attention(q, k, v, causal=np.bool_(True))  # type: ignore[arg-type]


@pytest.mark.interpreter
def test_numpy_and_tensor_scalars_are_numbers() -> None:
    """Options computed with numpy (a scale, a cap, window sides, a longest length) are
    numbers like Python's; bools and floats where ints belong stay errors."""
    import numpy as np

    q, k, v = _qkv()
    plain = flashgen.attention(q, k, v, scale=0.2, softcap=2.0, window=(2, -1))
    got = flashgen.attention(q, k, v, scale=np.float32(0.2), softcap=np.float64(2),
                             window=(np.int64(2), -1))
    torch.testing.assert_close(got, plain, atol=1e-6, rtol=1e-6)
    flashgen.explain(q, k, v, scale=np.float32(0.2))
    packed = q[0].transpose(0, 1).contiguous()  # (8, H, D): one sequence of 8
    cu = torch.tensor([0, 8], dtype=torch.int32)
    flashgen.attention_varlen(packed, packed, packed, cu, cu, np.int64(8), torch.tensor(8))
    with pytest.raises(TypeError, match="window must be a pair"):
        flashgen.attention(q, k, v, window=(2.0, -1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        flashgen.attention_varlen(packed, packed, packed, cu, cu, True, 8)
    with pytest.raises(TypeError, match="scale must be a real number"):
        flashgen.attention(q, k, v, scale=np.bool_(True))  # type: ignore[arg-type]


@pytest.mark.parametrize("empty", ["batch", "queries", "keys"])
def test_empty_calls_are_answered_as_sdpa_answers_them(empty: str) -> None:
    """A batch, Nq or Nk of 0 (an empty batch from a data loader) once raised "empty input";
    no kernel runs: rows that see no key give 0 and an LSE of -inf (the head's sink where
    there is one), and every gradient is 0."""
    b, nq, nk = {"batch": (0, 5, 7), "queries": (2, 0, 7), "keys": (2, 5, 0)}[empty]
    q = torch.randn(b, 4, nq, 16, requires_grad=True)
    k, v = (torch.randn(b, 2, nk, 16, requires_grad=True) for _ in range(2))
    out, lse = flashgen.attention(q, k, v, causal=False, return_lse=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert out.shape == sdpa.shape == q.shape and lse.shape == (b, 4, nq)
    assert not out.any() and (lse == float("-inf")).all()
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape and not t.grad.any()
               for t in (q, k, v))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    out, lse = flashgen.attention(q, k, v, sinks=sinks, window=(3, 0), return_lse=True)
    assert not out.any() and torch.equal(lse, sinks.detach().view(1, 4, 1).expand(b, 4, nq))
    with pytest.raises(ValueError, match="sinks must have shape"):
        flashgen.attention(q, k, v, sinks=sinks[:2])


def test_bf16_on_the_cpu_suggests_no_tuning(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """bf16 cannot run on the CPU: the call says so, and no longer first logs the untuned
    device's notice suggesting `flashgen tune --device cpu ... --dtype bf16` (which fails)."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv())
    dispatcher = flashgen.Dispatcher(tmp_path / "none.db")
    with caplog.at_level("INFO"), pytest.raises(TypeError, match="bf16"):
        flashgen.attention(q, k, v, dispatcher=dispatcher)
    assert "flashgen tune" not in caplog.text
