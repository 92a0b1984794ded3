"""The timer's retry of unsteady measurements (`flashgen.tune.timing.steady`), on made-up timings,
and its queuing of timed calls ahead of the GPU, with the CUDA calls faked."""

from __future__ import annotations

import contextlib
import time

import torch

from flashgen.tune import timing
from flashgen.tune.timing import (
    MAX_HOST_S,
    QUEUE_BATCH,
    SPIN_HZ,
    SPIN_MARGIN,
    STEADY_RETRIES,
    UNSTEADY_SPREAD,
    Timing,
    _events,
    _queue_seconds,
    steady,
)


def _runs(*spreads: float) -> tuple[list[Timing], list[Timing]]:
    """Timings (medians 1, 2, 3 ... ms) with the given spreads, and the list `steady` draws
    them from."""
    made = [Timing(1.0 + i, 1.0 + i - s / 2 * (1.0 + i), 1.0 + i + s / 2 * (1.0 + i), 50)
            for i, s in enumerate(spreads)]
    return made, list(made)


def test_a_steady_measurement_is_taken_once() -> None:
    made, queue = _runs(0.02, 0.01)
    assert steady(lambda: queue.pop(0)) == made[0]
    assert len(queue) == 1


def test_an_unsteady_measurement_is_taken_again_until_steady() -> None:
    made, queue = _runs(0.5, 0.03, 0.01)
    assert steady(lambda: queue.pop(0)) == made[1]
    assert len(queue) == 1


def test_when_every_retry_is_unsteady_the_steadiest_is_kept() -> None:
    unsteady = [0.5, 0.2, 0.3, 0.4, 0.6][: STEADY_RETRIES + 1]
    made, queue = _runs(*unsteady, 0.01)
    kept = steady(lambda: queue.pop(0))
    assert kept == min(made[: STEADY_RETRIES + 1], key=lambda t: t.spread)
    assert kept.spread > UNSTEADY_SPREAD and len(queue) == 1


# ---- queuing timed calls ahead of the GPU (`_events`, `_queue_seconds`), with fakes --------


class _Log:
    """Stands in for the CUDA calls the timer makes and records them in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        log = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing

            def record(self) -> None:
                log.calls.append(("event", 0))

            def elapsed_time(self, end: object) -> float:
                return 1.0

        class Flush:
            def zero_(self) -> None:
                log.calls.append(("flush", 0))

        self.Event, self.flush = Event, Flush()

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda c: self.calls.append(("spin", c)))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def test_each_batch_of_timed_calls_is_queued_behind_a_spin_sized_from_host_time(
        monkeypatch) -> None:
    log = _Log()
    log.install(monkeypatch)
    reps, host_s = QUEUE_BATCH * 2 + 3, 1e-4
    samples = _events(lambda: log.calls.append(("call", 0)), log.flush, reps, host_s)
    assert samples == [1.0] * reps
    kinds = [k for k, _ in log.calls]
    spins = [i for i, k in enumerate(kinds) if k == "spin"]
    # One spin before each batch; then flush, start event, the call, end event per repeat.
    assert spins == [i * (QUEUE_BATCH * 4 + 1) for i in range(3)]
    per_call = ["flush", "event", "call", "event"]
    for first, n in zip(spins, (QUEUE_BATCH, QUEUE_BATCH, 3), strict=True):
        assert kinds[first + 1:first + 1 + 4 * n] == per_call * n
        assert log.calls[first][1] == int(SPIN_MARGIN * n * host_s * SPIN_HZ)


def test_host_time_is_measured_behind_a_spin_and_capped(monkeypatch) -> None:
    log = _Log()
    log.install(monkeypatch)
    seconds = _queue_seconds(lambda: time.sleep(0.002), log.flush, reps=2)
    assert log.calls[0][0] == "spin"  # the GPU is held before the host starts queuing
    assert 0.002 <= seconds < 0.05
    slow = _queue_seconds(lambda: time.sleep(MAX_HOST_S * 2), log.flush, reps=1)
    assert slow == MAX_HOST_S  # a call that waits on the GPU must not size hour-long spins


def test_a_timing_asked_for_host_time_reports_warm_calls_alone(monkeypatch) -> None:
    # The bench's host_us: the calls after the timed ones, behind one spin, with no flush or
    # event between them (those are the timer's, not the caller's); the tuner asks none.
    log = _Log()
    log.install(monkeypatch)
    monkeypatch.setattr(timing, "_flush_buffer", lambda device: log.flush)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())

    def call() -> None:
        log.calls.append(("call", 0))
        time.sleep(0.001)

    t = timing.time_cuda(call, torch.device("cuda"), warmup_ms=1, rep_ms=10, min_reps=3,
                         max_reps=5, host=True)
    assert t.median_ms == 1.0 and t.reps == 5  # the fake events' 1 ms each
    assert t.host_ms is not None and 1.0 <= t.host_ms < 50.0
    kinds = [k for k, _ in log.calls]
    assert kinds[-timing.HOST_CALLS - 1:] == ["spin"] + ["call"] * timing.HOST_CALLS
    assert kinds[-timing.HOST_CALLS - 2] == "event"  # the last timed call's end
    untold = timing.time_cuda(call, torch.device("cuda"), warmup_ms=1, rep_ms=10,
                              min_reps=3, max_reps=5)
    assert untold.host_ms is None


def test_one_slow_call_does_not_set_the_host_time(monkeypatch) -> None:
    log = _Log()
    log.install(monkeypatch)
    pauses = [0.03, 0.0, 0.0, 0.0, 0.0]
    assert timing.queue_seconds(lambda: time.sleep(pauses.pop(0)), calls=5) < 0.01


# ---- the GPU lock ----------------------------------------------------------------------


def _try_lock(path: str) -> str:
    """Whether another process can take `path`'s lock right now."""
    import subprocess
    import sys

    code = ("import fcntl, sys\nf = open(sys.argv[1], 'a')\n"
            "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    print('free')\n"
            "except BlockingIOError:\n    print('held')\n")
    return subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_gpu_lock_keeps_other_processes_out_and_nests_in_one(
        tmp_path, monkeypatch) -> None:
    lock = tmp_path / "gpu.lock"
    monkeypatch.setattr(timing, "gpu_lock_path", lambda device: lock)
    gpu = torch.device("cuda", 0)  # only named: the lock never touches the GPU
    with timing.gpu_lock(gpu):
        with timing.gpu_lock(gpu):  # the tuner's measure holds it around time_cuda's
            assert _try_lock(str(lock)) == "held"
        assert _try_lock(str(lock)) == "held"  # the outer hold still stands
    assert _try_lock(str(lock)) == "free"
    with timing.gpu_lock(torch.device("cpu")):  # no lock off CUDA
        assert _try_lock(str(lock)) == "free"
