"""Worker processes: `flashgen tune --gpus 0,1` (one per GPU) or `--workers N` (N on one
device), all tuning the same problems through studies in one shared Optuna storage.

Every worker goes through the problems in the same order. A first pass leases each problem
to the first worker that asks (`Shared.lease`), so workers tune different problems and each
problem's fixed costs (inputs, reference, compiles, SDPA baseline) are paid once; a second
pass joins problems still being tuned whose budget has room, and takes over a dead worker's.
Workers on one problem share its study (`tune.storage`): the campaign's trial budget is
shared, TPE on each worker sees every trial, and claims keep any variant from being
measured twice. Each worker writes its trials,
winners and a `runs` row into the same `--db` (SQLite queues the writers), and reports its
progress to the parent through a queue, which shows one line per worker. A worker killed
with `kill -9` loses the trial it was measuring: its heartbeat stops, and another worker
measures that variant again.

A campaign is one invocation's by default (a random id). Invocations started separately,
say one per host, join one campaign by giving it a name (`flashgen tune --campaign NAME`):
they then share budgets and leases as one invocation's workers do, and each still writes
run ids of its own (`WorkerPlan.run_id`).

Processes are spawned, not forked: each imports torch and triton (or selects the
interpreter, from the inherited TRITON_INTERPRET) on its own, and opens its own storage and
database connections.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import re
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna

from flashgen.kernels.problem import Problem
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey
from flashgen.tune.fwd_bench import Bench
from flashgen.tune.search import RunOptions, TuneOptions, TuneResult, tune_problem
from flashgen.tune.storage import GRACE_S, HEARTBEAT_S, Shared, open_storage

#: Seeds numpy's and Optuna's generators take: 0 to 2**32 - 1; worker i seeds with the run's
#: seed + i, wrapped into that range.
SEEDS = 2**32

#: Makes the bench of one (mode, problem, device, seed, compile threads, db path).
BenchFactory = Callable[[str, Problem, Any, int, int, Path], Bench]


def parse_gpus(text: str, visible: int) -> list[int]:
    """GPU indices from `--gpus`: "all", or a comma-separated list (an index may repeat:
    "0,0" runs two workers on GPU 0). A GPU that is not visible is a ValueError."""
    if text.strip() == "all":
        if visible == 0:
            raise ValueError("--gpus all: no CUDA GPU is visible")
        return list(range(visible))
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpus {text!r}: give 'all' or GPU indices such as 0,1") from None
    if not gpus or any(g < 0 for g in gpus):
        raise ValueError(f"--gpus {text!r}: give 'all' or GPU indices such as 0,1")
    missing = sorted({g for g in gpus if g >= visible})
    if missing:
        raise ValueError(f"--gpus {text}: no GPU {', '.join(map(str, missing))} "
                         f"({visible} visible)")
    return gpus


#: A campaign name: kept to characters a shell, a URL and a run id take as they are, and
#: short, since it is stored in every claim and lease.
_CAMPAIGN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
CAMPAIGN_MAX = 64


def check_campaign(name: str) -> str:
    """`name` if it is a valid `--campaign` name, else a one-line ValueError saying why."""
    if not name:
        raise ValueError("--campaign is empty: give a name such as fa-bench-h100")
    if len(name) > CAMPAIGN_MAX:
        raise ValueError(f"--campaign {name[:CAMPAIGN_MAX]!r}...: {len(name)} characters, at "
                         f"most {CAMPAIGN_MAX}")
    if not _CAMPAIGN_NAME.fullmatch(name):
        raise ValueError(f"--campaign {name!r}: use only letters, digits, '.', '_' and '-', "
                         f"starting with a letter or digit")
    return name


def new_id() -> str:
    """A random id: an unnamed campaign's, and an invocation's own."""
    return uuid.uuid4().hex[:12]


def make_bench(mode: str, problem: Problem, target: Any, seed: int, compile_workers: int,
               db_path: Path) -> Bench:
    """The bench of one problem and mode. The backward's input comes from the forward that
    dispatch serves from the database being tuned (then the shipped one), so `--mode both`
    feeds it the forward just tuned."""
    if mode == "decode":
        from flashgen.kernels.problem import DecodeProblem
        from flashgen.tune.decode_bench import DecodeKernelBench

        assert isinstance(problem, DecodeProblem)
        return DecodeKernelBench(problem, target, seed=seed, compile_workers=compile_workers)
    if mode == "fwd":
        from flashgen.tune.fwd_bench import KernelBench

        return KernelBench(problem, target, seed=seed, compile_workers=compile_workers)
    from flashgen.serve import Dispatcher
    from flashgen.store.table import shipped_db_path
    from flashgen.tune.bwd_bench import BwdKernelBench

    return BwdKernelBench(problem, target, seed=seed, compile_workers=compile_workers,
                          dispatcher=Dispatcher([db_path, shipped_db_path()]))


@dataclass(frozen=True)
class WorkerPlan:
    """What every worker of one `flashgen tune` invocation does (pickled to each)."""

    problems: tuple[Problem, ...]
    run: RunOptions
    storage_url: str
    # Shared by the workers, and by other invocations that name the same campaign: each
    # problem's trial budget and lease are the campaign's.
    campaign: str
    version: str  # flashgen's: part of every study name
    heartbeat_s: int = HEARTBEAT_S
    grace_s: int = GRACE_S
    bench_factory: BenchFactory = make_bench
    invocation: str = field(default_factory=new_id)  # this invocation's own id

    def run_id(self, index: int) -> str:
        """Worker `index`'s run id (its `runs` row and its trials' `run_id`). Invocations
        sharing a named campaign each add their own id, so no two write the same run id;
        an unnamed campaign is the invocation's own, and its ids stay `<campaign>-w<i>`."""
        if self.invocation == self.campaign:
            return f"{self.campaign}-w{index}"
        return f"{self.campaign}-{self.invocation}-w{index}"


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


