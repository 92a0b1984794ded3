"""`flashgen bench`'s measurements: every competitor on the same inputs, checked, then timed.

Not to be confused with `flashgen.tune.fwd_bench`, the tuner's per-variant measuring back end; this
module compares whole implementations (flashgen's dispatched kernel against torch's).

What is timed, per mode (inputs are seeded random values, shared by all competitors of a
problem; `do` is a random upstream gradient):
- fwd: one attention call, with autograd off (inference).
- bwd: the backward alone. The forward runs once, untimed, with q, k and v requiring grad;
  each timed call resets their `.grad` to None (so no accumulation kernel is timed) and runs
  `out.backward(do, retain_graph=True)`.
- both: forward then backward, in one timed call (a training step's attention).

FLOPs follow the FlashAttention papers: the forward's two matmuls (`Problem.flops`, causal
counting the half really computed); the backward is 2.5x that (five matmuls of the same size,
S = QK^T recomputed included, against the forward's two); forward + backward is 3.5x.

Correctness: each competitor is checked once per problem and autograd setting (the forward
output, and for bwd/both also the output and the gradients of a forward+backward) against the
float64 reference, with `check.compare` and `check_grads.compare_grads`. When the float64
scores of the problem are too large, the check runs on `gate_problem(problem)`: the same
dtype, head dim, causal flag and GQA ratio at a smaller batch, head count and length. A wrong
competitor is still timed, and its row says "wrong".

A `Layout` (`--window`, `--varlen`; `flashgen.bench.layouts`) turns every problem into its
windowed or packed form: FLOPs count the visible pairs, checks use the reference with the
window or per sequence, and competitors without such masks are n/a.
"""

from __future__ import annotations

import math
import re
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from flashgen.bench import layouts
from flashgen.bench.competitors import AttentionFn, Competitor
from flashgen.bench.layouts import Layout
from flashgen.kernels.problem import Problem
from flashgen.runtime.quantize import Quantized
from flashgen.tune.check import CheckResult, compare, compare_fp8, make_inputs
from flashgen.tune.fwd_bench import describe_failure, gate_problem
from flashgen.tune.grads import compare_grads
from flashgen.tune.modified import make_fp8_inputs
from flashgen.tune.timing import Timing, tflops, time_cpu, time_cuda

Mode = Literal["fwd", "bwd", "both"]
MODES: tuple[Mode, ...] = ("fwd", "bwd", "both")
#: FLOPs of a mode as a multiple of the forward's (FlashAttention papers' convention).
FLOP_FACTOR: dict[Mode, float] = {"fwd": 1.0, "bwd": 2.5, "both": 3.5}
Status = Literal["ok", "wrong", "n/a"]
Timer = Callable[[Callable[[], object]], Timing]


def mode_flops(problem: Problem, mode: Mode) -> float:
    return FLOP_FACTOR[mode] * problem.flops()


