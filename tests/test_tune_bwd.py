"""Backward tuning: the tuner over BwdVariants with a fake bench, the real backward bench on
the interpreter, and backward rows in the database."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import pytest

from flashgen.kernels.bwd_space import bwd_search_space, default_bwd_variant, why_invalid_bwd
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.hardware import INTERPRETER
from flashgen.kernels.modes import SPACES
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import Variant
from flashgen.store.db import TuningDB
from flashgen.store.keys import MODES, TuningKey, Versions
from flashgen.tune.bwd_bench import BWD_FLOPS_RATIO, BwdKernelBench
from flashgen.tune.fwd_bench import Measurement
from flashgen.tune.search import TuneOptions, TuneResult, knob_choices, tune_problem
from flashgen.tune.timing import Timing, tflops

PROBLEM = Problem(1, 2, 1, 256, 256, 64)
VERSIONS = Versions("3.6.0", "2.13.0")


def made_up_ms(v: BwdVariant) -> float:
    """Deterministic, tie-free; the optimum is atomic m32 n128 w8 s2."""
    return (1.0 + abs(v.block_streamed - 32) / 32 + abs(v.block_owned - 128) / 61
            + (v.dq_mode == "separate") * 0.37 + abs(v.num_stages - 2) * 0.01
            + v.num_stages * 1e-4 + abs(v.num_warps - 8) * 0.001)


class FakeBwdBench:
    """Made-up backward timings; `wrong` variants fail the gradient gate."""

    def __init__(self, problem: Problem = PROBLEM, wrong: Sequence[BwdVariant] = ()) -> None:
        self.problem = problem
        self.wrong = set(wrong)
        self.measured: list[BwdVariant] = []

    def compile(self, variants: Sequence[BwdVariant]) -> dict[BwdVariant, str]:
        return {}

    def measure(self, variant: BwdVariant) -> Measurement:
        assert isinstance(variant, BwdVariant)
        self.measured.append(variant)
        if variant in self.wrong:
            return Measurement.failed("wrong answer: dq: max error 1 over bound 0.01", 1.0, 0.01)
        ms = made_up_ms(variant)
        return Measurement("ok", timing=Timing(ms, ms, ms, 5),
                           tflops=tflops(BWD_FLOPS_RATIO * self.problem.flops(), ms),
                           error=1e-3, bound=1e-2)

    def baseline(self) -> None:
        return None


@pytest.fixture
def db(tmp_path: Path) -> TuningDB:
    with TuningDB(tmp_path / "tuning.db") as database:
        yield database


def tune_bwd(bench: FakeBwdBench, db: TuningDB, problem: Problem = PROBLEM,
             **kw: object) -> TuneResult:
    extra = {k: kw.pop(k) for k in ("run_id", "on_progress", "clock") if k in kw}
    versions = kw.pop("versions", VERSIONS)
    return tune_problem(problem, bench, db, INTERPRETER,  # type: ignore[arg-type]
                        TuneOptions(mode="bwd", **kw), versions=versions,  # type: ignore[arg-type]
                        **extra)  # type: ignore[arg-type]


# ---- the tuner over BwdVariants ----------------------------------------------------------


def test_modes_and_spaces_agree() -> None:
    assert MODES == ("fwd", "bwd", "decode") and set(SPACES) == set(MODES)
    knobs = knob_choices(bwd_search_space(PROBLEM, INTERPRETER))
    assert set(knobs) == {f.name for f in fields(BwdVariant)}
    assert set(knobs["dq_mode"]) == {"separate", "atomic"}


def test_bwd_study_measures_the_default_first_and_stores_a_bwd_winner(db: TuningDB) -> None:
    bench = FakeBwdBench()
    result = tune_bwd(bench, db, trials=20, seed=2)
    assert bench.measured[0] == default_bwd_variant(PROBLEM, INTERPRETER)
    assert result.mode == "bwd" and result.measured == 20
    assert result.best == min(bench.measured, key=made_up_ms)
    assert result.winner is not None and result.winner.variant == result.best
    assert isinstance(result.winner.variant, BwdVariant) and result.winner.key.mode == "bwd"
    key = TuningKey.for_problem(PROBLEM, INTERPRETER, "bwd", VERSIONS)
    assert db.winner(key) == result.winner
    assert [w.variant for w in db.load_winners(INTERPRETER.key, "3.6.0",
                                               mode="bwd")] == [result.best]
    assert db.load_winners(INTERPRETER.key, "3.6.0") == []  # not a forward winner
    for row in db.trials():
        assert row.key.mode == "bwd"
        if row.status == "pruned":
            assert row.reason == why_invalid_bwd(BwdVariant.from_dict(row.variant), PROBLEM,
                                                 INTERPRETER)
    # The per-knob columns: dq_mode filled, the forward-only ones NULL.
    cols = db.db.execute("SELECT DISTINCT loop_order, split_mask, dq_mode IS NOT NULL "
                         "FROM trials").fetchall()
    assert cols == [(None, None, 1)]


def test_bwd_failures_never_win_and_the_search_exhausts_small_spaces(db: TuningDB) -> None:
    tiny = Problem(1, 2, 1, 16, 16, 16)
    space = bwd_search_space(tiny, INTERPRETER)
    best = min(space, key=made_up_ms)
    bench = FakeBwdBench(tiny, wrong=[best])
    result = tune_bwd(bench, db, tiny, trials=10_000, batch=4)
    assert sorted(map(str, bench.measured)) == sorted(map(str, space))
    assert result.failed == 1 and result.best == min(set(space) - {best}, key=made_up_ms)


def test_bwd_rerun_resumes_and_seeds_from_bwd_winners_only(db: TuningDB) -> None:
    first_bench, again_bench = FakeBwdBench(), FakeBwdBench()
    tune_bwd(first_bench, db, trials=8, seed=1)
    again = tune_bwd(again_bench, db, trials=4, seed=1)
    assert again.resumed == 8 and not set(first_bench.measured) & set(again_bench.measured)
    assert again.best == min(first_bench.measured + again_bench.measured, key=made_up_ms)
    assert again.best != default_bwd_variant(PROBLEM, INTERPRETER)
    # A forward study of the same problem neither resumes nor seeds from backward rows.
    fwd = tune_problem(PROBLEM, _FwdBench(), db, INTERPRETER, TuneOptions(trials=2),
                       versions=VERSIONS)
    assert fwd.resumed == 0 and fwd.mode == "fwd" and isinstance(fwd.best, Variant)
    longer = PROBLEM.with_(seq_q=512, seq_k=512)
    seeded = FakeBwdBench(longer)
    tune_bwd(seeded, db, longer, trials=2)
    assert seeded.measured[1] == again.best  # the nearest backward winner comes second


class _FwdBench:
    def compile(self, variants: Sequence[Variant]) -> dict[Variant, str]:
        return {}

    def measure(self, variant: Variant) -> Measurement:
        assert isinstance(variant, Variant)
        return Measurement("ok", timing=Timing(1.0, 1.0, 1.0, 1), tflops=1.0)

    def baseline(self) -> None:
        return None


def test_backward_rows_and_baselines_are_kept_apart(db: TuningDB) -> None:
    key = TuningKey.for_problem(PROBLEM, INTERPRETER, "bwd", VERSIONS)
    with pytest.raises(TypeError, match="BwdVariant"):
        db.record_trial(key, PROBLEM, Variant(), "ok")
    db.record_baseline(INTERPRETER.key, PROBLEM, "flash", Timing(1, 1, 1, 1), "2.13.0")
    db.record_baseline(INTERPRETER.key, PROBLEM, "cudnn", Timing(3, 3, 3, 1), "2.13.0", "bwd")
    assert db.baseline(INTERPRETER.key, "2.13.0", PROBLEM) == ("flash", 1)
    assert db.baseline(INTERPRETER.key, "2.13.0", PROBLEM, "bwd") == ("cudnn", 3)
    db.record_trial(key, PROBLEM, BwdVariant(), "ok", timing=Timing(2, 2, 2, 1), tflops=1.0)
    winner = db.update_winner(key)
    assert winner is not None and winner.speedup == pytest.approx(1.5)  # vs SDPA's backward


# ---- the real backward bench on the interpreter -------------------------------------------


@pytest.mark.interpreter
def test_bwd_kernel_bench_checks_gradients_and_times_the_backward() -> None:
    tiny = Problem(1, 2, 1, 24, 40, 16, causal=True)
    bench = BwdKernelBench(tiny, "cpu", seed=0)
    variant = BwdVariant(16, 16, 2, 1, "atomic")
    assert bench.compile([variant]) == {}
    m = bench.measure(variant)
    assert m.status == "ok", m.reason
    assert m.error is not None and m.bound is not None and m.error <= m.bound
    assert m.tflops == pytest.approx(tflops(2.5 * tiny.flops(), m.timing.median_ms))
    assert bench.baseline().backend == "cpu"


@pytest.mark.interpreter
def test_bwd_kernel_bench_fails_wrong_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashgen.tune.bwd_bench as bwd_bench

    real = bwd_bench.run_backward

    def off_by_a_bit(*args: object, **kw: object) -> tuple:
        dq, dk, dv = real(*args, **kw)
        return dq, dk * 1.1, dv

    monkeypatch.setattr(bwd_bench, "run_backward", off_by_a_bit)
    m = BwdKernelBench(Problem(1, 1, 1, 16, 16, 16, "fp32"), "cpu").measure(
        BwdVariant(16, 16, 2, 1))
    assert m.status == "failed" and m.reason.startswith("wrong answer: dk")
