"""The search: one Optuna study per (device, problem, mode), fed by a `Bench`, recorded in the DB.

A mode is "fwd" (forward `Variant`s) or "bwd" (backward `BwdVariant`s); both are searched the
same way, through `spaces.space_of(mode)`, and stored under keys of their own mode.

Each study samples the categorical knobs with TPE (multivariate, grouped, seeded). Before
anything is sampled, the study is told every result the database already holds for this
problem under the current key (so a re-run resumes instead of measuring again), and the
default variant, the mode's portfolio of points known to do well on this kind of
device, and earlier winners of similar keys are enqueued so they are always
measured: the tuned result can then never be worse than what dispatch would pick untuned.

Trials are asked in batches so a batch can be compiled in parallel, then checked and timed
one at a time. An invalid point (a named rule of the mode's `why_invalid`) is told as pruned with
its reason; a variant that fails to compile, runs out of resources or gives a wrong answer
is told as failed. Both are stored as trials, and neither stops the run.

With `deterministic`, the search is limited to the mode's deterministic variants (the
backward's separate dQ mode; every forward is): the grid, the enqueued points and the
resumed rows hold no other, so the run's best is the fastest deterministic variant. The key's
winner is still the fastest correct row it holds; where that is not deterministic, dispatch
serves the key's fastest deterministic row under `torch.use_deterministic_algorithms`.

No variant is measured or stored twice for a problem (unless `remeasure`): before a batch is
measured, each variant is claimed in the database (`store.claims`); one stored since this
run began (by a tuner running beside it) is taken from there, one another tuner is
measuring right now is left to it, and a pruned point already stored is not stored again.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.distributions import CategoricalDistribution
from optuna.trial import Trial, TrialState

from flashgen.kernels.hardware import DeviceInfo
from flashgen.kernels.modes import AnyVariant, ModeSpace, space_of
from flashgen.kernels.problem import Problem
from flashgen.store import claims
from flashgen.store.current import kernel_hash_now
from flashgen.store.db import TrialRow, TuningDB, WinnerRow, now_stamp
from flashgen.store.keys import TuningKey, Versions
from flashgen.tune.baseline import Baseline
from flashgen.tune.fwd_bench import Bench, Measurement, describe_failure
from flashgen.tune.storage import ROW_ATTR, Shared, SharedStudy, row_of
from flashgen.tune.timing import gpu_lock


def knob_choices(points: list[AnyVariant],
                 variant_type: type[AnyVariant] | None = None) -> dict[str, tuple[Any, ...]]:
    """Every knob of `variant_type` (default: the type of the points) and the values it takes
    among `points`, in their order.

    Given the problem's valid points, the sampler's grid shrinks to values that can work
    (a 32-long sequence never samples 256-row tiles), while the rules of `space` still prune
    the combinations that cannot. Knobs come from the dataclass, so a knob added to the
    search space is searched without touching the tuner.
    """
    variant_type = variant_type or type(points[0])
    return {f.name: tuple(dict.fromkeys(getattr(v, f.name) for v in points))
            for f in fields(variant_type)}


#: Asks in a row that bring nothing new (known, duplicate or invalid points) before an
#: unmeasured valid variant is enqueued: TPE on a small categorical space keeps proposing
#: its favourites once it has seen most of them.
MAX_STALE_ASKS = 32
#: How far past `timeout` a problem may run while none of its variants has passed yet.
OVERTIME = 4
#: Earlier winners enqueued for a new problem, nearest keys first.
MAX_ENQUEUED_WINNERS = 8
#: A hard stop for one study: this many asks per point of its grid, plus a full stale
#: stretch per valid point. Every stuck stretch enqueues a new valid point, so it is never
#: reached unless something is broken; then the run ends instead of spinning. (The stretches
#: matter on small grids: 8 points, as the backward space of a 16-long problem has, would
#: otherwise allow fewer asks than one stretch.)
MAX_ASKS_PER_POINT = 4
#: Seconds to wait when every variant of a batch is being measured by another tuner.
CLAIM_POLL_S = 0.2
#: `MAX_STALE_ASKS` for a study in a shared storage, where every ask is a stored trial.
SHARED_STALE_ASKS = 4


@dataclass(frozen=True)
class Outcome:
    """What is known about one variant of the problem being tuned."""

    status: str  # "ok", "failed" or "pruned"
    median_ms: float | None = None
    tflops: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class TuneOptions:
    """How one problem is searched: which pass, the budget, the sampler's seed, and whether
    stored timings are taken again. One object, so callers and tests name what they change."""

    mode: str = "fwd"
    trials: int | None = None  # new measurements; pruned and resumed points are free
    timeout: float | None = None  # seconds for this problem
    seed: int = 0
    batch: int = 1  # trials asked and compiled together, then measured one by one
    remeasure: bool = False  # time the stored variants again first, fastest first
    exhaustive: bool = False  # measure every valid variant, in the space's order
    deterministic: bool = False  # only variants whose results are bitwise equal run to run


@dataclass(frozen=True)
class RunOptions:
    """How a `flashgen tune` run goes over its problems: where, with which budget and seed,
    which passes, into which database. One object, so the CLI's run takes one argument."""

    device_type: str = "cuda"  # cuda, or cpu for the Triton interpreter
    gpu: int = 0
    trials: int | None = None
    timeout: float | None = None
    seed: int = 0
    compile_workers: int = 1
    db_path: Path | None = None
    modes: tuple[str, ...] = ("fwd",)
    remeasure: bool = False
    wide: bool = False
    exhaustive: bool = False
    deterministic: bool = False