def parse_modes(text: str) -> list[Mode]:
    """`fwd`, `bwd`, `both`, or a comma-separated list of them, e.g. `fwd,both`."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in MODES]
    if bad or not names:
        raise ValueError(f"--mode takes {', '.join(MODES)} or a comma-separated list, "
                         f"got {text!r}")
    return [m for m in MODES if m in names]


@dataclass(frozen=True)
class Row:
    """One competitor on one problem in one mode: its time, or why there is none."""

    problem: Problem
    mode: Mode
    competitor: str
    status: Status
    flops: float
    timing: Timing | None = None
    reason: str = ""  # why n/a or wrong
    error: float | None = None  # max |output or grad - float64 reference| where checked
    bound: float | None = None  # the error allowed there
    checked_on: Problem | None = None  # None: checked on the timed inputs themselves
    note: str = ""  # what the competitor chose (flashgen: its variants)

    @property
    def tflops(self) -> float | None:
        return None if self.timing is None else tflops(self.flops, self.timing.median_ms)


def default_timer(device: torch.device, rep_ms: float = 100.0, timer: str = "wall") -> Timer:
    """CUDA events with L2 flushed, the median of about `rep_ms` of calls (after a quarter of
    that of warm-up) on a GPU, by `timer` ("wall" or "gpu", `tune.timing`); wall clock on
    the CPU."""
    if device.type == "cuda":
        return lambda fn: time_cuda(fn, device, warmup_ms=rep_ms / 4, rep_ms=rep_ms,
                                    timer=timer, host=True)
    return lambda fn: time_cpu(fn)


@dataclass(frozen=True)
class _Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor  # the upstream gradient of the output
    extra: dict = field(default_factory=dict)  # a layout's arguments, or fp8's descales
    quantized: Quantized | None = None  # fp8: what the fp8 gate compares against

    @classmethod
    def make(cls, p: Problem, device: torch.device, seed: int,
             layout: Layout | None = None) -> _Inputs:
        """Inputs seeded by `seed` and the problem's shape and dtype (not its mask, nor its
        place in the grid): a causal and a full problem of one shape share them."""
        seed = (seed * 1_000_003 + zlib.crc32(str(p.with_(causal=False)).encode())) % 2**31
        if p.dtype == "fp8":  # quantized as users should; forward only, so no layouts
            if layout:
                raise ValueError("fp8 problems are benchmarked without a layout")
            qz = make_fp8_inputs(p, device, seed).quantized
            assert qz is not None
            descales = {"descale_q": qz.descale_q, "descale_k": qz.descale_k,
                        "descale_v": qz.descale_v}
            return cls(qz.q, qz.k, qz.v, torch.zeros(qz.q.shape, device=device,
                                                     dtype=torch.bfloat16), descales, qz)
        q, k, v = make_inputs(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim,
                              p.torch_dtype, device, seed)
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        do = torch.randn(q.shape, generator=gen).to(device=device, dtype=q.dtype)
        if layout and layout.sequences:
            q, k, v, do = (layouts.packed(t) for t in (q, k, v, do))
        return cls(q, k, v, do, layout.extra(p, device, seed) if layout else {})

    def leaves(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as fresh autograd leaves over the same memory."""
        q, k, v = (t.detach().requires_grad_(True) for t in (self.q, self.k, self.v))
        return q, k, v


