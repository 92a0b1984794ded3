"""examples/packed_training.py: a training step on packed documents through
flashgen.attention_varlen gives the gradients of each document trained alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from flashgen.tune import reference

pytestmark = pytest.mark.interpreter

_PATH = Path(__file__).resolve().parent.parent / "examples" / "packed_training.py"
_spec = importlib.util.spec_from_file_location("packed_training", _PATH)
assert _spec is not None and _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def _reference_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                      longest: int) -> torch.Tensor:
    return reference.attention_varlen(q, k, v, cu, cu, causal=True)[0]


def _one_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
               longest: int) -> torch.Tensor:
    """Attention of a single document, dense: what packing must reproduce."""
    assert len(cu) == 2
    return reference.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                               v.transpose(0, 1)[None], causal=True)[0][0].transpose(0, 1)


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_packed_step_matches_documents_alone() -> None:
    torch.manual_seed(0)
    model = example.TinyLM(vocab=64, dim=32, heads=2, kv_heads=1, layers=2)
    docs = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n))
            for n in (5, 11, 1, 7)]
    tokens, positions, cu, longest = example.pack(docs)
    assert positions.tolist()[:6] == [0, 1, 2, 3, 4, 0]  # restarted per document

    ours = _grads(model, example.packed_loss(model(tokens, positions, cu, longest), tokens, cu))
    # Truth: float64, each document on its own (no packing at all), the same loss.
    model64 = model.double()
    logits = torch.cat([model64(d, torch.arange(len(d)), example.pack([d])[2], len(d),
                                attend=_one_alone) for d in docs])
    truth = _grads(model64, example.packed_loss(logits, tokens, cu))
    # The same-dtype eager error sets the bound (as tune/check.py does).
    model32 = model.float()
    eager = _grads(model32, example.packed_loss(
        model32(tokens, positions, cu, longest, attend=_reference_attend), tokens, cu))
    err = (ours.double() - truth).abs().max().item()
    eager_err = (eager.double() - truth).abs().max().item()
    bound = 4 * eager_err + torch.finfo(torch.float32).eps * truth.abs().max().item()
    assert err <= bound, (err, bound)
    assert truth.abs().max() > 0