#: Set in a worker whose parent process died: nobody reads its reports any more.
_ORPHANED = threading.Event()


def _watch_parent() -> None:
    """Stop this worker, as SIGTERM does, once its parent process is gone (killed with
    SIGKILL, by the OOM killer, or with a lost session): its finished trials are stored,
    and nobody would read its results. Without it the workers tuned their whole budget
    unwatched, then blocked for good at exit writing to the parent's pipe."""
    parent = multiprocessing.parent_process()
    if parent is None or threading.current_thread() is not threading.main_thread():
        return

    def watch() -> None:
        parent.join()  # returns when the parent's end of the sentinel pipe closes
        _ORPHANED.set()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="flashgen-parent-watch").start()


def describe_worker_error(exc: BaseException) -> str:
    """`exc` in one line, with the first line of the error at the bottom of its chain where
    that is another: Optuna wraps a storage connection lost mid-run (a PostgreSQL server
    stopped) in a StorageInternalError that blames "invalid data in the commit"."""
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    root, seen = exc, {id(exc)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(root))
    if root is not exc:
        text += f" (caused by {type(root).__name__}: {_first_line(root)})"
    return text


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def worker_main(index: int, gpu: int | None, plan: WorkerPlan, report: Any) -> None:
    """One worker: tune every problem of `plan` on `gpu` (None: the CPU interpreter),
    sending ("progress", index, TuneResult), ("result", index, TuneResult), ("skipped",
    index, Problem, "done" or "held") for a problem it left to the campaign, and finally
    ("done", index, status, message) to `report`."""
    # A batch scheduler's SIGTERM reaches every process of the job: a worker stops as on
    # Ctrl-C and records its run as interrupted, rather than dying with it left "running".
    # (Only a process's main thread may set a handler; a worker run in a thread keeps its
    # process's.)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)
        _watch_parent()
    status, message = "failed", ""
    try:
        status = _work(index, gpu, plan, report)
    except KeyboardInterrupt:
        status = "interrupted"
    except Exception as exc:
        message = describe_worker_error(exc)
        traceback.print_exc()
    finally:
        report.put(("done", index, status, message))
        if _ORPHANED.is_set():  # the pipe's reader is gone: exit without flushing to it
            report.cancel_join_thread()


