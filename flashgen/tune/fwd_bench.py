"""Measuring variants of one problem: compile, check against the reference, then time.

The tuner only sees the `Bench` protocol, so its selection logic is tested with a fake bench
that returns made-up timings, and `KernelBench` (the real one) is the only place that
launches kernels. A bad variant is data, never an exception: compile errors, resource
overflows (Triton's OutOfResources) and wrong answers come back as failed `Measurement`s.
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from flashgen.kernels.modes import AnyVariant
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import CacheDirError
from flashgen.kernels.variant import Variant
from flashgen.serve import run_forward
from flashgen.tune.baseline import Baseline, sdpa_baseline
from flashgen.tune.check import CheckResult, compare, compare_fp8
from flashgen.tune.modified import ModifiedInputs, make_modified_inputs
from flashgen.tune.timing import Timing, tflops, time_cpu, time_cuda

#: A problem whose float64 reference has at most this many score elements (256 MB of
#: float64) is checked as it is; larger ones are checked on a smaller problem of the same
#: kind (see `gate_problem`).
GATE_MAX_SCORES = 1 << 25
#: A multiple of every tile length (BLOCK_SIZES and fa3's 192 rows): a shrunk length keeps
#: its remainder modulo each, so the last tile is masked as in the real problem.
GATE_TILE = 768
#: Longest sequence of a shrunk gate problem: two GATE_TILEs, so a long side shortened alone
#: (to more than one tile) stays longer than a short side cut to at most one.
GATE_MAX_SEQ = 2 * GATE_TILE


@dataclass(frozen=True)
class Measurement:
    """The outcome of one variant: timings if it ran correctly, otherwise why not."""

    status: Literal["ok", "failed"]
    reason: str = ""
    timing: Timing | None = None
    tflops: float | None = None
    error: float | None = None  # max |kernel - float64 reference| on the gate inputs
    bound: float | None = None  # the error allowed there

    @classmethod
    def failed(cls, reason: str, error: float | None = None,
               bound: float | None = None) -> Measurement:
        return cls("failed", reason, error=error, bound=bound)


class Bench(Protocol):
    """What the tuner needs from a measuring back end, for one problem and one mode: its
    variants are `Variant`s (forward) or `BwdVariant`s (backward, see `bwd_bench`)."""

    def compile(self, variants: Sequence[AnyVariant]) -> dict[AnyVariant, str]:
        """Prepare `variants` (in parallel where it can); returns the reasons of failures."""
        ...

    def measure(self, variant: AnyVariant) -> Measurement:
        """Check and time one variant; may raise, the tuner records that as a failure."""
        ...

    def baseline(self) -> Baseline | None:
        """torch SDPA's best time on the same problem, if it can run it."""
        ...


class FunctionBench:
    """A `Bench` from a plain measuring function: nothing to compile, no baseline."""

    def __init__(self, measure: Callable[[AnyVariant], Measurement],
                 baseline: Baseline | None = None) -> None:
        self._measure = measure
        self._baseline = baseline

    def compile(self, variants: Sequence[AnyVariant]) -> dict[AnyVariant, str]:
        return {}

    def measure(self, variant: AnyVariant) -> Measurement:
        return self._measure(variant)

    def baseline(self) -> Baseline | None:
        return self._baseline


def checked_and_timed(check: CheckResult, time: Callable[[], Timing],
                      flops: float) -> Measurement:
    """A candidate's measurement once its gate check is known: a wrong answer is failed
    (with its error where finite), else `time()` runs; a launch that fails while timed
    is failed too."""
    if not check.ok:
        error = check.error if math.isfinite(check.error) else None
        return Measurement.failed(f"wrong answer: {check.reason}", error, check.bound)
    try:
        timing = time()
    except Exception as exc:
        return Measurement.failed(describe_failure(exc), check.error, check.bound)
    return Measurement("ok", timing=timing, tflops=tflops(flops, timing.median_ms),
                       error=check.error, bound=check.bound)


