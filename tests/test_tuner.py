"""The search and selection logic, with injected benchmarks that return made-up timings (no
kernel runs), plus the pieces around it: gate shapes, timing statistics, presets."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import pytest

from flashgen.kernels.fwd_space import default_variant, portfolio, search_space, why_invalid
from flashgen.kernels.hardware import INTERPRETER, DeviceInfo
from flashgen.kernels.presets import PRESETS, expand, parse_causal, preset_problems
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import Variant
from flashgen.store.db import TuningDB
from flashgen.store.keys import Versions
from flashgen.tune.baseline import Baseline
from flashgen.tune.fwd_bench import (
    GATE_MAX_SEQ,
    FunctionBench,
    KernelBench,
    Measurement,
    gate_problem,
)
from flashgen.tune.search import TuneOptions, TuneResult, knob_choices, tune_problem
from flashgen.tune.timing import Timing, tflops, time_cpu

PROBLEM = Problem(1, 2, 1, 256, 256, 64)
#: 16-long sequences admit only 16-row tiles: a space small enough to measure exhaustively.
SMALL = Problem(1, 2, 1, 16, 16, 16)
VERSIONS = Versions("3.6.0", "2.13.0")


def made_up_ms(v: Variant) -> float:
    """A smooth, deterministic landscape without ties whose optimum is fa2 m128 n64 w4 s2
    (split mask, warp-specialized, TMA)."""
    return (1.0 + abs(v.block_m - 128) / 64 + abs(v.block_n - 64) / 64
            + (v.loop_order == "fa1") + abs(v.num_stages - 2) * 0.01
            + abs(v.num_warps - 4) * 0.001 + (not v.split_mask) * 1e-4
            + (not v.warp_specialize) * 1e-5 + (not v.use_tma) * 1e-6)


class FakeBench:
    """Deterministic timings; chosen variants fail in chosen ways. Counts every call."""

    def __init__(self, problem: Problem = PROBLEM, *, raises: Sequence[Variant] = (),
                 wrong: Sequence[Variant] = (), compile_fails: Sequence[Variant] = (),
                 baseline_ms: float | None = None) -> None:
        self.problem = problem
        self.raises, self.wrong, self.compile_fails = set(raises), set(wrong), \
            set(compile_fails)
        self.baseline_ms = baseline_ms
        self.measured: list[Variant] = []
        self.compiled: list[list[Variant]] = []

    def compile(self, variants: Sequence[Variant]) -> dict[Variant, str]:
        self.compiled.append(list(variants))
        return {v: "CompilationError: boom" for v in variants if v in self.compile_fails}

    def measure(self, variant: Variant) -> Measurement:
        self.measured.append(variant)
        if variant in self.raises:
            raise RuntimeError("OutOfResources: shared memory, Required: 300000")
        ms = made_up_ms(variant)
        if variant in self.wrong:
            return Measurement.failed("wrong answer: max error 0.5 over bound 0.01", 0.5, 0.01)
        return Measurement("ok", timing=Timing(ms, ms * 0.99, ms * 1.01, 10),
                           tflops=tflops(self.problem.flops(), ms), error=1e-3, bound=1e-2)

    def baseline(self) -> Baseline | None:
        if self.baseline_ms is None:
            return None
        return Baseline("flash", Timing(self.baseline_ms, self.baseline_ms,
                                        self.baseline_ms, 10))


@pytest.fixture
def db(tmp_path: Path) -> TuningDB:
    with TuningDB(tmp_path / "tuning.db") as database:
        yield database


def tune(bench: FakeBench, db: TuningDB, problem: Problem = PROBLEM, **kw: object) -> TuneResult:
    extra = {k: kw.pop(k) for k in ("run_id", "on_progress", "clock") if k in kw}
    versions = kw.pop("versions", VERSIONS)
    return tune_problem(problem, bench, db, INTERPRETER, TuneOptions(**kw),  # type: ignore[arg-type]
                        versions=versions, **extra)  # type: ignore[arg-type]


def fastest_valid(problem: Problem = PROBLEM) -> Variant:
    return min(search_space(problem, INTERPRETER), key=made_up_ms)


# ---- selection -------------------------------------------------------------------------


def test_best_is_the_fastest_measured_and_becomes_the_winner(db: TuningDB) -> None:
    bench = FakeBench(baseline_ms=3.0)
    result = tune(bench, db, trials=25, seed=3)
    assert result.measured == 25 == len(bench.measured) == len(set(bench.measured))
    assert result.best == min(bench.measured, key=made_up_ms)
    assert result.best_ms == made_up_ms(result.best)
    assert result.winner is not None and result.winner.variant == result.best
    assert result.speedup == pytest.approx(3.0 / result.best_ms)
    assert result.winner.speedup == pytest.approx(result.speedup)


def test_default_variant_is_measured_first(db: TuningDB) -> None:
    bench = FakeBench()
    tune(bench, db, trials=3)
    assert bench.measured[0] == default_variant(PROBLEM, INTERPRETER)


def test_exhausting_the_space_finds_the_optimum_and_stops(db: TuningDB) -> None:
    tiny = SMALL
    space = search_space(tiny, INTERPRETER)
    bench = FakeBench(tiny)
    result = tune(bench, db, tiny, trials=10_000, batch=8)
    assert sorted(map(str, bench.measured)) == sorted(map(str, space))  # each exactly once
    assert result.best == fastest_valid(tiny)


def test_invalid_points_are_pruned_with_their_reason(db: TuningDB) -> None:
    result = tune(FakeBench(), db, trials=15, seed=1)
    pruned = [r for r in db.trials() if r.status == "pruned"]
    assert len(pruned) == result.pruned > 0
    for row in pruned:
        assert row.reason == why_invalid(Variant.from_dict(row.variant), PROBLEM, INTERPRETER)
        assert row.timing is None


def test_failures_are_recorded_and_never_win(db: TuningDB) -> None:
    tiny = SMALL
    default = default_variant(tiny, INTERPRETER)
    ranked = [v for v in sorted(search_space(tiny, INTERPRETER), key=made_up_ms)
              if v != default]
    best, runner_up, third = ranked[:3]
    bench = FakeBench(tiny, wrong=[best], raises=[runner_up], compile_fails=[third, default])
    result = tune(bench, db, tiny, trials=10_000, batch=4)
    rows = {Variant.from_dict(r.variant): r for r in db.trials() if r.status != "pruned"}
    assert rows[best].status == "failed" and rows[best].reason.startswith("wrong answer")
    assert rows[best].error == 0.5 and rows[best].bound == 0.01
    assert rows[runner_up].status == "failed" and "OutOfResources" in rows[runner_up].reason
    assert rows[third].reason == rows[default].reason == "compile: CompilationError: boom"
    assert third not in bench.measured  # a compile failure is not timed
    assert result.failed == 4
    assert result.best == ranked[3]
    assert result.winner.variant == result.best


def test_a_broken_compile_step_fails_its_batch_not_the_run(db: TuningDB) -> None:
    class Broken(FakeBench):
        def compile(self, variants: Sequence[Variant]) -> dict[Variant, str]:
            raise OSError("no space left on device")

    result = tune(Broken(), db, trials=5, batch=5)
    assert result.measured == result.failed == 5
    assert result.best is None and result.winner is None
    assert all("OSError" in r.reason for r in db.trials() if r.status == "failed")


def test_batches_are_compiled_together(db: TuningDB) -> None:
    bench = FakeBench()
    tune(bench, db, trials=12, batch=4)
    assert [len(b) for b in bench.compiled] == [4, 4, 4]


def test_a_plain_function_can_be_the_benchmark(db: TuningDB) -> None:
    fake = FakeBench()
    result = tune(FunctionBench(fake.measure), db, trials=4)  # type: ignore[arg-type]
    assert result.measured == 4 and result.best is not None and result.baseline is None


def test_every_variant_knob_is_searched() -> None:
    space = search_space(PROBLEM, INTERPRETER)
    knobs = knob_choices(space)
    assert set(knobs) == {f.name for f in fields(Variant)}
    for name, choices in knobs.items():
        assert set(choices) == {getattr(v, name) for v in space}


# ---- budget, seed, resume --------------------------------------------------------------


def test_same_seed_repeats_the_run(tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b", "c"):
        with TuningDB(tmp_path / f"{name}.db") as db:
            bench = FakeBench()
            tune(bench, db, trials=20, seed=7 if name != "c" else 8, batch=3)
            runs.append(bench.measured)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_timeout_stops_the_search(db: TuningDB) -> None:
    ticks = itertools.count()
    bench = FakeBench()
    result = tune(bench, db, timeout=10, clock=lambda: float(next(ticks)))
    assert 0 < result.measured < len(search_space(PROBLEM, INTERPRETER))


def test_a_cold_first_batch_is_still_measured(db: TuningDB) -> None:
    now = [0.0]

    class SlowCompile(FakeBench):
        def compile(self, variants: Sequence[Variant]) -> dict[Variant, str]:
            now[0] += 15.0  # a cold cache: the first batch's compiles outlast the budget
            return super().compile(variants)

    result = tune(SlowCompile(), db, timeout=10, batch=4, clock=lambda: now[0])
    assert result.measured == 1 and result.best is not None and result.winner is not None


def test_a_cold_batch_is_measured_even_where_resumed_rows_passed(db: TuningDB) -> None:
    # A re-tune after a template change: the key holds passed rows of kernels that did not
    # change, and the new candidates' compiles outlast the budget.
    tune(FakeBench(), db, trials=3)
    now = [0.0]

    class SlowCompile(FakeBench):
        def compile(self, variants: Sequence[Variant]) -> dict[Variant, str]:
            now[0] += 15.0
            return super().compile(variants)

    result = tune(SlowCompile(), db, timeout=10, batch=4, clock=lambda: now[0])
    assert result.resumed == 3 and result.measured == 1


def test_a_budget_is_required(db: TuningDB) -> None:
    with pytest.raises(ValueError):
        tune(FakeBench(), db)


def test_rerun_resumes_without_measuring_again(db: TuningDB) -> None:
    first = FakeBench(raises=[Variant("fa2", 64, 64, 4, 1)])
    done = tune(first, db, trials=12, seed=1)
    second = FakeBench()
    again = tune(second, db, trials=12, seed=1)
    assert again.resumed == done.measured == 12
    assert not set(first.measured) & set(second.measured)
    assert again.best == min(first.measured + second.measured, key=made_up_ms)
    measured_rows = [r for r in db.trials() if r.status != "pruned"]
    assert len(measured_rows) == 24  # nothing stored twice


def test_rows_stored_before_a_knob_existed_resume_as_its_default(db: TuningDB) -> None:
    """A knob added later (here: as if `pingpong` were new) leaves older rows without it in
    their JSON; they load with its default, so a re-run must count them as measured."""
    first = FakeBench()
    done = tune(first, db, trials=12, seed=1)
    for row in db.db["trials"].rows:
        knobs = json.loads(row["variant_json"])
        assert knobs.pop("pingpong") is False
        db.db["trials"].update(row["id"], {"variant_json": json.dumps(knobs, sort_keys=True)})
    second = FakeBench()
    again = tune(second, db, trials=12, seed=1)
    assert again.resumed == done.measured == 12
    assert not set(first.measured) & set(second.measured)
    assert len([r for r in db.trials() if r.status != "pruned"]) == 24


def test_remeasure_times_the_stored_variants_again_fastest_first(db: TuningDB) -> None:
    broken = default_variant(PROBLEM, INTERPRETER)  # measured first, so surely stored
    first = FakeBench(raises=[broken])
    tune(first, db, trials=12, seed=1)
    ok = sorted((v for v in first.measured if v != broken), key=made_up_ms)
    second = FakeBench()
    again = tune(second, db, trials=len(ok), seed=1, remeasure=True)
    assert second.measured == ok
    assert again.resumed == 1  # the failure stays known, not measured again
    assert again.best == ok[0]
    assert len([r for r in db.trials() if r.status != "pruned"]) == 12 + len(ok)


def test_other_shapes_in_the_bucket_are_measured_afresh(db: TuningDB) -> None:
    tune(FakeBench(), db, trials=5)
    other = PROBLEM.with_(batch=4)  # same key, different exact problem
    result = tune(FakeBench(other), db, other, trials=5)
    assert result.resumed == 0 and result.measured == 5


def test_earlier_winners_are_enqueued_for_similar_problems(db: TuningDB) -> None:
    longer = PROBLEM.with_(seq_q=512, seq_k=512)  # another bucket of the same family
    default = default_variant(longer, INTERPRETER)
    first = tune(FakeBench(compile_fails=[default]), db, trials=30, seed=2)
    assert first.best not in (None, default)
    bench = FakeBench(longer)
    tune(bench, db, longer, trials=3, seed=5)
    assert bench.measured[:2] == [default, first.best]


def test_the_hopper_portfolio_is_measured_right_after_the_default(db: TuningDB) -> None:
    hopper = DeviceInfo("H-test", (9, 0), 132, 232448)
    problem = Problem(2, 8, 8, 2048, 2048, 128)
    picks = portfolio(problem, hopper)
    assert picks and all(why_invalid(v, problem, hopper) is None for v in picks)
    bench = FakeBench(problem)
    tune_problem(problem, bench, db, hopper, TuneOptions(trials=len(picks) + 3),
                 versions=VERSIONS)
    # The default (fa3 on Hopper) may lead the portfolio too: it is measured once.
    seeds = list(dict.fromkeys([default_variant(problem, hopper), *picks]))
    assert bench.measured[:len(seeds)] == seeds
    assert portfolio(problem, INTERPRETER) == []  # other devices sample from scratch


def test_progress_is_reported(db: TuningDB) -> None:
    seen: list[tuple[int, float | None]] = []
    tune(FakeBench(), db, trials=4,
         on_progress=lambda r: seen.append((r.measured, r.best_tflops)))
    assert [m for m, _ in seen[:4]] == [1, 2, 3, 4]
    assert all(t is not None for _, t in seen)


# ---- the real bench on the interpreter, and its gate -----------------------------------


@pytest.mark.interpreter
def test_kernel_bench_checks_and_times_on_the_interpreter() -> None:
    tiny = Problem(1, 2, 1, 24, 40, 16, causal=True)
    bench = KernelBench(tiny, "cpu", seed=0)
    assert bench.compile([Variant("fa2", 16, 16, 2, 1)]) == {}
    m = bench.measure(Variant("fa2", 16, 16, 2, 1))
    assert m.status == "ok", m.reason
    assert m.timing.median_ms > 0 and m.tflops > 0 and m.error <= m.bound
    assert bench.baseline().backend == "cpu"


def test_gate_is_the_problem_itself_when_cheap() -> None:
    assert gate_problem(PROBLEM) == PROBLEM


@pytest.mark.parametrize("shape", ["16,32,32,1024,1024,64", "1,64,8,16384,16384,128",
                                   "1,8,8,5000,4990,64", "2,32,8,100,16384,128",
                                   "1,16,16,9000,3000,128"])
def test_gate_keeps_what_the_kernel_depends_on(shape: str) -> None:
    problem = Problem.parse(shape, "bf16", causal=True)
    gate = gate_problem(problem)
    assert gate.batch <= 2 and gate.heads_kv <= 2 and max(gate.seq_q, gate.seq_k) <= GATE_MAX_SEQ
    assert (gate.head_dim, gate.dtype, gate.causal, gate.group) == (
        problem.head_dim, problem.dtype, problem.causal, problem.group)
    for n, small in ((problem.seq_q, gate.seq_q), (problem.seq_k, gate.seq_k)):
        assert small % 768 == n % 768  # the partial last tile is the same (256 and 192 rows)
    sign = lambda a, b: (a > b) - (a < b)
    assert sign(gate.seq_q, gate.seq_k) == sign(problem.seq_q, problem.seq_k)


def test_gate_keeps_the_causal_offset_of_long_sequences() -> None:
    rng = random.Random(0)
    for _ in range(200):
        nq, nk = rng.randint(1200, 40000), rng.randint(1200, 40000)
        if abs(nq - nk) > 700:
            continue
        gate = gate_problem(Problem(8, 32, 8, nq, nk, 64))
        assert gate.seq_k - gate.seq_q == nk - nq


# ---- timing and presets ----------------------------------------------------------------


def test_timing_statistics() -> None:
    t = Timing.from_samples([5.0, 1.0, 2.0, 4.0, 3.0])
    assert (t.median_ms, t.reps) == (3.0, 5)
    assert t.p20_ms == pytest.approx(1.8) and t.p80_ms == pytest.approx(4.2)
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert time_cpu(lambda: sum(range(100)), reps=4).reps == 4


def test_fa_bench_is_the_papers_grid() -> None:
    problems = preset_problems("fa-bench", ["fp16"], [False])
    assert len(problems) == 12
    for p in problems:
        assert p.batch * p.seq_q == 16384 and p.heads_q * p.head_dim == 2048
        assert p.heads_q == p.heads_kv and p.seq_q == p.seq_k
    assert {p.head_dim for p in problems} == {64, 128}
    assert {p.seq_q for p in problems} == {512, 1024, 2048, 4096, 8192, 16384}


def test_model_presets_have_their_gqa() -> None:
    p = preset_problems("llama3-8b", ["bf16"], [True])[0]
    assert (p.heads_q, p.heads_kv, p.head_dim, p.dtype, p.causal) == (32, 8, 128, "bf16", True)
    assert {"llama3-70b", "mistral-7b"} <= set(PRESETS)


def test_the_vit_preset_holds_its_two_models_as_they_are() -> None:
    # Whole shapes, not a grid: neither batch is 16k tokens / N, and they share no heads.
    problems = preset_problems("vit", ["bf16"], [False, True])
    assert [(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim, p.causal)
            for p in problems] == [(64, 12, 12, 197, 197, 64, False),
                                   (64, 12, 12, 197, 197, 64, True),
                                   (256, 16, 16, 257, 257, 64, False),
                                   (256, 16, 16, 257, 257, 64, True)]


def test_expand_combines_and_dedupes() -> None:
    problems = expand(["1,2,1,32,32,16", "1,2,1,32,32,16"], ["tiny"], ["fp16", "fp32"],
                      parse_causal("both"))
    # The shape is also one of the preset's: listed once, where it first appears.
    assert len(problems) == len(set(problems)) == 4 * 2 * 2
    assert problems[0] == Problem(1, 2, 1, 32, 32, 16, "fp16", False)
    with pytest.raises(ValueError):
        parse_causal("maybe")
    with pytest.raises(ValueError):
        preset_problems("gpt-9", ["fp16"], [False])
