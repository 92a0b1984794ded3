"""Tuning through a shared Optuna storage, against real components: a throwaway PostgreSQL 15
server (Debian's `postgresql` package; `.ci/run` installs it) and a journal file.

Workers are threads with `FakeBench`es where only the search is under test, spawned
processes where one must die (kill -9), and `flashgen tune --device cpu --workers 2` where
the whole command is.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from test_tuner import PROBLEM, SMALL, VERSIONS, FakeBench, fastest_valid, made_up_ms
from typer.testing import CliRunner

from flashgen.cli import app
from flashgen.kernels.fwd_space import search_space
from flashgen.kernels.hardware import INTERPRETER
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import Variant
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey
from flashgen.tune.pull import pull
from flashgen.tune.search import RunOptions, TuneOptions, TuneResult, tune_problem
from flashgen.tune.storage import (
    LEASE_ATTR,
    ROW_ATTR,
    Shared,
    StorageError,
    flashgen_studies,
    open_storage,
    study_name,
)
from flashgen.tune.workers import (
    WorkerPlan,
    _pump,
    describe_worker_error,
    parse_gpus,
    worker_main,
)

PG_BIN = Path("/usr/lib/postgresql/15/bin")
#: Short heartbeats, so a dead worker's trial fails within the test.
BEAT_S, GRACE_S = 1, 2
#: Where no worker is meant to die: a loaded CI machine can starve a heartbeat thread for
#: seconds, and a 2 s grace then fails live trials as stale.
CALM_GRACE_S = 30

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A PostgreSQL 15 cluster of its own, initdb'd in a temporary folder and served on a
    free local port until the module's tests end; yields its SQLAlchemy URL. initdb refuses
    to run as root, so the server runs as `nobody`, in a folder that user owns (outside
    pytest's, which only root may enter)."""
    if not (PG_BIN / "initdb").is_file():
        pytest.fail(f"no PostgreSQL server binaries in {PG_BIN}: apt-get install postgresql "
                    f"(.ci/run does)")
    root = Path(tempfile.mkdtemp(prefix="flashgen-postgres-"))
    data, log = root / "data", root / "server.log"
    user: list[str] = []
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chown(root, nobody.pw_uid, nobody.pw_gid)
        user = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                "--clear-groups"]
    def run(*args: str) -> None:
        done = subprocess.run([*user, *args], capture_output=True, text=True)
        assert done.returncode == 0, f"{args[0]} failed: {done.stderr}{done.stdout}"

    port = _free_port()
    try:
        run(str(PG_BIN / "initdb"), "-D", str(data), "-U", "flashgen", "--auth=trust",
            "-E", "UTF8", "--no-sync")
        run(str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        yield f"postgresql+psycopg://flashgen@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*user, str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate",
                        "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


_DATABASES = iter(range(1_000_000))


@pytest.fixture(params=["journal", "postgres"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty shared storage of each kind: a journal file, or a fresh PostgreSQL
    database on the module's server."""
    if request.param == "journal":
        return str(tmp_path / "studies.log")
    server = request.getfixturevalue("postgres")
    try:
        import psycopg
    except ImportError:  # not a skip: the README's install has it, and CI must run these
        pytest.fail("psycopg is missing: pip install -e '.[dev,distributed]' (the README's "
                    "install)")

    name = f"t{next(_DATABASES)}_{os.getpid()}"
    with psycopg.connect(server.replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.rsplit("/", 1)[0] + "/" + name


def _shared(url: str, worker: str, campaign: str = "c", version: str = "0.1.test",
            grace_s: int = CALM_GRACE_S) -> Shared:
    return Shared(open_storage(url, heartbeat_s=BEAT_S, grace_s=grace_s), version, campaign,
                  worker)


class _Slow(FakeBench):
    """A FakeBench whose measurement takes a few milliseconds, as a real one takes longer:
    without it one thread could take the whole budget before the others had asked once
    (seen on a loaded CI machine)."""

    def measure(self, variant: Any) -> Any:
        time.sleep(0.01)
        return super().measure(variant)


def _tune_together(url: str, db_path: Path, problem: Problem, workers: int,
                   bench: Callable[[Problem], FakeBench] = lambda p: _Slow(p),
                   **options: Any) -> tuple[list[FakeBench], list[TuneResult]]:
    """`workers` threads tuning `problem` through `url`, each with its FakeBench (made by
    `bench`) and its own connections, into one database file."""
    benches = [bench(problem) for _ in range(workers)]
    results: list[TuneResult] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        shared = _shared(url, f"w{i}")
        try:
            with TuningDB(db_path) as db:
                results.append(tune_problem(
                    problem, benches[i], db, INTERPRETER,
                    TuneOptions(seed=i, batch=2, **options), versions=VERSIONS,
                    run_id=f"run{i}", shared=shared))
        except BaseException as exc:
            errors.append(exc)
        finally:
            shared.close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return benches, results


def test_workers_share_the_budget_and_never_measure_a_variant_twice(
        storage_url: str, tmp_path: Path) -> None:
    # Two threads' first measurements wait for each other: one thread alone took all 12
    # trials in about 1 of 24 runs beside a loaded suite.
    benches, _ = _tune_together(storage_url, tmp_path / "tuning.db", PROBLEM, 3,
                                lambda p: _Paired(p, tmp_path, 2), trials=12)
    measured = [v for b in benches for v in b.measured]
    assert len(measured) == 12 == len(set(measured))  # the budget is the campaign's
    assert sum(bool(b.measured) for b in benches) >= 2  # and was spread
    with TuningDB(tmp_path / "tuning.db") as db:
        rows = [r for r in db.trials() if r.status != "pruned"]
        assert len(rows) == 12
        winner = db.update_winner(rows[0].key)
        # Fastest of all measured (made_up_ms ties knobs it ignores, so compare times).
        assert winner is not None
        assert made_up_ms(winner.variant) == min(map(made_up_ms, measured))

    # Everything the workers stored locally can be rebuilt from the storage alone.
    with TuningDB(tmp_path / "pulled.db") as pulled:
        report = pull(open_storage(storage_url), pulled, "0.1.test")
        again = pull(open_storage(storage_url), pulled, "0.1.test")
        assert report.studies == 1 and again.copied == 0
        with TuningDB(tmp_path / "tuning.db") as db:
            local = sorted((r.variant_json, r.status, r.reason, r.tflops, r.kernel_hash)
                           for r in db.trials())
        assert sorted((r.variant_json, r.status, r.reason, r.tflops, r.kernel_hash)
                      for r in pulled.trials()) == local
        assert pulled.all_winners()[0].variant == winner.variant


def test_an_exhaustive_sweep_by_several_workers_measures_each_variant_once(
        tmp_path: Path) -> None:
    # On the journal only: PostgreSQL's claims are tested above, and 98 variants through
    # it cost the suite 10 s.
    benches, _ = _tune_together(str(tmp_path / "studies.log"), tmp_path / "tuning.db",
                                SMALL, 3, exhaustive=True)
    measured = [v for b in benches for v in b.measured]
    assert sorted(map(str, measured)) == sorted(map(str, search_space(SMALL, INTERPRETER)))
    with TuningDB(tmp_path / "tuning.db") as db:
        winner = db.update_winner(db.trials()[0].key)
    # The same winner as one process measuring everything (test_tuner's exhaustive run).
    assert winner is not None and made_up_ms(winner.variant) == made_up_ms(fastest_valid(SMALL))


def test_studies_of_another_flashgen_version_are_never_mixed_in(tmp_path: Path) -> None:
    url = str(tmp_path / "studies.log")
    first = _shared(url, "a", version="0.1.old")
    with TuningDB(tmp_path / "old.db") as db:
        tune_problem(PROBLEM, FakeBench(), db, INTERPRETER, TuneOptions(trials=4),
                     versions=VERSIONS, shared=first)
    first.close()
    second = _shared(url, "b", version="0.1.new")
    with TuningDB(tmp_path / "new.db") as db:
        result = tune_problem(PROBLEM, FakeBench(), db, INTERPRETER, TuneOptions(trials=4),
                              versions=VERSIONS, shared=second)
    second.close()
    assert result.resumed == 0 and result.measured == 4  # nothing taken from the old study
    key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd", VERSIONS)
    names = {s.study_name for s in optuna.get_all_study_summaries(open_storage(url))}
    assert study_name(key, PROBLEM, "0.1.old") in names
    assert study_name(key, PROBLEM, "0.1.new") in names
    with TuningDB(tmp_path / "pulled.db") as pulled:
        report = pull(open_storage(url), pulled, "0.1.new")
        assert report.other_versions == 1 and report.studies == 1
        assert len([r for r in pulled.trials() if r.status == "ok"]) == 4


# ---- a worker killed with kill -9 ------------------------------------------------------


class _Hangs(FakeBench):
    """Measures two variants, then hangs in the third, after naming it in $HANG_MARK."""

    def measure(self, variant: Variant) -> Any:
        if len(self.measured) == 2:
            Path(os.environ["HANG_MARK"]).write_text(variant.to_json())
            time.sleep(600)
        return super().measure(variant)


def hanging_bench(mode: str, problem: Problem, *args: Any) -> _Hangs:
    return _Hangs(problem)


def test_a_killed_worker_loses_only_its_running_trial(
        storage_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    mark = tmp_path / "hang"
    monkeypatch.setenv("HANG_MARK", str(mark))
    db_path = tmp_path / "tuning.db"
    run = RunOptions("cpu", trials=10, db_path=db_path)
    plan = WorkerPlan((PROBLEM,), run, storage_url, "doomed", "0.1.test", BEAT_S, GRACE_S,
                      hanging_bench)
    context = multiprocessing.get_context("spawn")
    report = context.Queue()  # held here: the child unpickles it after start() returns
    worker = context.Process(target=worker_main, args=(0, None, plan, report))
    worker.start()
    deadline = time.monotonic() + 120
    while not mark.exists() and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mark.exists(), "the worker never reached its third measurement"
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    hung = Variant.from_json(mark.read_text())
    # The survivor judges staleness with a wider grace than the dead worker's: with 2 s, a
    # survivor starved for a second on a loaded machine failed its own running trial.
    survivor_grace = 5
    time.sleep(survivor_grace + 1)  # the dead worker's heartbeat is now stale

    with TuningDB(db_path) as db:
        before = [Variant.from_dict(r.variant) for r in db.trials() if r.status == "ok"]
        assert len(before) == 2 and hung not in before  # its finished trials are stored
        shared = _shared(storage_url, "survivor", campaign="again", grace_s=survivor_grace)
        bench = FakeBench()
        tune_problem(PROBLEM, bench, db, INTERPRETER, TuneOptions(trials=3, seed=5),
                     shared=shared)
        shared.close()
    assert bench.measured[0] == hung  # the dead trial, retried, is measured first
    assert not set(bench.measured) & set(before)  # the finished ones are not
    storage = open_storage(storage_url)
    study = optuna.load_study(study_name=next(
        s.study_name for s in optuna.get_all_study_summaries(storage)
        if not s.study_name.endswith(" claims")), storage=storage)
    states = {}
    for trial in study.get_trials(deepcopy=False):
        if all(trial.params.get(k) == v for k, v in hung.to_dict().items()):
            states.setdefault(trial.state, []).append(trial)
    assert len(states[TrialState.FAIL]) >= 1 and len(states[TrialState.COMPLETE]) == 1
    assert ROW_ATTR in states[TrialState.COMPLETE][0].user_attrs
    assert not [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]


def test_the_parent_polls_its_workers_while_their_messages_keep_coming() -> None:
    """A worker killed while the others keep reporting is reaped within a poll: until then
    its pid still answers and the variant it was measuring stays claimed (a live run then
    never measures it again). The queue here never runs dry for 0.3 s."""
    class Busy:
        def __init__(self) -> None:
            self.left = 30

        def get(self, timeout: float) -> tuple:
            if not self.left:
                raise __import__("queue").Empty
            self.left -= 1
            time.sleep(0.01)
            return ("progress", 1, None)

        def get_nowait(self) -> tuple:
            return self.get(0.0)

    class Worker:
        def __init__(self, busy: Busy) -> None:
            self.busy = busy
            self.polls: list[int] = []  # messages still to come at each poll

        def is_alive(self) -> bool:
            self.polls.append(self.busy.left)
            return False

    busy = Busy()
    worker = Worker(busy)
    handled: list[tuple] = []
    _pump(busy, [worker], handled.append, poll_s=0.05)
    assert len(handled) == 30
    assert any(left > 0 for left in worker.polls), worker.polls  # polled while busy


def test_a_worker_killed_by_a_signal_is_heard_of_at_the_poll_that_reaps_it() -> None:
    """Its progress line ran on (clock and all) until the whole run ended; a worker that
    ended on its own (exit 0) is not reported as killed, and a killed one once."""
    import queue

    class Quiet:
        def __init__(self) -> None:
            self.gets = 0

        def get(self, timeout: float) -> tuple:
            self.gets += 1
            time.sleep(0.005)
            raise queue.Empty

        def get_nowait(self) -> tuple:
            raise queue.Empty

    class Worker:
        def __init__(self, code: int, alive_for: int, quiet: Quiet) -> None:
            self.code, self.alive_for, self.quiet = code, alive_for, quiet
            self.exitcode: int | None = None

        def is_alive(self) -> bool:
            if self.quiet.gets < self.alive_for:
                return True
            self.exitcode = self.code
            return False

    quiet = Quiet()
    workers = [Worker(0, 2, quiet), Worker(-9, 3, quiet), Worker(-15, 6, quiet)]
    heard: list[tuple[int, int, int]] = []
    _pump(quiet, workers, lambda m: None, poll_s=0.001,
          on_killed=lambda i, sig: heard.append((i, sig, quiet.gets)))
    assert [(i, sig) for i, sig, _ in heard] == [(1, 9), (2, 15)]
    assert heard[0][2] < 6  # heard of while worker 2 still ran


def test_a_message_that_lands_as_the_last_worker_ends_is_still_handled() -> None:
    """The queue is empty, then the poll finds every worker ended, but the last one's
    "done" landed in between: it is handled, not lost (the worker would read as killed)."""
    import queue

    class Late:
        def __init__(self) -> None:
            self.items: list[tuple] = []

        def get(self, timeout: float) -> tuple:
            raise queue.Empty

        def get_nowait(self) -> tuple:
            if not self.items:
                raise queue.Empty
            return self.items.pop(0)

    late = Late()

    class Ending:
        def is_alive(self) -> bool:
            late.items.append(("done", 0, "ok", ""))
            return False

    handled: list[tuple] = []
    _pump(late, [Ending()], handled.append, poll_s=0.01)
    assert handled == [("done", 0, "ok", "")]


def _when_made(mark: Path, action: Callable[[], None]) -> None:
    """Call `action` from a thread once a worker has written `mark` (not after 120 s: the
    test then fails on its own terms)."""

    def watch() -> None:
        deadline = time.monotonic() + 120
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if mark.exists():
            action()

    threading.Thread(target=watch, daemon=True).start()


def _hung_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, campaign: str,
               signal_once_hung: Callable[[], None]) -> WorkerPlan:
    """A plan whose workers hang for 600 s in their third measurement, and a thread that
    calls `signal_once_hung` when the first of them does (or after 120 s: the test then
    fails on its own terms)."""
    mark = tmp_path / "hang"
    monkeypatch.setenv("HANG_MARK", str(mark))
    _when_made(mark, signal_once_hung)
    run = RunOptions("cpu", trials=10, db_path=tmp_path / "tuning.db")
    return WorkerPlan((PROBLEM,), run, str(tmp_path / "studies.log"), campaign, "0.1.test",
                      BEAT_S, GRACE_S, hanging_bench)


def test_an_interrupt_of_the_parent_alone_stops_its_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As `timeout -s INT` sends it: to the parent only, not the process group. The workers
    # hang for 600 s in a measurement; only a forwarded interrupt ends them sooner.
    from flashgen.tune.workers import run_workers

    plan = _hung_plan(tmp_path, monkeypatch, "stop",
                      lambda: os.kill(os.getpid(), signal.SIGINT))
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_workers(plan, [None, None])
    assert time.monotonic() - started < 150
    with TuningDB(tmp_path / "tuning.db") as db:
        assert len([r for r in db.trials() if r.status == "ok"]) >= 2  # nothing lost
        statuses = {r.status for r in db.runs()}
    assert "interrupted" in statuses and "running" not in statuses, statuses


class _Marked(FakeBench):
    """Measures a variant in 0.2 s, and names the third in $SLOW_MARK when it starts it."""

    def measure(self, variant: Variant) -> Any:
        if len(self.measured) == 2:
            Path(os.environ["SLOW_MARK"]).write_text("started")
        time.sleep(0.2)
        return super().measure(variant)


def marked_bench(mode: str, problem: Problem, *args: Any) -> _Marked:
    return _Marked(problem)


def test_an_interrupted_parent_hears_what_its_workers_measured_until_they_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGINT to the parent alone: the workers measure on through the grace period, and
    the counts the summary prints stopped at the interrupt while the database held more."""
    from flashgen.tune.workers import INTERRUPT_GRACE_S, run_workers

    mark = tmp_path / "slow"
    monkeypatch.setenv("SLOW_MARK", str(mark))
    _when_made(mark, lambda: os.kill(os.getpid(), signal.SIGINT))
    run = RunOptions("cpu", trials=200, db_path=tmp_path / "tuning.db")
    plan = WorkerPlan((PROBLEM,), run, str(tmp_path / "studies.log"), "slow", "0.1.test",
                      BEAT_S, GRACE_S, marked_bench)
    heard: dict[int, int] = {}
    with pytest.raises(KeyboardInterrupt):
        run_workers(plan, [None], lambda i, r: heard.__setitem__(i, r.measured))
    with TuningDB(tmp_path / "tuning.db") as db:
        stored = len([r for r in db.trials() if r.status == "ok"])
    # The grace period let it measure several more after the interrupt, the one it had
    # started and at least two after it (a 0.2 s measurement in a 3 s grace leaves room for
    # many, but a loaded CI machine spends most of it elsewhere: the count is a floor, not a
    # rate). They were heard of: all but, at most, the last, for the forwarded interrupt may
    # land between its row and its progress message.
    assert INTERRUPT_GRACE_S >= 5 * 0.2
    assert stored >= 3 + 2, stored
    assert list(heard) == [0] and stored - 1 <= heard[0] <= stored, (heard, stored)


def test_sigterm_to_the_workers_ends_their_runs_as_interrupted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As a batch scheduler's time limit sends it: to every process of the job. The workers
    # hang in a measurement; each records its run as interrupted and says so, not "killed".
    import multiprocessing

    from flashgen.tune.workers import run_workers

    def terminate_workers() -> None:
        # Only once both have started their runs (after setting their SIGTERM handler): a
        # worker still importing at start-up would die of the signal, not stop.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(sqlite3.OperationalError), contextlib.closing(
                    sqlite3.connect(f"file:{tmp_path / 'tuning.db'}?mode=ro", uri=True)) as db:
                if db.execute("select count(*) from runs").fetchone()[0] >= 2:
                    break
            time.sleep(0.1)
        for child in multiprocessing.active_children():
            if child.name.startswith("flashgen-worker-") and child.pid is not None:
                os.kill(child.pid, signal.SIGTERM)

    plan = _hung_plan(tmp_path, monkeypatch, "term", terminate_workers)
    started = time.monotonic()
    _, ends = run_workers(plan, [None, None])
    assert time.monotonic() - started < 150
    assert {end.status for end in ends} == {"interrupted"}, ends
    with TuningDB(tmp_path / "tuning.db") as db:
        statuses = {r.status for r in db.runs()}
    assert statuses == {"interrupted"}, statuses


# ---- workers lease problems -------------------------------------------------------------


def slow_bench(mode: str, problem: Problem, *args: Any) -> _Slow:
    return _Slow(problem)


class _Paired(_Slow):
    """A _Slow whose first measurement waits until `peers` workers (processes or threads)
    have begun one: on a loaded CI machine a worker started late found every problem led and
    finished by the other, and the test of their split failed."""

    def __init__(self, problem: Problem, folder: Path, peers: int) -> None:
        super().__init__(problem)
        self.folder, self.peers, self.waited = folder, peers, False

    def measure(self, variant: Any) -> Any:
        if not self.waited:
            self.waited = True
            (self.folder / f"began-{os.getpid()}-{threading.get_ident()}").touch()
            deadline = time.monotonic() + 120  # past it, the test's own checks fail
            while (len(list(self.folder.glob("began-*"))) < self.peers
                   and time.monotonic() < deadline):
                time.sleep(0.05)
        return super().measure(variant)


def paired_bench(folder: Path, peers: int, mode: str, problem: Problem, *args: Any) -> _Paired:
    return _Paired(problem, folder, peers)


def test_workers_lead_different_problems_and_pay_their_fixed_costs_once(
        tmp_path: Path) -> None:
    from flashgen.tune.storage import LEASE_ATTR
    from flashgen.tune.workers import run_workers

    problems = tuple(PROBLEM.with_(seq_q=n, seq_k=n) for n in (32, 48, 64, 80))
    url = str(tmp_path / "studies.log")
    run = RunOptions("cpu", trials=3, db_path=tmp_path / "tuning.db")
    plan = WorkerPlan(problems, run, url, "lease", "0.1.test", BEAT_S, CALM_GRACE_S,
                      partial(paired_bench, tmp_path, 2))
    results, ends = run_workers(plan, [None, None])
    assert [e.status for e in ends] == ["ok", "ok"]
    assert sorted(r.measured for r in results) == [3] * 4
    with TuningDB(tmp_path / "tuning.db") as db:
        rows = list(db.db["trials"].rows_where("status = 'ok'"))
    assert len(rows) == 12 == len({(r["problem_json"], r["variant_json"]) for r in rows})
    # Each problem is led by one worker; the other joins at most the problems still
    # running when it ran out of its own (without leases, both tuned all four).
    pairs = {(r["problem_json"], r["run_id"]) for r in rows}
    assert {run_id for _, run_id in pairs} == {plan.run_id(0), plan.run_id(1)}
    assert len(pairs) <= 6
    storage = open_storage(url)
    leases = [t for s in optuna.get_all_study_summaries(storage)
              if s.study_name.endswith(" claims")
              for t in optuna.load_study(study_name=s.study_name, storage=storage)
              .get_trials(deepcopy=False) if LEASE_ATTR in t.user_attrs]
    finished = [t for t in leases if t.state == TrialState.COMPLETE]
    assert len(finished) == 4 and all(t.state != TrialState.RUNNING for t in leases)


# ---- named campaigns: separately started invocations (hosts) join one --------------------


def test_a_named_campaign_shares_its_leases_and_its_budget_between_invocations(
        storage_url: str) -> None:
    key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd", VERSIONS)
    a, b = _shared(storage_url, "host-a", "nightly"), _shared(storage_url, "host-b", "nightly")
    other = _shared(storage_url, "host-c", "weekly")
    try:
        lease = a.lease(key, PROBLEM)
        assert lease.kind == "ours" and b.lease(key, PROBLEM).kind == "held"
        assert other.lease(key, PROBLEM).kind == "ours"  # another campaign leads its own
        a.end_lease(lease)
        assert b.lease(key, PROBLEM).kind == "done"  # a rerun finds it finished
        study = a.study(key, PROBLEM, optuna.samplers.RandomSampler())
        claimed = study.claim("variant-1", budget=2)
        assert claimed.kind == "ours"
        assert b.room(key, PROBLEM, 2) and not b.room(key, PROBLEM, 1)
        assert other.room(key, PROBLEM, 1)  # its budget is its own
    finally:
        for shared in (a, b, other):
            shared.close()


def _ok_rows(*paths: Path) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        with TuningDB(path) as db:
            rows += list(db.db["trials"].rows_where("status = 'ok'"))
    return rows


def test_hosts_joining_a_campaign_split_its_problems_and_a_rerun_does_nothing_new(
        tmp_path: Path) -> None:
    import queue

    from flashgen.kernels import presets
    from flashgen.store.keys import package_version

    # The command's problem for --shape 1,2,1,32,32,16, so that the command can rerun it.
    first = presets.expand(["1,2,1,32,32,16"], [], presets.parse_dtypes("fp16"),
                           presets.parse_causal("no"))[0]
    problems = (first, *(first.with_(seq_q=n, seq_k=n) for n in (48, 64)))
    url, version = str(tmp_path / "studies.log"), package_version("flashgen")

    def plan(campaign: str, db: str, problems: tuple[Problem, ...]) -> WorkerPlan:
        run = RunOptions("cpu", trials=3, db_path=tmp_path / db)
        # c is alone in its campaign; a and b must each lead something, whatever the load.
        bench = slow_bench if campaign == "weekly" else partial(paired_bench, tmp_path, 2)
        return WorkerPlan(problems, run, url, campaign, version, BEAT_S, CALM_GRACE_S, bench)

    # Hosts a and b, started separately, join campaign nightly; c runs one of its own on the
    # first problem. Each is the one worker of its invocation, in a thread: three spawned
    # processes each importing torch cost the test seconds, and the command below spawns one
    # anyway. (Each problem's search space alone costs a second of CPU: few problems.)
    plans = {"a": plan("nightly", "a.db", problems), "b": plan("nightly", "b.db", problems),
             "c": plan("weekly", "c.db", problems[:1])}
    said: dict[str, list[Any]] = {}

    def host(name: str) -> None:
        report: queue.Queue[Any] = queue.Queue()
        worker_main(0, None, plans[name], report)
        said[name] = [report.get() for _ in range(report.qsize())]

    threads = [threading.Thread(target=host, args=(h,)) for h in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(said[h][-1][:3] == ("done", 0, "ok") for h in plans), said
    assert plans["a"].run_id(0) != plans["b"].run_id(0)  # one campaign, two run ids
    assert plans["a"].run_id(0).startswith("nightly-")

    nightly = _ok_rows(tmp_path / "a.db", tmp_path / "b.db")
    weekly = _ok_rows(tmp_path / "c.db")
    # Each campaign spent its own budget, once per problem.
    assert sorted(Counter(r["problem_json"] for r in nightly).values()) == [3] * 3
    assert sorted(Counter(r["problem_json"] for r in weekly).values()) == [3]
    pairs = [(r["problem_json"], r["variant_json"]) for r in nightly + weekly]
    assert len(pairs) == len(set(pairs))  # across campaigns too, nothing measured twice
    # The hosts split the problems: each led some, and few were joined by both.
    led = {host: {r["problem_json"] for r in _ok_rows(tmp_path / f"{host}.db")}
           for host in "ab"}
    assert led["a"] and led["b"] and len(led["a"] & led["b"]) < len(problems)
    with TuningDB(tmp_path / "a.db") as db:
        assert [r.id for r in db.runs()] == [plans["a"].run_id(0)]
    storage = open_storage(url)
    leases = Counter(t.user_attrs[LEASE_ATTR] for s in optuna.get_all_study_summaries(storage)
                     if s.study_name.endswith(" claims")
                     for t in optuna.load_study(study_name=s.study_name, storage=storage)
                     .get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                     if LEASE_ATTR in t.user_attrs)
    assert leases == {"nightly": 3, "weekly": 1}  # each problem led once per campaign

    # Rerunning the finished campaign resumes it: nothing is left, and the command says so.
    result = CliRunner().invoke(app, [
        "tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--trials", "3",
        "--storage", url, "--campaign", "nightly", "--db", str(tmp_path / "again.db")])
    assert result.exit_code == 0, result.output
    assert "campaign nightly" in result.output
    assert "nothing new to tune: 1 problem(s)" in result.output
    # The worker's own line says why it measured nothing (off a terminal, as a plain line).
    assert "w0 cpu left fp16 f D16 g2 32 B1 H2: done by the campaign" in result.output
    said = " ".join(result.output.split())  # the notes are folded at 80 columns
    assert "already done by campaign nightly" in said
    assert "a campaign tunes a problem once" in said
    note = result.output[result.output.index("nothing new to tune"):]
    assert all(len(line) <= 80 for line in note.splitlines()), note
    with TuningDB(tmp_path / "again.db") as db:
        assert not db.trials()
        runs = db.runs()
        assert len(runs) == 1 and runs[0].status == "ok"
        assert runs[0].id.startswith("nightly-") and runs[0].id.endswith("-w0")


def test_the_summary_names_problems_whose_campaign_still_measures_elsewhere(
        tmp_path: Path) -> None:
    """A rerun right after a worker was killed ended short of --trials with status 0 and no
    word: the dead worker's claims counted toward the budget until they went stale."""
    from flashgen.cli import _running_elsewhere

    url = str(tmp_path / "studies.log")
    plan = WorkerPlan((PROBLEM,), RunOptions("cpu", trials=3), url, "nightly", "0.1.test")
    key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd", VERSIONS)
    result = TuneResult(PROBLEM, key, 2)
    assert _running_elsewhere(url, plan, [result]) == []  # nothing runs
    other = Shared(open_storage(url), plan.version, "nightly", "host-b-w0")
    try:
        sampler = optuna.samplers.RandomSampler(seed=0)
        held = other.study(key, PROBLEM, sampler).claim('{"block_m": 16}', 3)
        assert held.kind == "ours"
        (line,) = _running_elsewhere(url, plan, [result])
        assert line.startswith("1 problem(s) (") and "running elsewhere" in line
        elsewhere = WorkerPlan((PROBLEM,), RunOptions("cpu", trials=3), url, "weekly",
                               "0.1.test")
        assert _running_elsewhere(url, elsewhere, [result]) == []  # another campaign's
    finally:
        other.close()


def test_a_dead_local_workers_claims_fail_at_once_and_a_live_ones_hold(
        tmp_path: Path) -> None:
    """A rerun within the grace period of a worker killed on this host ended a trial short:
    the dead worker's claim counted toward the campaign's budget until its heartbeat went
    stale. A claim names its process; one of this host whose process is gone fails when
    the claims are next read, and one whose process lives (or of another host) still holds."""
    from flashgen.tune.storage import OWNER_ATTR

    url = str(tmp_path / "studies.log")
    key = TuningKey.for_problem(PROBLEM, INTERPRETER, "fwd", VERSIONS)
    sampler = optuna.samplers.RandomSampler(seed=0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = socket.gethostname()
    # Long grace: only the owner, never the heartbeat, can fail a claim in this test.
    killed = Shared(open_storage(url, grace_s=3600), "0.1.test", "nightly", "w-old")
    try:
        together = killed.study(key, PROBLEM, sampler)
        claims = {}
        for n, who in enumerate((f"{host} {dead.stdout.strip()}", f"{host} {alive.pid}",
                                 f"host-b {dead.stdout.strip()}")):
            claim = together.claim(f'{{"block_m": {16 << n}}}', 3)
            assert claim.kind == "ours"
            together.shared.storage.set_trial_user_attr(claim.trial_id, OWNER_ATTR, who)
            claims[who] = claim.trial_id
        # The budget of 3 is spent by the three claims until the dead one is seen for dead.
        assert killed.running(key, PROBLEM) == 2  # the dead local process's failed here
        states = {who: together.shared.storage.get_trial(i).state for who, i in claims.items()}
        assert list(states.values()) == [TrialState.FAIL, TrialState.RUNNING,
                                         TrialState.RUNNING]
        again = Shared(open_storage(url, grace_s=3600), "0.1.test", "nightly", "w-new")
        try:
            retaken = again.study(key, PROBLEM, sampler).claim('{"block_m": 16}', 3)
            assert retaken.kind == "ours"  # within budget: 2 live claims and this one
            assert again.study(key, PROBLEM, sampler).claim('{"block_m": 32}', 3).kind == (
                "held")  # the live process's claim stands
        finally:
            again.close()
    finally:
        killed.close()
        alive.kill()
        alive.wait()


def test_the_summary_names_the_problems_left_to_the_campaign() -> None:
    from flashgen.cli import _left_to_campaign
    from flashgen.tune.workers import WorkerEnd

    other, third = PROBLEM.with_(seq_q=128, seq_k=128), PROBLEM.with_(seq_q=64, seq_k=64)
    tuned = TuneResult(third, TuningKey.for_problem(third, INTERPRETER, "fwd", VERSIONS), 3)
    ends = [WorkerEnd(0, None, "ok", 0, skipped={PROBLEM: "held", other: "held"}),
            WorkerEnd(1, None, "ok", 0, skipped={PROBLEM: "done", third: "done"})]
    done, held = _left_to_campaign([PROBLEM, other, third], [tuned], ends, "nightly")
    # One worker found PROBLEM led, another found it done: done wins; `third` was tuned here.
    assert done.startswith("1 problem(s) (") and "already done by campaign nightly" in done
    assert held.startswith("1 problem(s) (") and "led by another worker" in held
    assert _left_to_campaign([PROBLEM], [], ends[1:], "n")[0].startswith("nothing new")


@pytest.mark.parametrize(("args", "needle"), [
    (["--campaign", "nightly"], "--campaign needs --storage"),
    (["--campaign", "", "--storage", "{url}"], "--campaign is empty"),
    (["--campaign", "night run", "--storage", "{url}"], "'night run': use only letters"),
    (["--campaign", "-x", "--storage", "{url}"], "starting with a letter or digit"),
    (["--campaign", "a/b", "--storage", "{url}"], "use only letters"),
    (["--campaign", "n" * 65, "--storage", "{url}"], "65 characters, at most 64"),
])
def test_a_bad_campaign_is_one_error_line(args: list[str], needle: str,
                                          tmp_path: Path) -> None:
    url = str(tmp_path / "studies.log")
    result = CliRunner().invoke(app, [
        "tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--db", str(tmp_path / "t.db"),
        *(a.format(url=url) for a in args)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --campaign") and needle in lines[0]
    assert not (tmp_path / "t.db").exists() and not Path(url).exists()  # nothing was started


# ---- the command -----------------------------------------------------------------------


def _flashgen(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flashgen.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.interpreter
def test_cpu_workers_tune_through_the_storage_and_pull_gathers_them(
        postgres: str, tmp_path: Path) -> None:
    # PostgreSQL only: the journal's workers run as processes in the kill -9 test, and
    # each run of the command costs the suite about 13 s of interpreter.
    storage_url = postgres
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["COLUMNS"] = "200"
    shape = ["--device", "cpu", "--shape", "1,2,1,32,32,16", "--storage", storage_url]
    tuned = _flashgen("tune", *shape, "--trials", "4", "--workers", "2",
                      "--db", str(tmp_path / "a.db"), env=env)
    assert tuned.returncode == 0, tuned.stderr + tuned.stdout
    assert "w0 cpu" in tuned.stderr and "w1 cpu" in tuned.stderr  # a line per worker
    with TuningDB(tmp_path / "a.db") as db:
        measured = [r for r in db.trials() if r.status != "pruned"]
        assert len(measured) == 4 == len({r.variant_json for r in measured})
        assert all(r.status == "ok" and r.error <= r.bound for r in measured)
        assert len({r.kernel_hash for r in measured}) == 4
        assert len(db.runs()) == 2 and {r.status for r in db.runs()} == {"ok"}

    pulled = _flashgen("pull", "--storage", storage_url, "--db", str(tmp_path / "p.db"),
                       env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert "winner" in pulled.stdout
    shown = _flashgen("show", "--db", str(tmp_path / "p.db"), "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    winners = json.loads(shown.stdout)
    assert len(winners) == 1 and winners[0]["current"] is True
    with TuningDB(tmp_path / "a.db") as a, TuningDB(tmp_path / "p.db") as p:
        assert sorted((r.variant_json, r.status, r.tflops) for r in p.trials()) == sorted(
            (r.variant_json, r.status, r.tflops) for r in a.trials())
        assert winners[0]["variant"] == a.all_winners()[0].variant.to_dict()
        held = len(a.trials())
    # Into a worker's own --db, pull copies nothing twice: its rows and their copies in the
    # storage carry one stamp (two stamps a moment apart made every ok row a second row).
    again = _flashgen("pull", "--storage", storage_url, "--db", str(tmp_path / "a.db"),
                      env=env)
    assert again.returncode == 0, again.stderr
    with TuningDB(tmp_path / "a.db") as a:
        assert len(a.trials()) == held
        assert {r.status for r in a.runs()} == {"ok"}  # its own runs keep their rows
    # A gathered file keeps its provenance: a "pulled" row for each run it copied from.
    with TuningDB(tmp_path / "a.db") as a, TuningDB(tmp_path / "p.db") as p:
        pulled = {r.id: r for r in p.runs()}
        assert pulled.keys() == {r.id for r in a.runs()}
        for run in a.runs():
            got = pulled[run.id]
            assert got.status == "pulled" and got.trials == run.trials
            assert got.gpu_name == run.gpu_name and got.command.startswith("flashgen pull")
            assert run.started_at <= got.started_at <= got.ended_at <= run.ended_at


# ---- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "needle"), [
    ("postgresql+psycopg://flashgen@127.0.0.1:{port}/nowhere", "cannot connect"),
    ("redis://localhost/0", "neither a journal file"),
    ("studies.txt", "neither a journal file"),
    ("/no/such/folder/studies.log", "does not exist"),
])
def test_a_bad_storage_is_one_error_line_before_any_work(
        url: str, needle: str, tmp_path: Path) -> None:
    url = url.format(port=_free_port())
    for command in (["tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--storage", url,
                     "--db", str(tmp_path / "t.db")],
                    ["pull", "--storage", url, "--db", str(tmp_path / "t.db")]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --storage") and needle in lines[0]
    assert not (tmp_path / "t.db").exists()  # nothing was tuned
    with pytest.raises(StorageError):
        open_storage(url)


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_storage_and_db_naming_one_file_is_refused_before_any_work(
        kind: str, tmp_path: Path) -> None:
    """The worker wrote each as the other's kind: a traceback, and a .log turned into an
    SQLite file."""
    path = tmp_path / ("x.log" if kind == "journal" else "x.db")
    url = str(path) if kind == "journal" else f"sqlite:///{path}"
    result = CliRunner().invoke(app, ["tune", "--device", "cpu", "--shape", "1,2,1,32,32,16",
                                      "--workers", "2", "--storage", url, "--db", str(path)])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert "name the same file" in line
    assert not path.exists()


def test_an_at_sign_in_a_storage_password_is_named_and_not_shown() -> None:
    """The driver split the URL at the first '@' and named the rest of the password as an
    unknown host."""
    with pytest.raises(StorageError, match="holds '@'; write it as %40") as caught:
        open_storage("postgresql+psycopg://fg:p@ss@127.0.0.1:1/fg")
    assert "p@ss" not in str(caught.value) and "ss@" not in str(caught.value)


def test_a_campaign_keeps_the_trials_of_its_first_invocation(tmp_path: Path) -> None:
    """Two invocations of one campaign with --trials 3 and 6 held the problems each led to
    its own budget (3 or 6 by who led), and a rerun with a larger --trials said nothing of
    it: the first invocation's budget is recorded, and another is a named error."""
    from flashgen.tune.storage import campaign_trials

    url = str(tmp_path / "studies.log")
    storage = open_storage(url)
    assert campaign_trials(storage, "nightly", 3) == 3  # the first: recorded
    assert campaign_trials(storage, "nightly", 6) == 3
    assert campaign_trials(storage, "weekly", None) is None  # --timeout alone
    assert campaign_trials(storage, "weekly", 4) is None
    result = CliRunner().invoke(app, [
        "tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--trials", "6",
        "--storage", url, "--campaign", "nightly", "--db", str(tmp_path / "t.db")])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line == ("error: campaign nightly runs --trials 3 (as its first invocation gave); "
                    "this one gave --trials 6. Give --trials 3, or a new --campaign")
    assert not (tmp_path / "t.db").exists()
    # Its record is no problem's study: pull gathers nothing from it.
    assert not list(flashgen_studies(open_storage(url, must_exist=True)))


def test_a_stale_journal_lock_is_removed_before_tuning_and_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tuner killed while writing leaves the open-lock file: every first write then
    waited out Optuna's 30 s grace period behind its raw warnings."""
    from flashgen.cli import _check_storage

    url = str(tmp_path / "studies.log")
    optuna.create_study(storage=open_storage(url), study_name="s")
    lock = Path(url + ".lock")
    lock.touch()
    _check_storage(url, tmp_path / "t.db")
    assert lock.exists()  # a fresh lock may be held: left alone
    old = time.time() - 3600
    os.utime(lock, (old, old))
    _check_storage(url, tmp_path / "t.db")
    assert not lock.exists()
    said = capsys.readouterr().err
    assert "removed the journal's stale lock file" in said and "(3600 s old" in said


def test_a_journal_ending_in_a_partial_line_is_refused_to_tuners_with_the_mend(
        tmp_path: Path) -> None:
    """A write cut short (a full disk, a crash) leaves a partial last line, which Optuna
    reads past; a tuner's next append glued onto it and made the journal unreadable to
    every host (`pull` included) until mended by hand."""
    url = str(tmp_path / "studies.log")
    optuna.create_study(storage=open_storage(url), study_name="s")
    whole = Path(url).stat().st_size
    with open(url, "ab") as f:
        f.write(b'{"op_code": 5, "worker_id": "x", "trial_id')
    result = CliRunner().invoke(app, ["tune", "--device", "cpu", "--shape", "1,2,1,32,32,16",
                                      "--storage", url, "--db", str(tmp_path / "t.db")])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert "ends in a partial line" in line and f"truncate -s {whole} " in line
    assert not (tmp_path / "t.db").exists()
    open_storage(url, must_exist=True)  # a reader (pull) still reads it, unchanged
    os.truncate(url, whole)  # the mend it names
    open_storage(url)


def test_a_line_another_tuner_is_appending_is_not_taken_for_a_torn_one(
        tmp_path: Path) -> None:
    """A host starting while another appends sees a partial last line for a moment: the
    tail is read again under the journal's lock, which the writer holds until its line is
    whole."""
    from optuna.storages.journal import JournalFileOpenLock

    from flashgen.tune.storage import check_journal_tail

    url = str(tmp_path / "studies.log")
    optuna.create_study(storage=open_storage(url), study_name="s")
    writer = JournalFileOpenLock(url)
    writer.acquire()
    with open(url, "ab") as f:
        f.write(b'{"op_code": 0, "worker_id": "x", ')
        f.flush()

        def finish() -> None:
            time.sleep(0.3)
            f.write(b'"study_name": "t", "directions": [1]}\n')
            f.flush()
            writer.release()

        thread = threading.Thread(target=finish)
        thread.start()
        check_journal_tail(url)  # waits for the lock, then finds the line whole
        thread.join()


def test_a_journal_a_tuner_cannot_write_is_named_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "studies.log")
    optuna.create_study(storage=open_storage(url), study_name="s")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: mode != os.W_OK and real(p, mode))
    with pytest.raises(StorageError, match="is not writable"):
        open_storage(url)
    open_storage(url, must_exist=True)  # reading needs no write


@pytest.mark.parametrize(("url", "hint"), [
    ("postgresql+psycopg://u:pw@127.0.0.1:1/x", "pip install 'flashgen[distributed]'"),
    ("mysql://u:pw@127.0.0.1:1/x", "install the SQLAlchemy driver"),
])
def test_a_missing_database_driver_is_named_with_what_installs_it(
        url: str, hint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Optuna re-raises a missing driver as a plain ImportError (the module not found is its
    cause); the error still names the driver, and the extra only where it brings it."""
    import flashgen.tune.storage as storage

    def missing(*args: Any, **kwargs: Any) -> None:
        try:
            raise ModuleNotFoundError("No module named 'drv'", name="drv")
        except ModuleNotFoundError as exc:
            raise ImportError("Failed to import DB access module for the specified "
                              "storage URL.") from exc

    monkeypatch.setattr(storage, "RDBStorage", missing)
    with pytest.raises(StorageError) as caught:
        open_storage(url)
    message = str(caught.value)
    assert "driver 'drv' is not installed" in message and hint in message
    assert "pw" not in message


def test_a_missing_gpu_is_one_error_line(tmp_path: Path) -> None:
    assert parse_gpus("all", 2) == [0, 1]
    assert parse_gpus("0,0", 1) == [0, 0]
    for text, visible, needle in (("0,3", 2, "no GPU 3 (2 visible)"), ("all", 0, "no CUDA"),
                                  ("one", 2, "give 'all'")):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            parse_gpus(text, visible)
    if shutil.which("nvidia-smi") is None:  # no GPU here: the command says so in one line
        result = CliRunner().invoke(app, ["tune", "--shape", "1,2,1,32,32,16",
                                          "--gpus", "0,1"])
        assert result.exit_code == 2
        assert result.output.strip() == "error: --gpus 0,1: no GPU 0, 1 (0 visible)"
        journal = tmp_path / "new.log"  # checked before the storage is opened (made)
        result = CliRunner().invoke(app, ["tune", "--shape", "1,2,1,32,32,16", "--gpus", "5",
                                          "--storage", str(journal)])
        assert result.exit_code == 2 and "no GPU 5" in result.output
        assert not journal.exists()


def test_storage_files_that_are_not_optuna_storages_are_refused_unchanged(
        tmp_path: Path) -> None:
    """An SQLite storage file that is a flashgen tuning database (both have a `trials`
    table), another program's database or not SQLite at all is refused in one line and left
    as it was; a journal that is not one is a named error, not a traceback; `pull` refuses a
    storage file that does not exist (opening one creates it)."""
    import sqlite3

    ours = tmp_path / "tuning.db"
    with TuningDB(ours):
        pass
    foreign = tmp_path / "notes.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE notes (x)")
    text = tmp_path / "text.db"
    text.write_text("hello\n")
    garbled = tmp_path / "build.log"
    garbled.write_text("garbage line\n")
    cases = {f"sqlite:///{ours}": "is a flashgen tuning database",
             f"sqlite:///{foreign}": "another program's SQLite database (it holds tables notes)",
             f"sqlite:///{text}": "is not an SQLite database",
             str(garbled): "is not an Optuna journal file"}
    before = {p: p.read_bytes() for p in (ours, foreign, text, garbled)}
    for url, needle in cases.items():
        for command in (["tune", "--device", "cpu", "--shape", "1,2,1,32,32,16", "--storage",
                         url, "--db", str(tmp_path / "t.db")],
                        ["pull", "--storage", url, "--db", str(tmp_path / "t.db")]):
            result = CliRunner().invoke(app, command)
            assert result.exit_code == 2, result.output
            lines = result.output.strip().splitlines()
            assert len(lines) == 1 and needle in lines[0], (url, result.output)
    assert {p: p.read_bytes() for p in before} == before
    missing = tmp_path / "typo.db"
    result = CliRunner().invoke(app, ["pull", "--storage", f"sqlite:///{missing}", "--db",
                                      str(tmp_path / "t.db")])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not missing.exists()
    open_storage(f"sqlite:///{tmp_path / 'fresh.db'}")  # a new file is the tuner's to make
    open_storage(f"sqlite:///{tmp_path / 'fresh.db'}", must_exist=True)  # an Optuna one


def test_worker_seeds_wrap_into_the_generators_range(tmp_path: Path) -> None:
    """Worker i seeds with the run's seed + i; at the top of --seed's range that wraps:
    worker 1 of a run seeded 2**32 - 1 tunes (unwrapped, its sampler refused the seed and
    the worker failed)."""
    import queue

    run = RunOptions("cpu", trials=2, seed=2**32 - 1, db_path=tmp_path / "tuning.db")
    plan = WorkerPlan((PROBLEM,), run, str(tmp_path / "studies.log"), "wrap", "0.1.test",
                      BEAT_S, GRACE_S, lambda mode, problem, *_: FakeBench(problem))
    said: queue.Queue[tuple[Any, ...]] = queue.Queue()
    worker = threading.Thread(target=worker_main, args=(1, None, plan, said))
    worker.start()  # a thread: pytest's own SIGTERM handling stays as it is
    worker.join(120)
    messages = [said.get_nowait() for _ in range(said.qsize())]
    assert messages[-1][:3] == ("done", 1, "ok"), messages[-1]
    result = CliRunner().invoke(app, ["tune", "--device", "cpu", "--shape", "1,2,1,32,32,16",
                                      "--seed", str(2**32)])
    assert result.exit_code == 2 and "--seed" in result.output
    if shutil.which("nvidia-smi") is None:
        result = CliRunner().invoke(app, ["tune", "--shape", "1,2,1,32,32,16", "--workers",
                                          "2"])
        assert result.exit_code == 2
        assert result.output.strip().startswith("error: no CUDA GPU is visible")


def test_workers_stop_when_their_parent_is_killed(tmp_path: Path) -> None:
    """A parent killed with SIGKILL (the OOM killer, a lost session) cannot forward an
    interrupt: its workers notice it is gone, stop as on SIGTERM, record their runs as
    interrupted and exit, where they tuned their whole budget unwatched and then hung at
    exit writing to the dead parent's pipe."""
    mark, db = tmp_path / "hang", tmp_path / "tuning.db"
    parent = tmp_path / "parent.py"
    parent.write_text(f"""
import os, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
os.environ["HANG_MARK"] = {str(mark)!r}
from test_distributed import BEAT_S, GRACE_S, PROBLEM, hanging_bench
from flashgen.tune.search import RunOptions
from flashgen.tune.workers import WorkerPlan, run_workers

if __name__ == "__main__":
    run = RunOptions("cpu", trials=10, db_path=Path({str(db)!r}))
    plan = WorkerPlan((PROBLEM,), run, {str(tmp_path / "studies.log")!r}, "orphan",
                      "0.1.test", BEAT_S, GRACE_S, hanging_bench)
    run_workers(plan, [None])
""")
    proc = subprocess.Popen([sys.executable, str(parent)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mark.exists(), "the worker never reached its hanging measurement"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        statuses: set[str] = {"running"}
        while "running" in statuses and time.monotonic() < deadline:
            time.sleep(0.5)
            with TuningDB(db) as database:
                statuses = {r.status for r in database.runs()}
        assert statuses == {"interrupted"}, statuses
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_killed_invocations_temporary_journal_is_swept_by_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `flashgen tune` killed with SIGKILL leaves its temporary journal folder; the next
    invocation removes it, once its owner is gone and its files are still, and nothing else."""
    import tempfile

    from flashgen.tune.storage import JOURNAL_OWNER, JOURNAL_PREFIX, temporary_journal

    dead = subprocess.Popen(["true"])
    dead.wait()  # a process id nobody holds now
    here = socket.gethostname()

    def folder(name: str, owner: str | None, age_s: float) -> Path:
        path = tmp_path / f"{JOURNAL_PREFIX}{name}"
        path.mkdir()
        (path / "studies.log").write_text("{}\n")
        if owner is not None:
            (path / JOURNAL_OWNER).write_text(owner)
        for p in (*path.iterdir(), path):
            os.utime(p, (time.time() - age_s,) * 2)
        return path

    swept = folder("old", f"{here} {dead.pid}\n", 600)
    kept = [folder("busy", f"{here} {dead.pid}\n", 5),  # an orphaned worker may write
            folder("live", f"{here} {os.getpid()}\n", 600),  # its owner runs
            folder("elsewhere", f"{here}-not {dead.pid}\n", 600),  # another host's
            folder("unnamed", None, 600),  # no owner named: not one of ours
            folder("garbled", "x", 600)]
    (tmp_path / f"{JOURNAL_PREFIX}file").write_text("not a folder")
    kept.append(tmp_path / f"{JOURNAL_PREFIX}file")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with temporary_journal() as url:
        ours = Path(url).parent
        assert ours.name.startswith(f"{JOURNAL_PREFIX}{os.getpid()}-") and ours.is_dir()
        assert (ours / JOURNAL_OWNER).read_text().split() == [here, str(os.getpid())]
        assert not swept.exists() and all(p.exists() for p in kept)
    assert not ours.exists()


def test_a_worker_that_joins_too_late_to_measure_says_it_left_the_problem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host b joins a problem host a leads, but a has claimed the whole budget meanwhile: b
    measures nothing and reports the problem left to its leader, so its progress line says
    why it sat at 0/N."""
    import queue

    url = str(tmp_path / "studies.log")
    second, b_done = threading.Event(), threading.Event()

    class Blocking(_Slow):
        """Holds a's second measurement (its whole budget claimed) until b has run."""

        calls = 0

        def measure(self, variant: Any) -> Any:
            Blocking.calls += 1
            if Blocking.calls == 2:
                second.set()
                b_done.wait(120)
            return super().measure(variant)

    # b sees room in the budget, as when a's last claim lands between its look and its ask.
    monkeypatch.setattr(Shared, "room", lambda self, *args: True)

    def plan(db: str, bench: Any) -> WorkerPlan:
        return WorkerPlan((PROBLEM,), RunOptions("cpu", trials=2, db_path=tmp_path / db), url,
                          "late", "0.1.test", BEAT_S, CALM_GRACE_S, bench)

    a_said: queue.Queue[Any] = queue.Queue()
    b_said: queue.Queue[Any] = queue.Queue()
    a = threading.Thread(target=worker_main, args=(
        0, None, plan("a.db", lambda mode, problem, *args: Blocking(problem)), a_said))
    a.start()
    try:
        assert second.wait(120), "host a never reached its second measurement"
        worker_main(1, None, plan("b.db", slow_bench), b_said)
    finally:
        b_done.set()
        a.join()
    said = [b_said.get() for _ in range(b_said.qsize())]
    assert ("skipped", 1, PROBLEM, "held") in said, said
    assert said[-1][:3] == ("done", 1, "ok")
    assert [m[2].measured for m in said if m[0] == "result"] == [0]


def test_a_worker_error_names_the_cause_at_the_bottom_of_its_chain() -> None:
    """A PostgreSQL server stopped mid-run reached the user as Optuna's wrapper alone,
    blaming "invalid data in the commit"; the connection error was only in tracebacks."""
    try:
        try:
            try:
                raise ConnectionRefusedError("connection to server at 127.0.0.1 refused")
            except ConnectionRefusedError as low:
                raise RuntimeError("(psycopg.OperationalError) wrapped") from low
        except RuntimeError:
            raise optuna.exceptions.StorageInternalError(
                "An exception is raised during the commit.\nThis typically happens due to "
                "invalid data in the commit") from None
    except optuna.exceptions.StorageInternalError as exc:
        caught: BaseException = exc
    # `from None` hides the chain from tracebacks but keeps __context__: walk it anyway.
    text = describe_worker_error(caught)
    assert text.startswith("StorageInternalError: An exception is raised during the commit.")
    assert text.endswith("(caused by ConnectionRefusedError: connection to server at "
                         "127.0.0.1 refused)")
    assert "\n" not in text
    assert describe_worker_error(ValueError("plain")) == "ValueError: plain"