def _work(index: int, gpu: int | None, plan: WorkerPlan, report: Any) -> str:
    import torch

    from flashgen.kernels.hardware import device_info

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    run = plan.run
    if gpu is None:
        target = torch.device("cpu")
    else:
        torch.cuda.set_device(gpu)
        target = torch.device("cuda", gpu)
    info = device_info(target)
    batch = run.compile_workers if gpu is not None else 1
    storage = open_storage(plan.storage_url, heartbeat_s=plan.heartbeat_s,
                           grace_s=plan.grace_s)
    shared = Shared(storage, plan.version, plan.campaign,
                    worker=f"{socket.gethostname()}:{os.getpid()}")
    run_id = plan.run_id(index)
    status = "failed"

    seed = (run.seed + index) % SEEDS

    def tune(problem: Problem) -> int:
        """Tune every mode of `problem`; the trials this worker measured."""
        measured = 0
        for mode in run.modes:
            bench = plan.bench_factory(mode, problem, target, seed, run.compile_workers,
                                       database.path)
            options = TuneOptions(mode, run.trials, run.timeout, seed, batch,
                                  exhaustive=run.exhaustive, deterministic=run.deterministic)
            result = tune_problem(
                problem, bench, database, info, options, run_id=run_id,
                on_progress=lambda r: report.put(("progress", index, _light(r))),
                shared=shared)
            report.put(("result", index, _light(result)))
            measured += result.measured
        return measured

    def lead(problem: Problem, key: TuningKey) -> str:
        """Tune `problem` if this worker gets its lease: the lease's kind ("ours" if so)."""
        lease = shared.lease(key, problem)
        if lease.kind != "ours":
            return lease.kind
        finished = False
        try:
            tune(problem)
            finished = True
        finally:
            shared.end_lease(lease, finished)
        return lease.kind

    with TuningDB(run.db_path) as database:
        database.start_run(run_id, info)
        try:
            # The lease is taken in the study of a problem's first mode: one worker tunes
            # all of a problem's modes, so the backward is fed the forward just tuned.
            keys = {p: TuningKey.for_problem(p, info, run.modes[0]) for p in plan.problems}
            # First pass: each problem goes to the first worker that asks, so workers tune
            # different problems and pay each problem's fixed costs once.
            led = {p for p in plan.problems if lead(p, keys[p]) == "ours"}
            # Second pass: take over problems whose worker died (its lease went stale), and
            # join those others still tune where the budget has room.
            for problem in (p for p in plan.problems if p not in led):
                room = run.exhaustive or (run.trials is not None and shared.room(
                    keys[problem], problem, run.trials))
                kind = lead(problem, keys[problem])
                if kind == "held" and room:
                    if not tune(problem):  # the others claimed the rest of the budget first
                        report.put(("skipped", index, problem, kind))
                elif kind != "ours":
                    # Finished by the campaign (maybe in an earlier run of a named one), or
                    # led elsewhere with its budget taken: the parent's summary says which.
                    report.put(("skipped", index, problem, kind))
            status = "ok"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            database.finish_run(run_id, status)
            shared.close()
    return status


def _light(result: TuneResult) -> TuneResult:
    """`result` without its per-variant outcomes, which the parent does not need."""
    return replace(result, outcomes={})


@dataclass
class WorkerEnd:
    """How a worker ended: its status ("ok", "failed", "interrupted", or "killed" for a
    process that died without a word), exit code and message, and the problems it left to
    the campaign, each "done" (finished by it) or "held" (led by another of its workers,
    of this invocation or another, and not joined, or joined too late to measure: no budget
    left to share)."""

    index: int
    gpu: int | None
    status: str
    exitcode: int | None
    message: str = ""
    skipped: dict[Problem, str] = field(default_factory=dict)


