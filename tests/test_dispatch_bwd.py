"""Backward dispatch on the CPU: stored backward winners are served like forward ones (exact,
nearest valid bucket, fallback), autograd runs them, explain reports them, and the backward
call path reads no SQL after the first call."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import flashgen
import flashgen.runtime.dispatch as dispatch
from flashgen.kernels.bwd_space import default_bwd_variant
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.hardware import INTERPRETER
from flashgen.kernels.modes import AnyVariant
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey, Versions
from flashgen.tune.check import make_inputs
from flashgen.tune.grads import compare_grads
from flashgen.tune.timing import Timing

pytestmark = pytest.mark.interpreter

P64 = flashgen.Problem(1, 2, 1, 64, 64, 32, "fp32", True)
WINNER = BwdVariant(32, 32, 2, 1, "atomic")


def _store(path: Path, problem: flashgen.Problem, variant: AnyVariant, mode: str = "bwd",
           versions: Versions | None = None) -> None:
    with TuningDB(path) as db:
        key = TuningKey.for_problem(problem, INTERPRETER, mode, versions)
        db.record_trial(key, problem, variant, "ok", timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0)
        db.update_winner(key)


def test_exact_nearest_and_fallback(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, WINNER)
    d = flashgen.Dispatcher(db)
    exact = d.choose_bwd(P64.with_(seq_q=50, seq_k=60), INTERPRETER)
    assert (exact.variant, exact.how) == (WINNER, "exact") and str(db) in exact.source
    nearest = d.choose_bwd(P64.with_(seq_q=100, seq_k=120), INTERPRETER)
    assert (nearest.variant, nearest.how) == (WINNER, "nearest")
    short = P64.with_(seq_q=9, seq_k=9)  # block_streamed 32 is longer than 9 queries need
    fallback = d.choose_bwd(short, INTERPRETER)
    assert fallback.how == "fallback" and "block_streamed 32" in fallback.reason
    assert fallback.variant == default_bwd_variant(short, INTERPRETER)
    assert d.choose_bwd(P64.with_(causal=False), INTERPRETER).how == "fallback"
    # Backward winners are not forward ones, and the other way round.
    assert d.choose(P64, INTERPRETER).how == "fallback"


def test_forward_winners_and_stale_backward_rows_are_not_served(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, flashgen.Variant("fa1", 32, 16, 2, 1), mode="fwd")
    _store(db, P64, WINNER, versions=Versions("0.0.1", "2.0"))
    d = flashgen.Dispatcher(db)
    assert d.choose(P64, INTERPRETER).how == "exact"
    assert d.choose_bwd(P64, INTERPRETER).how == "fallback"


def test_autograd_runs_the_stored_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, WINNER)
    monkeypatch.setattr(dispatch, "_default", flashgen.Dispatcher(db))
    ran: list[BwdVariant] = []
    real = dispatch.prepare_backward

    def recording(entry: dict, *args: object) -> object:
        ran.append(BwdVariant.from_dict(entry["variant"]))
        return real(entry, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(dispatch, "prepare_backward", recording)
    q, k, v = make_inputs(1, 2, 1, 40, 64, 32, torch.float32, seed=5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flashgen.attention(*leaves, causal=True)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(do)
    assert ran == [WINNER]
    grads = tuple(t.grad for t in leaves)
    result = compare_grads(grads, q, k, v, do, causal=True)  # type: ignore[arg-type]
    assert result.ok, result.reason

    # After the first call, the backward path reads no SQL, for new shapes too.
    def no_sql(*a: object, **kw: object) -> None:
        raise AssertionError("SQL on the call path")

    monkeypatch.setattr(TuningDB, "open_readonly", no_sql)
    leaves = [t.requires_grad_(True) for t in make_inputs(1, 2, 1, 33, 33, 32, torch.float32)]
    flashgen.attention(*leaves, causal=True).sum().backward()
    assert ran == [WINNER, WINNER]


def test_explain_reports_the_backward_choice(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, WINNER)
    d = flashgen.Dispatcher(db)
    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32)
    choice = flashgen.explain(q, k, v, causal=True, dispatcher=d)
    assert choice.how == "fallback"  # no forward winner stored
    assert choice.backward is not None and choice.backward.variant == WINNER
    assert choice.backward.how == "exact" and f"backward: {WINNER} (exact)" in str(choice)
    explicit = BwdVariant(16, 16, 2, 1)
    picked = flashgen.explain(q, k, v, causal=True, bwd_variant=explicit, dispatcher=d)
    assert (picked.backward.variant, picked.backward.how) == (explicit, "explicit")
    with pytest.raises(ValueError, match="invalid"):
        d.explain(q[:, :, :9], k[:, :, :9], v[:, :, :9], causal=True,
                  bwd_variant=BwdVariant(128, 128, 8, 1))


def test_untuned_backward_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "t.db"
    _store(db, P64, flashgen.Variant("fa1", 32, 16, 2, 1), mode="fwd")
    d = flashgen.Dispatcher(db)
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        d.choose(P64, INTERPRETER)
        d.choose_bwd(P64, INTERPRETER)
        d.choose_bwd(P64.with_(causal=False), INTERPRETER)
    messages = [r.message for r in caplog.records]
    assert len(messages) == 1 and "no tuned backward kernels" in messages[0]
    assert "--mode bwd" in messages[0]
    # A process that tunes meanwhile keeps its table: the notice says what serves the rows.
    assert messages[0].endswith("(a process reads the winners once: flashgen.reload() reads "
                                "them again)")


def test_a_backward_kernel_that_fails_to_compile_gives_way_to_the_portable_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """As for the forward: a chosen backward kernel that does not build runs the portable
    default with one warning; an explicit bwd_variant raises."""
    import flashgen.serve as serve

    class Unbuildable:
        def __getitem__(self, grid: object) -> object:
            raise RuntimeError("PassManager::run failed")

    db = tmp_path / "t.db"
    _store(db, P64, WINNER)
    real = serve.load_bwd_kernel
    monkeypatch.setattr(serve, "load_bwd_kernel", lambda kernel, v, p: (
        Unbuildable() if v == WINNER and kernel == "dkdv" else real(kernel, v, p)))
    d = flashgen.Dispatcher(db)
    q, k, v = make_inputs(1, 2, 1, 64, 64, 32, torch.float32, seed=3)
    out, lse = d.forward(q, k, v, causal=True)
    do = torch.randn_like(out)
    with caplog.at_level(logging.WARNING, logger="flashgen"):
        grads = d.backward(do, dispatch.Saved(q, k, v, out, lse), causal=True)
        again = d.backward(do, dispatch.Saved(q, k, v, out, lse), causal=True)
    assert compare_grads(grads, q, k, v, do, causal=True).ok
    torch.testing.assert_close(again, grads)
    warnings = [r.message for r in caplog.records if "failed" in r.message]
    assert len(warnings) == 1 and str(WINNER) in warnings[0]
    assert d.explain(q, k, v, causal=True).backward.how == "fallback"
    with pytest.raises(RuntimeError, match="PassManager"):
        d.backward(do, dispatch.Saved(q, k, v, out, lse), causal=True, variant=WINNER)