@contextmanager
def _explained() -> Iterator[list[warnings.WarningMessage]]:
    """Collect warnings: SDPA says why a forced backend refuses a problem only in warnings,
    then raises a bare "No available kernel"."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


# Where in torch's C++ a warning was raised: says nothing to a bench's reader.
_TORCH_SOURCE = re.compile(r"\s*\(Triggered internally at [^)]*\)")


def _why(exc: BaseException, caught: list[warnings.WarningMessage]) -> str:
    said = (" ".join(_TORCH_SOURCE.sub("", str(w.message)).split()) for w in caught)
    return describe_failure(exc) + "".join(
        f" | {s[:300]}" for s in list(dict.fromkeys(s for s in said if s))[:3])


def _check(fn: AttentionFn, inp: _Inputs, causal: bool, grads: bool,
           layout: Layout | None = None) -> CheckResult:
    if layout:
        return layouts.check(fn, layout, causal, inp.q, inp.k, inp.v, inp.do, inp.extra,
                             grads)
    if inp.quantized is not None:
        if grads:
            raise NotImplementedError("fp8 attention is forward only")
        with torch.no_grad():
            return compare_fp8(fn(inp.q, inp.k, inp.v, **inp.extra), inp.quantized, causal)
    if not grads:
        with torch.no_grad():
            return compare(fn(inp.q, inp.k, inp.v), inp.q, inp.k, inp.v, causal)
    leaves = inp.leaves()
    out = fn(*leaves)
    out.backward(inp.do)
    fwd = compare(out.detach(), inp.q, inp.k, inp.v, causal)
    if not fwd.ok:
        return CheckResult(False, fwd.error, fwd.bound, f"output: {fwd.reason}")
    got = tuple(t.grad for t in leaves)
    assert all(g is not None for g in got)
    return compare_grads(got, inp.q, inp.k, inp.v, inp.do, causal)  # type: ignore[arg-type]


def _time(fn: AttentionFn, inp: _Inputs, mode: Mode, timer: Timer) -> Timing:
    extra = inp.extra
    if mode == "fwd":
        with torch.no_grad():
            return timer(lambda: fn(inp.q, inp.k, inp.v, **extra))
    leaves = inp.leaves()

    def reset() -> None:
        for t in leaves:
            t.grad = None

    if mode == "bwd":
        out = fn(*leaves, **extra)

        def backward() -> None:
            reset()
            out.backward(inp.do, retain_graph=True)

        return timer(backward)

    def step() -> None:
        reset()
        fn(*leaves, **extra).backward(inp.do)

    return timer(step)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_competitor(competitor: Competitor, problem: Problem, modes: Sequence[Mode],
                    device: torch.device, timed: _Inputs, checked: _Inputs,
                    gate: Problem | None, timer: Timer, layout: Layout | None = None,
                    forward_flops: float | None = None) -> list[Row]:
    def row(mode: Mode, status: Status, **fields: object) -> Row:
        flops = (mode_flops(problem, mode) if forward_flops is None
                 else FLOP_FACTOR[mode] * forward_flops)
        return Row(problem, mode, competitor.name, status, flops,
                   **fields)  # type: ignore[arg-type]

    with _explained() as caught:
        try:
            options: dict[str, object] = {"layout": layout} if layout else {}
            if competitor.picks_backward:
                options["backward"] = any(mode != "fwd" for mode in modes)
            prepared = competitor.prepare(problem, device, **options)
        except Exception as exc:
            return [row(m, "n/a", reason=_why(exc, caught)) for m in modes]
    rows: list[Row] = []
    checks: dict[bool, CheckResult | str] = {}
    for mode in modes:
        grads = mode != "fwd"
        if grads not in checks:
            with _explained() as caught:
                try:
                    checks[grads] = _check(prepared.fn, checked, problem.causal, grads,
                                           layout)
                except Exception as exc:
                    checks[grads] = _why(exc, caught)
                    _free(device)
        check = checks[grads]
        if isinstance(check, str):
            rows.append(row(mode, "n/a", reason=f"check could not run: {check}",
                            checked_on=gate, note=prepared.note))
            continue
        error = check.error if math.isfinite(check.error) else None
        found = {"error": error, "bound": check.bound, "checked_on": gate, "note": prepared.note}
        status: Status = "ok" if check.ok else "wrong"
        with _explained() as caught:
            try:
                timing = _time(prepared.fn, timed, mode, timer)
            except Exception as exc:
                _free(device)
                rows.append(row(mode, "n/a", reason=f"timing failed: {_why(exc, caught)}",
                                **found))
                continue
        rows.append(row(mode, status, timing=timing, reason=check.reason if not check.ok
                        else "", **found))
    return rows


def run_suite(
    problems: Sequence[Problem],
    modes: Sequence[Mode],
    device: torch.device,
    competitors: Sequence[Competitor],
    *,
    seed: int = 0,
    timer: Timer | None = None,
    on_problem: Callable[[Problem, list[Row]], None] | None = None,
    layout: Layout | None = None,
) -> list[Row]:
    """Check and time every competitor on every problem in every mode.

    All competitors of a problem get the same inputs (see `_Inputs.make`); consecutive
    problems that differ only in the mask reuse them rather than draw them again. `timer`
    defaults to `default_timer(device)`; tests inject a fake one. `on_problem` sees each
    problem's rows as soon as they exist (progress output). Nothing a competitor does stops
    the run: failures become "n/a" rows with the reason, wrong answers "wrong" rows.
    """
    timer = timer or default_timer(device)
    rows: list[Row] = []
    made: dict[Problem, _Inputs] = {}  # the last problem's inputs, by unmasked problem

    def inputs(p: Problem) -> _Inputs:
        key = p.with_(causal=False)
        if key not in made:
            made.clear()
            _free(device)
            made[key] = _Inputs.make(p, device, seed, layout)
        return made[key]

    for problem in problems:
        if layout:
            problem = layout.apply(problem)
        gate = gate_problem(problem)
        timed = inputs(problem)
        # The gate's inputs are small: drawn afresh (they would evict the timed ones).
        checked = timed if gate == problem else _Inputs.make(gate, device, seed, layout)
        work = layout.flops(problem, seed) if layout else None
        found: list[Row] = []
        for competitor in competitors:
            found += _run_competitor(competitor, problem, modes, device, timed, checked,
                                     None if gate == problem else gate, timer, layout, work)
        del timed, checked
        rows += found
        if on_problem is not None:
            on_problem(problem, found)
    return rows