def run_workers(plan: WorkerPlan, gpus: list[int | None],
                on_progress: Callable[[int, TuneResult], None] | None = None,
                on_skip: Callable[[int, Problem, str], None] | None = None,
                on_killed: Callable[[int, int], None] | None = None,
                ) -> tuple[list[TuneResult], list[WorkerEnd]]:
    """Run one worker per entry of `gpus` until all end; return every (problem, mode)
    result, merged over the workers, and how each worker ended. `on_skip` hears of each
    problem a worker left to the campaign (see `WorkerEnd.skipped`); `on_killed` of a
    worker killed by a signal (its index and the signal), as soon as a poll reaps it."""
    context = multiprocessing.get_context("spawn")
    report = context.Queue()
    processes = [context.Process(target=worker_main, args=(i, gpu, plan, report),
                                 name=f"flashgen-worker-{i}")
                 for i, gpu in enumerate(gpus)]
    for process in processes:
        process.start()
    results: list[TuneResult] = []
    said: dict[int, tuple[str, str]] = {}
    skipped: dict[int, dict[Problem, str]] = {}

    def handle(message: tuple) -> None:
        kind, index = message[0], message[1]
        if kind == "progress" and on_progress:
            on_progress(index, message[2])
        elif kind == "result":
            results.append(message[2])
            if on_progress:
                on_progress(index, message[2])
        elif kind == "skipped":
            skipped.setdefault(index, {})[message[2]] = message[3]
            if on_skip:
                on_skip(index, message[2], message[3])
        elif kind == "done":
            said[index] = (message[2], message[3])

    try:
        _pump(report, processes, handle, on_killed=on_killed)
    except KeyboardInterrupt:
        _interrupt(processes)
        # What the workers reported while they stopped (they measure on through the grace
        # period, and a killed parent's summary read counts that short of the database).
        _pump(report, processes, handle, on_killed=on_killed)
        raise
    finally:
        for process in processes:
            process.join()
    ends = []
    for i, (process, gpu) in enumerate(zip(processes, gpus, strict=True)):
        status, text = said.get(i, ("killed", ""))
        if i not in said:
            text = f"exit code {process.exitcode}"
        ends.append(WorkerEnd(i, gpu, status, process.exitcode, text, skipped.get(i, {})))
    return merge_results(results), ends


#: Seconds between polls of the workers' processes, also while their messages keep coming.
POLL_S = 0.2


def _pump(report: Any, processes: list[Any], handle: Callable[[tuple], None],
          poll_s: float = POLL_S, on_killed: Callable[[int, int], None] | None = None) -> None:
    """Hand the workers' messages to `handle` until every worker has ended and the queue is
    drained. The processes are polled at least every `poll_s` even while messages keep
    coming: a poll reaps a worker that died (`kill -9`), and until it is reaped its pid still
    answers, so its claims would look held and its running variant would not be measured
    again (`store.claims`). `on_killed(index, signal)` hears of each worker a signal ended
    when the poll finds it (its progress line would otherwise run on until the end)."""
    next_poll = time.monotonic() + poll_s
    gone: set[int] = set()
    while True:
        try:
            message = report.get(timeout=poll_s)
        except queue_module.Empty:
            message = None
        if message is None or time.monotonic() >= next_poll:
            next_poll = time.monotonic() + poll_s
            running = [p.is_alive() for p in processes]  # is_alive() reaps the dead
            for i, (process, alive) in enumerate(zip(processes, running, strict=True)):
                code = getattr(process, "exitcode", None)
                if not alive and i not in gone and code is not None and code < 0:
                    gone.add(i)
                    if on_killed:
                        on_killed(i, -code)
            if message is None and not any(running):
                break
        if message is not None:
            handle(message)
    # A last message can land between the empty get and the poll that found every worker
    # ended (a worker's queue is flushed as it exits): take what is left.
    while True:
        try:
            message = report.get_nowait()
        except queue_module.Empty:
            return
        handle(message)


#: Seconds the workers get to stop on their own after this process was interrupted.
INTERRUPT_GRACE_S = 3.0


def _interrupt(processes: list[Any]) -> None:
    """Pass an interrupt on to the workers still running after a grace period.

    Ctrl-C reaches the whole process group, so the workers stop by themselves (and are
    left alone to record their runs); a SIGINT sent to this process alone (a job's
    `timeout -s INT`) would otherwise leave this process waiting on their whole budget."""
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGINT)


def merge_results(results: list[TuneResult]) -> list[TuneResult]:
    """One result per (problem, mode): counts summed over the workers, the best kept, the
    longest time; in the order the problems were first reported."""
    merged: dict[tuple[Problem, str], TuneResult] = {}
    for r in results:
        held = merged.get((r.problem, r.mode))
        if held is None:
            merged[(r.problem, r.mode)] = replace(r)
            continue
        held.measured += r.measured
        held.failed += r.failed
        held.pruned += r.pruned
        held.resumed = max(held.resumed, r.resumed)
        held.seconds = max(held.seconds, r.seconds)
        if r.best_ms is not None and (held.best_ms is None or r.best_ms < held.best_ms):
            held.best, held.best_ms, held.best_tflops = r.best, r.best_ms, r.best_tflops
        held.baseline = held.baseline or r.baseline
        held.winner = r.winner or held.winner
    return list(merged.values())
