"""flashgen.attention is differentiable: autograd, torch.compile, and O(N) saved memory."""

from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.tune.check import make_inputs
from flashgen.tune.grads import compare_grads


def _grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           fn=flashgen.attention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, causal=causal)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out)
    out.backward(do)
    return (*(t.grad for t in leaves), do)  # type: ignore[return-value]


@pytest.mark.interpreter
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("dtype", "layout"), [(torch.float32, "bnhd"), (torch.float16, "bhnd")])
def test_autograd_matches_reference(causal: bool, dtype: torch.dtype, layout: str) -> None:
    q, k, v = make_inputs(1, 4, 2, 33, 45, 40, dtype, seed=3, layout=layout)
    *grads, do = _grads(q, k, v, causal)
    result = compare_grads(tuple(grads), q, k, v, do, causal)
    assert result.ok, result.reason


@pytest.mark.interpreter
def test_explicit_backward_variant_and_type_errors() -> None:
    q, k, v = make_inputs(1, 2, 1, 20, 20, 16, torch.float32, seed=1)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    bwd = flashgen.BwdVariant(16, 16, 2, 1, "atomic")
    flashgen.attention(*leaves, causal=True, bwd_variant=bwd).sum().backward()
    assert all(t.grad is not None for t in leaves)
    with pytest.raises(TypeError, match="BwdVariant"):
        flashgen.attention(*leaves, bwd_variant="fast")  # type: ignore[arg-type]


@pytest.mark.interpreter
def test_compiled_training_step() -> None:
    q, k, v = make_inputs(1, 2, 2, 24, 24, 16, torch.float32, seed=2)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return flashgen.attention(q * 2.0, k, v, causal=causal) * 0.5

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager = _grads(q, k, v, True, fn=step)
    traced = _grads(q, k, v, True, fn=compiled)
    for a, b in zip(eager[:3], traced[:3], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.interpreter
def test_compiled_step_with_explicit_variants() -> None:
    # The variants travel through the op as text, worked out once while tracing.
    q, k, v = make_inputs(1, 2, 1, 24, 24, 16, torch.float32, seed=6)
    fwd, bwd = flashgen.Variant("fa2", 16, 16, 2, 1), flashgen.BwdVariant(16, 16, 2, 1, "atomic")

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return flashgen.attention(q * 1.0, k, v, causal=causal, variant=fwd, bwd_variant=bwd)

    torch._dynamo.reset()
    *grads, do = _grads(q, k, v, True, fn=torch.compile(step, fullgraph=True,
                                                        backend="aot_eager"))
    result = compare_grads(tuple(grads), q, k, v, do, True)
    assert result.ok, result.reason


@pytest.mark.interpreter
def test_saves_only_linear_memory() -> None:
    n = 64
    q, k, v = make_inputs(1, 2, 2, n, n, 16, torch.float32, seed=4)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        out = flashgen.attention(*leaves, causal=True)
    out.sum().backward()
    assert saved, "the op saves its inputs for the backward"
    for shape in saved:  # q, k, v, out (B, H, N, D) and lse (B, H, N): never N x N
        assert list(shape).count(n) <= 1, shape


@pytest.mark.interpreter
@pytest.mark.parametrize("modified", [False, True])
def test_no_zero_gradient_is_made_for_the_lse(monkeypatch: pytest.MonkeyPatch,
                                               modified: bool) -> None:
    """The log-sum-exp takes no gradient, and autograd is told not to make a zero tensor for
    it in every backward (host time in a training step); the output's gradient still comes,
    and a graph that uses only the output's sum and the LSE times 0 still gets gradients."""
    from flashgen.runtime import ops

    cls = ops.ModifiedAttention if modified else ops.EagerAttention
    seen: list[object] = []
    real = cls.backward

    def spy(ctx: object, grad_out: torch.Tensor, grad_lse: object) -> tuple:
        seen.append(grad_lse)
        return real(ctx, grad_out, grad_lse)

    monkeypatch.setattr(cls, "backward", staticmethod(spy))
    q, k, v = make_inputs(1, 2, 1, 9, 9, 16, torch.float32, "cpu", seed=2)
    q.requires_grad_()
    options = {"softcap": 3.0} if modified else {}
    out, lse = flashgen.attention(q, k, v, return_lse=True, **options)
    (out.sum() + 0 * lse.sum()).backward()
    assert seen == [None] and q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("incoming", ["squared", "constant"])
@pytest.mark.parametrize("modified", [False, True])
def test_second_derivatives_are_refused(modified: bool, incoming: str) -> None:
    """The backward kernels have no backward: a gradient penalty (create_graph=True) must
    fail loudly, not lose its term (its gradient once came back as a constant, no error).
    "constant": the gradient of out.sum(), whose incoming gradient requires no grad, with
    the penalty's derivative asked of q, k and v alone (torch's `once_differentiable` let
    that one through)."""
    q, k, v = make_inputs(1, 2, 1, 8, 8, 16, torch.float32, "cpu", seed=4)
    for t in (q, k, v):
        t.requires_grad_()
    options = {"softcap": 3.0} if modified else {}
    sinks = torch.zeros(2, requires_grad=True) if modified else None
    out = flashgen.attention(q, k, v, sinks=sinks, **options)
    first = (out**2).sum() if incoming == "squared" else out.sum()
    (g,) = torch.autograd.grad(first, q, create_graph=True)
    penalty = out.square().sum() + (g**2).sum()
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad(penalty, [q, k, v])
    # A first derivative alone is unchanged.
    again = flashgen.attention(q, k, v, sinks=sinks, **options)
    (plain,) = torch.autograd.grad((again**2).sum() if incoming == "squared" else again.sum(), q)
    assert torch.equal(plain, g.detach())
    g.mul_(2)  # a gradient taken with create_graph can still be changed in place


@pytest.mark.interpreter
def test_the_gradient_of_sinks_alone_is_refused_twice() -> None:
    """dsinks depends on the sinks: a penalty on it, differentiated for the sinks alone."""
    q, k, v = make_inputs(1, 2, 1, 8, 8, 16, torch.float32, "cpu", seed=5)
    sinks = torch.zeros(2, requires_grad=True)
    out = flashgen.attention(q, k, v, sinks=sinks)
    (g,) = torch.autograd.grad(out.sum(), sinks, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad((g**2).sum(), sinks)


@pytest.mark.interpreter
def test_a_double_backward_through_an_empty_call_is_zero() -> None:
    """With no keys the gradients are zeros whatever the inputs: their derivative is 0,
    exact, so it is not refused."""
    q = torch.randn(1, 2, 4, 16, requires_grad=True)
    k = torch.randn(1, 2, 0, 16, requires_grad=True)
    v = torch.randn(1, 2, 0, 16, requires_grad=True)
    out = flashgen.attention(q, k, v)
    (g,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    assert not g.requires_grad and torch.equal(g, torch.zeros_like(q))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "d"), [(1024, 64), (2048, 128), (777, 80)])
def test_gpu_autograd(dtype: torch.dtype, causal: bool, n: int, d: int) -> None:
    q, k, v = make_inputs(2, 8, 2, n, n, d, dtype, "cuda", seed=n)
    *grads, do = _grads(q, k, v, causal)
    result = compare_grads(tuple(grads), q, k, v, do, causal)
    assert result.ok, result.reason
