"""Dispatch on the GPU: CUDA-graph capture and torch.compile with the default backend."""

from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.tune.check import compare, make_inputs

pytestmark = pytest.mark.gpu


def test_cuda_graph_capture() -> None:
    q, k, v = make_inputs(2, 8, 2, 1000, 1000, 128, torch.bfloat16, "cuda", seed=3)
    eager = flashgen.attention(q, k, v, causal=True)  # compiles and plans outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashgen.attention(q, k, v, causal=True)
    new_q, _, _ = make_inputs(2, 8, 2, 1000, 1000, 128, torch.bfloat16, "cuda", seed=4)
    q.copy_(new_q)
    graph.replay()
    torch.cuda.synchronize()
    assert compare(captured, q, k, v, causal=True).ok
    assert not torch.equal(captured, eager)  # the replay really used the new inputs


def test_torch_compile_inductor_fullgraph() -> None:
    q, k, v = make_inputs(2, 8, 8, 512, 512, 64, torch.float16, "cuda", seed=5)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flashgen.attention(q.sin(), k, v, causal=True) * 2

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True)(q, k, v)
    ref = flashgen.attention(q.sin(), k, v, causal=True) * 2
    torch.testing.assert_close(out, ref)


def test_torch_compile_takes_explicit_variants_and_trains() -> None:
    """Explicit forward and backward variants under torch.compile (inductor, fullgraph): the
    output and the gradients are the eager call's with the same variants. torch 2.11's
    tracer refused the variants themselves ("can't reconstruct arbitrary frozen dataclass
    instances"); they reach the op as their fields' values."""
    q, k, v = make_inputs(2, 8, 2, 700, 700, 128, torch.bfloat16, "cuda", seed=6)
    # A deterministic backward, so that the two runs' gradients can be equal bitwise.
    torch.use_deterministic_algorithms(True)
    try:
        choice = flashgen.explain(q, k, v, causal=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert choice.backward is not None
    pinned = {"variant": choice.variant, "bwd_variant": choice.backward.variant}

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flashgen.attention(q, k, v, causal=True, **pinned)  # type: ignore[arg-type]

    results = []
    for run in (step, torch.compile(step, fullgraph=True)):
        torch._dynamo.reset()
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        out.float().square().sum().backward()
        results.append((out.detach(), *(t.grad for t in leaves)))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)
