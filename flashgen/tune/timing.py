"""Timing a kernel launch: CUDA events on a GPU, `time.perf_counter` on the interpreter.

Two timers (`TIMERS`). "gpu" (the tuner's, and `flashgen bench --timer gpu`) measures the GPU's
work alone, as described below. "wall" (`flashgen bench`'s default) is how peers report
attention speed (`triton.testing.do_bench`): the same flushed, event-timed calls issued back to
back with nothing holding the GPU, so a call whose host time exceeds its GPU time is timed at
its host time, as an eager PyTorch user pays it.

A GPU measurement is the median of many launches, each preceded by a write of a buffer larger
than L2 so every launch reads its inputs from HBM, as it would inside a model where other
layers evict them. The spread (20th and 80th percentiles) is kept so a reader can tell a real
difference from noise.

The launches are queued behind a GPU spin long enough for the host to queue them all, so a
timed span never contains the GPU waiting for the host. The flush alone (~85 us on an H100)
did not guarantee that: queuing an fa3 call takes the host 90-200 us, and on an H100
(`scripts/probe_launch_gap.py`) a 0.118 ms kernel then read up to 0.215 ms, unsteady, in
some runs and not others: wrong winners in the tuner, low ratios in the bench. Measurements:
docs/timing.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import torch

from flashgen.store.measurement import UNSTEADY_SPREAD, Timing

#: "wall": back-to-back calls, host launch cost included where it exceeds the GPU's work;
#: "gpu": calls queued behind a GPU spin, the GPU's work alone.
TIMERS: tuple[str, ...] = ("wall", "gpu")

#: Larger than the L2 cache of every current GPU (H100/H200: 50 MB, B200: 126 MB).
FLUSH_BYTES = 256 * 1024 * 1024


#: How many times an unsteady GPU measurement is taken again before the steadiest is kept.
STEADY_RETRIES = 2

#: Timed launches queued behind one GPU spin.
QUEUE_BATCH = 25

#: Clock assumed when turning a spin's length into GPU cycles: above any Hopper SM clock, so
#: at the real clock the spin lasts longer than asked, which only adds to the host's lead.
SPIN_HZ = 2.0e9

#: The spin lasts this many times the host's measured time to queue the batch behind it.
SPIN_MARGIN = 2.0

#: Calls whose host time to queue `time_cuda(..., host=True)` reports (their median).
HOST_CALLS = 15

#: Longest host time per launch a spin is sized for: a call that synchronises with the GPU
#: cannot be queued ahead anyway, and must not turn every batch into a long wait.
MAX_HOST_S = 5e-3




def tflops(flops: float, ms: float) -> float:
    """Throughput of `flops` work done in `ms` milliseconds, in TFLOP/s."""
    return flops / (ms * 1e-3) / 1e12


@functools.cache
def _flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)


def steady(measure: Callable[[], Timing], retries: int = STEADY_RETRIES,
           limit: float = UNSTEADY_SPREAD) -> Timing:
    """`measure()`, taken again up to `retries` times while its repeats spread wider than
    `limit`; the steadiest of the runs is returned.

    Why: a tuner keeps the first number it gets for a variant and a winner is picked on a few
    percent, so one measurement spoiled by a neighbour on the GPU can crown the wrong variant
    or bury the right one. The steadiest run rather than the fastest: the spread says whether
    a median can be trusted; the minimum of several medians would favour lucky outliers.
    """
    best = measure()
    for _ in range(retries):
        if best.spread <= limit:
            break
        again = measure()
        if again.spread < best.spread:
            best = again
    return best


#: Per lock file: how deep this process holds it, and the open file that holds it.
_HELD: dict[Path, tuple[int, IO[str]]] = {}
_HELD_GUARD = threading.RLock()


def gpu_lock_path(device: torch.device) -> Path:
    """This host's lock file of `device`, named by the GPU's UUID so processes that see it
    under different indices (CUDA_VISIBLE_DEVICES) share it."""
    try:
        name = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
    except (RuntimeError, AssertionError):  # no CUDA here (tests that fake the timer)
        name = ""
    name = name or f"index{device.index or 0}"
    return Path(tempfile.gettempdir()) / f"flashgen-gpu-{name}.lock"


@contextlib.contextmanager
def gpu_lock(device: torch.device) -> Iterator[None]:
    """Hold `device` while its work is checked and timed. Tuners sharing one GPU (`--gpus
    0,0`, or two `flashgen tune` processes) then never time a kernel while the other's run,
    and still compile in parallel. Reentrant within a process; a no-op off CUDA."""
    if device.type != "cuda":
        yield
        return
    path = gpu_lock_path(device)
    with _HELD_GUARD:
        depth, handle = _HELD.get(path, (0, None))
        if handle is None:
            handle = path.open("a")
            fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process holds it
        _HELD[path] = (depth + 1, handle)
        try:
            yield
        finally:
            depth, handle = _HELD.pop(path)
            if depth > 1:
                _HELD[path] = (depth - 1, handle)
            else:
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()


def time_cuda(
    fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25.0,
    rep_ms: float = 100.0, min_reps: int = 10, max_reps: int = 200, timer: str = "gpu",
    host: bool = False,
) -> Timing:
    """Median time of `fn` on `device`, with L2 flushed before every launch, by `timer`
    ("gpu" or "wall", see the module's docstring).

    The first call (compilation, autotuning caches, allocator growth) is never timed; then
    roughly `warmup_ms` of untimed calls, then enough timed ones to fill `rep_ms`, within
    [min_reps, max_reps]. An unsteady measurement is taken again (`steady`). With `host`,
    the timing also carries the host time to queue one call (`host_ms`): the median of
    `HOST_CALLS` calls, warm, each alone (no flush or events) behind a GPU spin, so what a
    caller pays to issue it and nothing else.
    """
    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {TIMERS}, not {timer!r}")
    with gpu_lock(device):
        timing = steady(lambda: _time_cuda_once(fn, device, warmup_ms, rep_ms, min_reps,
                                                max_reps, spin=timer == "gpu"))
        if host:
            with torch.cuda.device(device):
                timing = dataclasses.replace(timing,
                                             host_ms=queue_seconds(fn, HOST_CALLS) * 1e3)
        return timing


def _time_cuda_once(fn: Callable[[], object], device: torch.device, warmup_ms: float,
                    rep_ms: float, min_reps: int, max_reps: int, spin: bool) -> Timing:
    flush = _flush_buffer(device)
    with torch.cuda.device(device):
        fn()
        torch.cuda.synchronize()
        host_s = _queue_seconds(fn, flush)
        queued = host_s if spin else 0.0
        estimate = _events(fn, flush, 3, queued)
        per_call = max(statistics.median(estimate), 1e-3)
        for _ in range(max(1, int(warmup_ms / per_call))):
            fn()
        reps = min(max_reps, max(min_reps, int(rep_ms / per_call)))
        return Timing.from_samples(_events(fn, flush, reps, queued))


def queue_seconds(fn: Callable[[], object], calls: int = 5) -> float:
    """Host seconds to queue one call of `fn`: the median of `calls` calls, each timed on
    its own while a GPU spin holds the queue, so no call waits for the GPU. The host cost of
    issuing work, which decides whether a caller keeps the GPU busy. The median, not the
    mean: one slow call (a pause of the interpreter, say) must not count as the cost of every
    call (an H100 bench read over 5 ms for a ~0.11 ms call from a mean of 3).
    The spin covers up to 1 ms of host time per call."""
    torch.cuda._sleep(int((0.02 + calls * 1e-3) * SPIN_HZ))
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _queue_seconds(fn: Callable[[], object], flush: torch.Tensor, reps: int = 5) -> float:
    """Host seconds to queue one timed launch (flush, two events, the call), capped."""

    def timed_call() -> None:
        flush.zero_()
        torch.cuda.Event(enable_timing=True).record()
        fn()
        torch.cuda.Event(enable_timing=True).record()

    return min(queue_seconds(timed_call, reps), MAX_HOST_S)


def _events(fn: Callable[[], object], flush: torch.Tensor, reps: int,
            host_s: float) -> list[float]:
    """Event times of `reps` flushed calls; with `host_s` > 0 each batch is queued behind a
    spin sized for that much host time per call (the "gpu" timer), with 0 back to back."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    pairs = list(zip(starts, ends, strict=True))
    for first in range(0, reps, QUEUE_BATCH):
        batch = pairs[first:first + QUEUE_BATCH]
        # Hold the GPU while the host queues the batch: the GPU then runs it back to back,
        # and no timed span includes waiting for Python to issue the call.
        if host_s > 0:
            torch.cuda._sleep(int(SPIN_MARGIN * len(batch) * host_s * SPIN_HZ))
        for start, end in batch:
            flush.zero_()
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in pairs]


def time_cpu(fn: Callable[[], object], *, warmup: int = 1, reps: int = 3) -> Timing:
    """Wall-clock time of `fn` (the interpreter: only the pipeline is tested, not speed)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return Timing.from_samples(samples)