@dataclass
class TuneResult:
    """The state of one problem's tuning; updated in place while it runs (for progress)."""

    problem: Problem
    key: TuningKey
    trials_budget: int | None
    best: AnyVariant | None = None
    best_ms: float | None = None
    best_tflops: float | None = None
    measured: int = 0  # variants checked and timed (or failed) in this run
    failed: int = 0
    pruned: int = 0
    resumed: int = 0  # results taken from the database instead of measured again
    seconds: float = 0.0
    baseline: Baseline | None = None
    winner: WinnerRow | None = None  # the key's winner after this run (any problem in it)
    last: str = ""  # a line about the latest trial
    outcomes: dict[str, Outcome] = field(default_factory=dict, repr=False)

    @property
    def speedup(self) -> float | None:
        """Times faster than torch SDPA's best backend on this problem and device."""
        if self.baseline is None or not self.best_ms:
            return None
        return self.baseline.timing.median_ms / self.best_ms

    @property
    def mode(self) -> str:
        return self.key.mode

    def note(self, variant_json: str, outcome: Outcome) -> None:
        """Remember `outcome` and keep the best so far."""
        self.outcomes[variant_json] = outcome
        if outcome.status == "ok" and outcome.median_ms is not None and (
                self.best_ms is None or outcome.median_ms < self.best_ms):
            self.best = space_of(self.mode).from_json(variant_json)
            self.best_ms, self.best_tflops = outcome.median_ms, outcome.tflops


