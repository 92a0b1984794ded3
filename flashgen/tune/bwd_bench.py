"""Measuring backward variants of one problem: compile, check the gradients, then time.

The backward twin of `bench.KernelBench`, with the same `Bench` contract (a bad variant is a
failed `Measurement`, never an exception) and the same gate shapes and seeds. What differs:

* A candidate is the three backward kernels of a `BwdVariant`; compiling launches them once.
* The forward that feeds them (output and log-sum-exp) is the dispatched one (tuned winner or
  default): the gate runs it on the candidate's fresh inputs, then the candidate's backward,
  and `check_grads.compare_grads` holds dQ, dK and dV against the float64 reference.
* Only the backward is timed: the forward's outputs for the timing inputs are made once.
* Throughput counts BWD_FLOPS_RATIO x the forward's FLOPs (its visible pairs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.modes import AnyVariant
from flashgen.kernels.problem import Problem
from flashgen.runtime.modifiers import Mods
from flashgen.serve import Dispatcher, default_dispatcher, run_backward
from flashgen.tune.baseline import Baseline, sdpa_backward_baseline
from flashgen.tune.fwd_bench import KernelBench, Measurement, _inputs, describe_failure
from flashgen.tune.grads import compare_grads
from flashgen.tune.modified import ModifiedInputs
from flashgen.tune.timing import tflops

#: Backward FLOPs per forward FLOP. The forward does two matmuls (S = Q K^T, O = P V); the
#: backward does five: S = Q K^T again (P is rebuilt from the saved log-sum-exp), dV = P^T dO,
#: dP = dO V^T, dQ = dS K and dK = dS^T Q. The separate-dQ mode recomputes S and dP once more;
#: like FlashAttention's own benchmarks, only the five are counted, so both modes compare on
#: the same useful work.
BWD_FLOPS_RATIO = 2.5


@dataclass(frozen=True)
class BwdInputs:
    """Everything `run_backward` reads: the forward's inputs and outputs, and dO."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    mods: Mods | None = None
    reference: dict | None = None  # the modifiers as the reference takes them
    cu: tuple[list[int], list[int]] | None = None

    def run(self, variant: BwdVariant, problem: Problem) -> tuple[torch.Tensor, ...]:
        return run_backward(self.do, self.q, self.k, self.v, self.out, self.lse, variant,
                            problem, mods=self.mods)


class BwdKernelBench(KernelBench):
    """Generated backward kernels on a CUDA GPU, or on the CPU through the Triton interpreter.

    `dispatcher` runs the forward that feeds the backward (default: the shared one, i.e. the
    user's and the shipped databases); the CLI hands it the database being tuned, so a
    `--mode both` run feeds the backward from the forward it has just tuned.
    """

    def __init__(self, problem: Problem, device: torch.device | str, *, seed: int = 0,
                 compile_workers: int | None = None,
                 dispatcher: Dispatcher | None = None) -> None:
        super().__init__(problem, device, seed=seed, compile_workers=compile_workers)
        self.dispatcher = dispatcher or default_dispatcher()
        self._saved: BwdInputs | None = None
        self._gate_warm: BwdInputs | None = None

    def _make(self, problem: Problem, seed: int, made: ModifiedInputs | None = None,
              ) -> BwdInputs:
        made = made or _inputs(problem, self.device, seed)
        q, k, v = made.q, made.k, made.v
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        do = torch.randn(q.shape, generator=gen).to(device=self.device, dtype=q.dtype)
        out, lse = self.dispatcher.forward(q, k, v, problem.causal, mods=made.mods)
        return BwdInputs(q, k, v, do, out, lse, made.mods, made.reference, made.cu)

    @property
    def saved(self) -> BwdInputs:
        """The timing inputs (`inputs`) with their dO and forward outputs, made once."""
        if self._saved is None:
            self._saved = self._make(self.problem, self.seed, self.modified_inputs)
        return self._saved

    def compile(self, variants: Sequence[AnyVariant]) -> dict[AnyVariant, str]:
        """Launch each candidate's kernels once on CPU threads (see `KernelBench.compile`).
        The forward runs here, before the threads, so they only compile backward kernels."""
        if self.on_gpu and variants:
            _ = self.saved
            if self.gate != self.problem:
                self._gate_warm = self._make(self.gate, 0)
        return super().compile(variants)

    def _warm(self, variant: AnyVariant) -> None:
        assert isinstance(variant, BwdVariant)
        # As the forward bench's: bind the device's primary context in this compile thread
        # before Gluon kernels make TMA descriptors through the driver ("invalid device
        # context" failed a fused-delta Gluon point this way, H100).
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            self.saved.run(variant, self.problem)
            if self._gate_warm is not None:
                # Other lengths can specialise the kernels differently: compile both.
                self._gate_warm.run(variant, self.gate)

    def measure(self, variant: AnyVariant) -> Measurement:
        if not isinstance(variant, BwdVariant):
            raise TypeError(f"the backward bench measures BwdVariants, got {variant!r}")
        gate = self._make(self.gate, self._gate_seed(variant))
        try:
            grads = gate.run(variant, self.gate)
        except Exception as exc:
            return Measurement.failed(describe_failure(exc))
        check = compare_grads(grads, gate.q, gate.k, gate.v, gate.do, self.problem.causal,
                              modifiers=gate.reference, cu=gate.cu)
        if not check.ok:
            error = check.error if math.isfinite(check.error) else None
            return Measurement.failed(f"wrong answer: {check.reason}", error, check.bound)
        saved = self.saved
        try:
            timing = self._time(lambda: saved.run(variant, self.problem))
        except Exception as exc:
            return Measurement.failed(describe_failure(exc), check.error, check.bound)
        flops = BWD_FLOPS_RATIO * self.modified_inputs.flops(self.problem)
        return Measurement("ok", timing=timing, tflops=tflops(flops, timing.median_ms),
                           error=check.error, bound=check.bound)

    def baseline(self) -> Baseline | None:
        if self.problem.modifiers:
            return None  # SDPA has no windows, caps, sinks or packed sequences
        s = self.saved
        return sdpa_backward_baseline(s.q, s.k, s.v, s.do, self.problem.causal, self._time)