def describe_failure(exc: BaseException, limit: int = 400) -> str:
    """One line naming the error: what the trial table stores as the reason.

    A `CacheDirError` is raised again instead: an unusable kernel folder is no variant's
    failure, and stored as one it would keep that variant from ever being measured."""
    if isinstance(exc, CacheDirError):
        raise exc
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import_kernel_modules() -> None:
    """Import what the generated kernels import, once, on this thread.

    Why: when the first batch of a run imported `triton.language` from several compile
    threads at once, Python's import-deadlock guard handed one of them the half-initialised
    module, and that variant was recorded as failed ("partially initialized module
    'triton.language' has no attribute 'core'"; 2 such trials in the shipped DB, both at the
    start of an H200 tuning run).
    """
    import triton.language  # noqa: F401

    with contextlib.suppress(ImportError):  # a Triton without Gluon runs no fa3 kernels
        from triton.experimental.gluon import language  # noqa: F401


def _shrink_lengths(nq: int, nk: int) -> tuple[int, int]:
    """Lengths of at most GATE_MAX_SEQ with the same remainders modulo GATE_TILE and, where
    the shorter side allows, the same difference Nk - Nq."""
    longest, shortest = max(nq, nk), min(nq, nk)
    if longest <= GATE_MAX_SEQ:
        return nq, nk
    # Cut whole tiles off both: remainders and the causal offset Nk - Nq stay as they were.
    wanted = -(-(longest - GATE_MAX_SEQ) // GATE_TILE)
    cut = min(wanted, (shortest - 1) // GATE_TILE) * GATE_TILE
    nq, nk = nq - cut, nk - cut
    # A long side facing a short one (decode-like shapes): shorten it alone, keeping its
    # remainder; it stays the longer one (over one tile) since the short side is now at most
    # one tile.
    if nq > GATE_MAX_SEQ:
        nq = (GATE_MAX_SEQ - nq % GATE_TILE) // GATE_TILE * GATE_TILE + nq % GATE_TILE
    if nk > GATE_MAX_SEQ:
        nk = (GATE_MAX_SEQ - nk % GATE_TILE) // GATE_TILE * GATE_TILE + nk % GATE_TILE
    return nq, nk


def gate_problem(problem: Problem) -> Problem:
    """The problem a candidate's correctness is checked on before it may be timed.

    The tuned problem itself when its float64 reference is cheap (at most GATE_MAX_SCORES
    score elements). Otherwise the same dtype, head dim, causal flag and GQA ratio with at
    most 2 batches and 2 KV heads, and sequence lengths of at most GATE_MAX_SEQ, cut by
    whole largest tiles: the masked last tile runs as it does in the real problem, and the
    causal mask's bottom-right offset Nk - Nq is kept (its sign at least, when one side is
    much shorter than the other). Kernels take lengths, batch and heads as runtime
    arguments, so the gate runs the very code that is timed.
    """
    b, hq, hkv, nq, nk = (problem.batch, problem.heads_q, problem.heads_kv, problem.seq_q,
                          problem.seq_k)
    if b * hq * nq * nk <= GATE_MAX_SCORES:
        return problem
    hkv_small = min(hkv, 2)
    nq, nk = _shrink_lengths(nq, nk)
    return problem.with_(batch=min(b, 2), heads_q=hkv_small * problem.group,
                         heads_kv=hkv_small, seq_q=nq, seq_k=nk)


def _inputs(problem: Problem, device: torch.device, seed: int) -> ModifiedInputs:
    """Seeded q, k, v of `problem`, with representative values of its modifiers
    (`tune.modified`): the same call the gate's reference computes."""
    return make_modified_inputs(problem, device, seed)


class KernelBench:
    """Generated kernels on a CUDA GPU, or on the CPU through the Triton interpreter.

    Timing inputs are made once from `seed`. Every candidate's correctness gate gets fresh
    inputs, seeded from `seed` and the variant, so a run is repeatable and a variant that is
    right only on one lucky input is still caught by another. A modified or packed problem
    runs with representative modifier values (`tune.modified`), checked against the
    reference given the same.
    """

    def __init__(self, problem: Problem, device: torch.device | str, *, seed: int = 0,
                 compile_workers: int | None = None) -> None:
        self.problem = problem
        self.device = torch.device(device)
        self.seed = seed
        self.gate = gate_problem(problem)
        self.compile_workers = compile_workers or min(16, os.cpu_count() or 1)
        self.on_gpu = self.device.type == "cuda"
        self._inputs: ModifiedInputs | None = None

    @property
    def modified_inputs(self) -> ModifiedInputs:
        """The timing inputs with their modifiers, made once."""
        if self._inputs is None:
            self._inputs = _inputs(self.problem, self.device, self.seed)
        return self._inputs

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        made = self.modified_inputs
        return made.q, made.k, made.v

    def _gate_seed(self, variant: Variant) -> int:
        return (self.seed * 1_000_003 + zlib.crc32(variant.to_json().encode())) % 2**31

    def _warm(self, variant: Variant) -> None:
        # A new thread has no CUDA context bound until a runtime call binds the device's
        # primary one; TMA descriptors are made through the driver API and fail without it
        # ("invalid device context", seen on an H200; docs/tuning.md).
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            made = self.modified_inputs
            run_forward(made.q, made.k, made.v, variant, self.problem, mods=made.mods)
            if self.gate != self.problem:
                # Other lengths and head counts can specialise the kernel differently
                # (Triton specialises integers divisible by 16), so compile both.
                gate = _inputs(self.gate, self.device, 0)
                run_forward(gate.q, gate.k, gate.v, variant, self.gate, mods=gate.mods)

    def compile(self, variants: Sequence[Variant]) -> dict[Variant, str]:
        """Compile on CPU threads by launching each variant once (the interpreter has nothing
        to compile). Triton's compiler releases the GIL in LLVM and ptxas, so threads
        overlap; a failure is that variant's, the rest go on."""
        if not self.on_gpu or not variants:
            return {}
        _ = self.inputs  # made once here, not raced for by the threads
        _import_kernel_modules()
        failures: dict[Variant, str] = {}
        workers = max(1, min(self.compile_workers, len(variants)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flashgen-compile") \
                as pool:
            futures = {v: pool.submit(self._warm, v) for v in variants}
            for variant, future in futures.items():
                exc = future.exception()
                if exc is not None:
                    failures[variant] = describe_failure(exc)
        torch.cuda.synchronize(self.device)
        return failures

    def _time(self, fn: Callable[[], object]) -> Timing:
        return time_cuda(fn, self.device) if self.on_gpu else time_cpu(fn)

    def measure(self, variant: Variant) -> Measurement:
        gate = _inputs(self.gate, self.device, self._gate_seed(variant))
        try:
            out, lse = run_forward(gate.q, gate.k, gate.v, variant, self.gate, mods=gate.mods)
        except Exception as exc:
            return Measurement.failed(describe_failure(exc))
        if gate.quantized is not None:  # fp8: against the dequantized inputs' attention
            check = compare_fp8(out, gate.quantized, self.problem.causal)
        else:
            check = compare(out, gate.q, gate.k, gate.v, self.problem.causal, None, lse,
                            modifiers=gate.reference, cu=gate.cu)
        made = self.modified_inputs
        return checked_and_timed(
            check, lambda: self._time(lambda: run_forward(
                made.q, made.k, made.v, variant, self.problem, mods=made.mods)),
            made.flops(self.problem))

    def baseline(self) -> Baseline | None:
        if self.problem.modifiers or self.problem.dtype == "fp8":
            return None  # SDPA has no windows, caps, sinks, packed sequences or fp8
        q, k, v = self.inputs
        return sdpa_baseline(q, k, v, self.problem.causal, self._time)