def make_sampler(seed: int) -> optuna.samplers.TPESampler:
    """TPE over the categorical knobs, modelling them jointly (multivariate, grouped)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(multivariate=True, group=True, seed=seed,
                                          constant_liar=True)


def _tell(study: optuna.Study, trial: Trial, outcome: Outcome) -> None:
    if outcome.status == "ok":
        study.tell(trial, outcome.median_ms)
    elif outcome.status == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)


def _outcome_of_row(row: TrialRow) -> Outcome:
    median = row.timing.median_ms if row.timing else None
    return Outcome(row.status, median, row.tflops, row.reason)


def _variant_of(space: ModeSpace, row: TrialRow) -> AnyVariant | None:
    """The variant a stored row measured, or None if this code can no longer build it."""
    try:
        return space.variant_type.from_dict(row.variant)
    except (TypeError, ValueError):
        return None


def _resume(study: optuna.Study, result: TuneResult, rows: dict[str, TrialRow],
            problem: Problem, device: DeviceInfo, knobs: dict[str, tuple[Any, ...]],
            space: ModeSpace, add: bool = True) -> None:
    """Tell the study what earlier runs measured, so it is neither measured nor sampled
    blindly again. Rows of variants this code cannot build or no longer allows (the
    validity rules may have changed since) are left out. A row stored before a knob existed
    counts as that knob's default, as it loads: it is the same kernel. `add=False` only
    notes them: a shared study that another worker created holds its own copy."""
    latest: dict[str, tuple[AnyVariant, TrialRow]] = {}
    for row in sorted(rows.values(), key=lambda r: r.id):
        variant = _variant_of(space, row)
        if variant is not None:
            latest[variant.to_json()] = (variant, row)
    for variant_json, (variant, row) in latest.items():
        outcome = _outcome_of_row(row)
        if outcome.status == "ok" and outcome.median_ms is None:
            continue
        if space.why_invalid(variant, problem, device) is not None:
            continue
        result.note(variant_json, outcome)
        result.resumed += 1
        params = variant.to_dict()
        if not add:
            continue
        if set(params) != set(knobs) or any(params[k] not in knobs[k] for k in knobs):
            continue  # stored under an older grid: kept as a known outcome only
        state = TrialState.COMPLETE if outcome.status == "ok" else TrialState.FAIL
        study.add_trial(optuna.trial.create_trial(
            params=params, state=state,
            distributions={k: CategoricalDistribution(c) for k, c in knobs.items()},
            value=outcome.median_ms if state == TrialState.COMPLETE else None))


def _seeds(problem: Problem, device: DeviceInfo, db: TuningDB, versions: Versions,
           space: ModeSpace) -> list[AnyVariant]:
    """The default variant, the mode's portfolio for this device, then earlier winners of the
    same mode, dtype, head dim and mask on this device and versions, nearest sequence buckets
    and GQA ratio first."""
    key = TuningKey.for_problem(problem, device, space.mode, versions)
    similar = [w for w in db.load_winners(device.key, versions.triton, mode=space.mode,
                                          torch_version=versions.torch)
               if (w.key.dtype, w.key.head_dim, w.key.causal)
               == (key.dtype, key.head_dim, key.causal)]

    def distance(w: WinnerRow) -> tuple[float, int]:
        buckets = (abs(math.log2(w.key.seq_q_bucket / key.seq_q_bucket))
                   + abs(math.log2(w.key.seq_k_bucket / key.seq_k_bucket)))
        return buckets, int(w.key.gqa != key.gqa)

    similar.sort(key=distance)
    seeds = [space.default(problem, device), *space.portfolio(problem, device)]
    seeds += [w.variant for w in similar[:MAX_ENQUEUED_WINNERS]]
    return list(dict.fromkeys(seeds))


def tune_problem(
    problem: Problem,
    bench: Bench,
    db: TuningDB,
    device: DeviceInfo,
    options: TuneOptions,
    *,
    versions: Versions | None = None,
    run_id: str | None = None,
    on_progress: Callable[[TuneResult], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    shared: Shared | None = None,
) -> TuneResult:
    """Search `options.mode`'s variants of `problem` on `device`; every trial goes to `db`.

    `bench` measures that mode's variants: `KernelBench` for "fwd", `BwdKernelBench` for
    "bwd". `versions` default to the running ones.

    Budget: `trials` new measurements (pruned and resumed points are free) and/or `timeout`
    seconds; the search also ends when every valid variant has been measured. `batch`
    trials are asked and compiled together before they are measured one by one.

    `remeasure`: the variants this key already holds a timing for are measured again, fastest
    stored first, before anything new is sampled (they count toward `trials`). For timings
    taken by a flawed timer: the old rows stay as history, and the winner is still the best
    row, which a flaw that only ever added time (as the host-gap one did) cannot spoil.

    `exhaustive`: every valid variant is enqueued, in the space's order, and measured (no
    budget needed; a re-run resumes where it stopped).

    `shared`: the study lives in a shared Optuna storage (`tune.storage`) with the other
    workers of this problem: they share `trials` (per campaign), see each other's trials,
    never measure a variant twice, and each trial carries its row for `tune.pull`.
    """
    mode, trials, timeout = options.mode, options.trials, options.timeout
    seed, batch, remeasure = options.seed, options.batch, options.remeasure
    if trials is None and timeout is None and not options.exhaustive:
        raise ValueError("give a budget: trials, timeout, or both")
    if remeasure and shared is not None:
        raise ValueError("remeasure runs in one process: it cannot share a storage")
    if trials is not None and trials < 0:
        raise ValueError(f"trials must be >= 0, got {trials}")
    space = space_of(mode)
    versions = versions or Versions.current()
    run_id = run_id or uuid.uuid4().hex[:12]
    key = TuningKey.for_problem(problem, device, mode, versions)
    result = TuneResult(problem, key, trials)
    start = clock()
    together = shared.study(key, problem, make_sampler(seed)) if shared else None
    study = together.study if together else optuna.create_study(
        direction="minimize", sampler=make_sampler(seed), study_name=key.id)
    leader = together is None or together.created  # who fills the study's history and queue
    wanted: Callable[[AnyVariant], bool] = (
        space.deterministic if options.deterministic else lambda v: True)
    valid = {v.to_json(): v for v in space.points(problem, device) if wanted(v)}
    # From the wanted points only: with `deterministic`, dq_mode's one choice is "separate".
    knobs = knob_choices(list(valid.values()), space.variant_type)
    stored = {j: r for j, r in db.measured(key, problem).items()
              if (v := _variant_of(space, r)) is not None and wanted(v)}
    again: list[AnyVariant] = []
    if remeasure:
        timed = sorted((r for r in stored.values() if r.status == "ok" and r.timing),
                       key=lambda r: r.timing.median_ms if r.timing else math.inf)
        again = [v for v in (_variant_of(space, r) for r in timed) if v is not None]
        stored = {j: r for j, r in stored.items() if r.status != "ok"}
    _resume(study, result, stored, problem, device, knobs, space, add=leader)
    if together is not None:
        _learn(together, result, valid)
    resumed = set(result.outcomes)
    if on_progress and result.resumed:
        on_progress(result)  # the resumed best, before anything is measured (or interrupted)
    seeds = [*again, *_seeds(problem, device, db, versions, space)]
    if options.exhaustive:
        seeds += list(valid.values())
    for variant in dict.fromkeys(seeds) if leader else ():
        if variant.to_json() not in result.outcomes and wanted(variant) and space.why_invalid(
                variant, problem, device) is None:
            study.enqueue_trial(variant.to_dict())
    rng = random.Random(seed)
    over = False  # the campaign's shared budget is spent

    def budget_left() -> bool:
        if trials is not None and result.measured >= trials:
            return False
        if timeout is None:
            return True
        # A cold compile cache can spend a short budget on the first batch alone: until a
        # variant has passed in this run, the timeout stretches (up to OVERTIME x) rather
        # than end the run on candidates it compiled and never measured. Resumed rows do not
        # count: after a template change a key may hold only the rows of kernels that did
        # not change, and a re-tune then measured none of the new ones (docs/tuning.md).
        passed = any(o.status == "ok" for j, o in result.outcomes.items() if j not in resumed)
        return clock() - start < (timeout if passed else OVERTIME * timeout)

    def record(variant: AnyVariant, outcome: Outcome, m: Measurement | None = None,
               once: bool = False, asked: list[Trial] | None = None) -> None:
        # One stamp for the row and its copy in the shared storage: `pull` into this
        # worker's own --db knows the copy by it (two stamps a moment apart made it a second
        # row).
        at = now_stamp()
        db.record_trial(key, problem, variant, outcome.status, reason=outcome.reason,
                        timing=m.timing if m else None, tflops=outcome.tflops,
                        error=m.error if m else None, bound=m.bound if m else None,
                        seed=seed, run_id=run_id, once=once, created_at=at)
        if together is not None and asked:
            kernel = None if outcome.status == "pruned" else kernel_hash_now(mode, variant,
                                                                             problem)
            # A worker slower than the grace period finds its trial failed as stale: the row
            # is in its own database, and `pull` misses only this copy of it.
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                asked[0].set_user_attr(ROW_ATTR, row_of(
                    variant.to_dict(), outcome.status, reason=outcome.reason,
                    timing=m.timing if m else None, tflops=outcome.tflops,
                    error=m.error if m else None, bound=m.bound if m else None, seed=seed,
                    run_id=run_id, kernel_hash=kernel, created_at=at))

    def tell(trial: Trial, outcome: Outcome) -> None:
        if together is None:
            _tell(study, trial, outcome)
            return
        # A worker slower than the grace period may find its trial failed as stale (and
        # enqueued again): the claims still keep its variant from being measured twice.
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            _tell(study, trial, outcome)
        together.told(trial)

    grid = math.prod(map(len, knobs.values()))
    stale, asks = 0, 0
    elsewhere: set[str] = set()  # variants other tuners were measuring when last asked
    max_asks = MAX_ASKS_PER_POINT * grid + (MAX_STALE_ASKS + 1) * len(valid)
    if options.exhaustive:
        max_asks += len(valid)  # every point is enqueued on top of the sampled asks
    # Every ask of a shared study is a stored trial: give up on a stuck sampler sooner.
    max_stale = MAX_STALE_ASKS if together is None else SHARED_STALE_ASKS
    while (budget_left() and not over and not valid.keys() <= result.outcomes.keys()
           and asks < max_asks):
        if together is not None:
            _learn(together, result, valid)  # what the other workers measured meanwhile
            if valid.keys() <= result.outcomes.keys():
                break
        want = max(1, min(batch, trials - result.measured if trials is not None else batch))
        pending: dict[str, tuple[AnyVariant, list[Trial]]] = {}
        while len(pending) < want and stale < max_stale and asks < max_asks:
            trial = together.ask() if together else study.ask()
            asks += 1
            variant = space.variant_type(**{name: trial.suggest_categorical(name, choices)
                                            for name, choices in knobs.items()})
            variant_json = variant.to_json()
            if variant_json in pending:
                pending[variant_json][1].append(trial)
                stale += 1
            elif variant_json in result.outcomes:
                tell(trial, result.outcomes[variant_json])
                stale += 1
            elif not wanted(variant):
                # The grid of wanted points' knobs samples none (determinism is one knob),
                # but a shared study may hold a point another campaign enqueued.
                tell(trial, Outcome("pruned", reason="not deterministic"))
                stale += 1
            elif reason := space.why_invalid(variant, problem, device):
                outcome = Outcome("pruned", reason=reason)
                # A pruned point is stored once per key.
                record(variant, outcome, once=True, asked=[trial])
                result.note(variant_json, outcome)
                result.pruned += 1
                tell(trial, outcome)
                stale += 1
            else:
                pending[variant_json] = (variant, [trial])
                stale = 0
        if not pending:
            if asks < max_asks:
                # The sampler is stuck on known points: hand it one it has not measured.
                unmeasured = [v for j, v in valid.items() if j not in result.outcomes]
                free = [v for v in unmeasured if v.to_json() not in elsewhere]
                if together is not None and not free:
                    time.sleep(CLAIM_POLL_S)  # the rest is being measured by others
                study.enqueue_trial(rng.choice(free or unmeasured).to_dict())
                stale = 0
            continue
        held: dict[str, int] = {}  # shared claims of this batch: variant JSON -> claim id
        try:
            if not remeasure:
                _take_claims(pending, db, key, problem, run_id, tell, result, elsewhere)
                if together is not None:
                    budget = None if options.exhaustive else trials
                    over = _take_shared_claims(pending, together, budget, tell, result,
                                               elsewhere, held)
                if not pending:
                    if not over:
                        time.sleep(CLAIM_POLL_S)  # all of it is being measured by others
                    continue
            _measure_batch(pending, bench, tell, result, record, budget_left, on_progress,
                           together, held)
        finally:
            if not remeasure:
                claims.release(db, key, run_id)
            if together is not None:
                together.release_all()
        if any(j in result.outcomes and result.outcomes[j].status == "ok" for j in pending):
            # Stored as it goes, so an interrupted run still leaves its best behind.
            result.winner = db.update_winner(key)

    result.baseline = _baseline(bench)
    if result.baseline is not None:
        db.record_baseline(device.key, problem, result.baseline.backend,
                           result.baseline.timing, versions.torch, mode)
        if together is not None:
            timing = result.baseline.timing
            together.set_baseline({"backend": result.baseline.backend,
                                   "median_ms": timing.median_ms, "p20_ms": timing.p20_ms,
                                   "p80_ms": timing.p80_ms, "reps": timing.reps})
    result.winner = db.update_winner(key)
    result.seconds = clock() - start
    if on_progress:
        on_progress(result)
    return result


def _take_claims(
    pending: dict[str, tuple[AnyVariant, list[Trial]]], db: TuningDB, key: TuningKey,
    problem: Problem, run_id: str, tell: Callable[[Trial, Outcome], None],
    result: TuneResult, elsewhere: set[str],
) -> None:
    """Keep in `pending` only the variants this run may measure, each claimed for it.

    A variant another run stored since this one started (a tuner running beside it) is
    taken from the database, as a resumed result. One another tuner is measuring right now
    is left to it: dropped from the batch with its trials untold (the sampler counts them as
    running) and noted in `elsewhere`; when it comes up again, its row is likely stored."""
    for variant_json, (variant, asked) in list(pending.items()):
        taken = claims.claim(db, key, problem, variant, run_id)
        if taken.ours:
            elsewhere.discard(variant_json)
            continue
        del pending[variant_json]
        if taken.row is None:
            elsewhere.add(variant_json)
            continue
        elsewhere.discard(variant_json)
        outcome = _outcome_of_row(taken.row)
        result.note(variant_json, outcome)
        result.resumed += 1
        for trial in asked:
            tell(trial, outcome)


#: How a trial another worker holds, or one over the budget, is told: FAIL, which TPE leaves
#: out of its model (a shared study cannot leave it running: its heartbeat stops).
_SKIPPED = Outcome("failed", reason="measured by another worker")


def _learn(together: SharedStudy, result: TuneResult, valid: dict[str, AnyVariant]) -> None:
    """Note the outcomes other workers stored since this one last looked."""
    for variant_json, known in together.measured().items():
        if variant_json in valid and variant_json not in result.outcomes:
            result.note(variant_json, Outcome(**known))
            result.resumed += 1


def _take_shared_claims(
    pending: dict[str, tuple[AnyVariant, list[Trial]]], together: SharedStudy,
    budget: int | None, tell: Callable[[Trial, Outcome], None], result: TuneResult,
    elsewhere: set[str], held: dict[str, int],
) -> bool:
    """`_take_claims` through the shared storage; claim ids go to `held`. True when the
    campaign's budget is spent (the batch's unclaimed variants are dropped)."""
    over = False
    for variant_json, (_, asked) in list(pending.items()):
        taken = together.claim(variant_json, budget) if not over else None
        if taken is not None and taken.kind == "ours" and taken.trial_id is not None:
            held[variant_json] = taken.trial_id
            elsewhere.discard(variant_json)
            continue
        del pending[variant_json]
        outcome = _SKIPPED
        if taken is None:
            pass
        elif taken.kind == "done" and taken.outcome is not None:
            outcome = Outcome(**taken.outcome)
            result.note(variant_json, outcome)
            result.resumed += 1
            elsewhere.discard(variant_json)
        elif taken.kind == "held":
            elsewhere.add(variant_json)
        else:
            over = True
        for trial in asked:
            tell(trial, outcome)
    return over


def _measure_batch(
    pending: dict[str, tuple[AnyVariant, list[Trial]]], bench: Bench,
    tell: Callable[[Trial, Outcome], None], result: TuneResult,
    record: Callable[..., None], budget_left: Callable[[], bool],
    on_progress: Callable[[TuneResult], None] | None,
    together: SharedStudy | None = None, held: dict[str, int] | None = None,
) -> None:
    variants = [v for v, _ in pending.values()]
    try:
        failures = bench.compile(variants)
    except Exception as exc:  # a broken compile step fails this batch, not the run
        failures = {v: describe_failure(exc) for v in variants}
    for variant_json, (variant, asked) in pending.items():
        if not budget_left():
            return  # the rest stay unmeasured (and untold): the next run samples afresh
        claim = (held or {}).get(variant_json)
        if together is not None and claim is not None and not together.still_ours(
                claim, variant_json):
            together.release(claim)
            for trial in asked:
                tell(trial, _SKIPPED)
            continue
        if variant in failures:
            m = Measurement.failed(f"compile: {failures[variant]}")
        else:
            try:
                with _holding(bench):
                    m = bench.measure(variant)
            except Exception as exc:
                m = Measurement.failed(describe_failure(exc))
        outcome = Outcome(m.status, m.timing.median_ms if m.timing else None, m.tflops,
                          m.reason)
        if outcome.status == "ok" and outcome.median_ms is None:
            outcome = Outcome("failed", reason="bench returned ok without a timing")
        record(variant, outcome, m, asked=asked)
        result.note(variant_json, outcome)
        result.measured += 1
        result.failed += outcome.status == "failed"
        if together is not None and claim is not None:
            together.complete(claim, vars(outcome))
        for trial in asked:
            tell(trial, outcome)
        result.last = (f"{variant}: {outcome.tflops:.3g} TFLOP/s" if outcome.status == "ok"
                       else f"{variant}: failed ({outcome.reason[:60]})")
        if on_progress:
            on_progress(result)


def _holding(bench: Bench) -> contextlib.AbstractContextManager[None]:
    """The lock on the bench's GPU, held while a variant is checked and timed (see
    `timing.gpu_lock`); nothing for a bench with no GPU."""
    device = getattr(bench, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return gpu_lock(device)
    return contextlib.nullcontext()


def _baseline(bench: Bench) -> Baseline | None:
    try:
        with _holding(bench):
            return bench.baseline()
    except Exception:  # no baseline is a missing column in the report, not a failed run
        return None
