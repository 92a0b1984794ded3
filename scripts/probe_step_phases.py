"""Where a forward+backward step's host time goes, phase by phase, flashgen against cuDNN;
with --gaps, where the GPU sits idle inside the step as the bench times it.

`scripts/profile_host.py --grad` times whole calls and parts called on their own; the parts
then run warm on the main thread and need not add up to the step. This times the phases of
the step itself, with the GPU held by a spin so that nothing waits on it:

  fwd      the forward call under grad (it returns the output and records the graph);
  to-node  from `.backward(do)` to the start of the attention node (autograd's engine, and
           on its device thread the handoff to that thread);
  node     the attention node's backward (flashgen's launcher, or SDPA's C++ node);
  after    from the node's end until `.backward` returns (gradient accumulation into the
           leaves, and the handoff back).

The node's start and end come from hooks on its `grad_fn` (`register_prehook`,
`register_hook`), registered every step inside "fwd" (a few microseconds, both sides
alike). Medians over `--batches` x `--steps` steps, the backward on the calling thread
(`set_multithreading_enabled(False)`) and on autograd's device thread (the default), the
leaves' gradients reset each step (as `flashgen bench` does) or accumulated. Run on the GPU
machine:

    python3 scripts/probe_step_phases.py --shape 64,12,12,197,197,64 --shape 32,16,16,512,512,128

--gaps instead runs the step as `flashgen bench` times it (L2 flushed before each step, the
leaves' gradients reset, back to back): its wall time (the bench's timer), then 20 steps
under torch.profiler, and from the GPU timeline the kernels' busy time a step, the idle time
between the flush and the step's first kernel ("lead") and between its kernels (each pair's
median). A step whose kernels run back to back is GPU-bound and its busy time decides it;
idle time is the host falling behind. (The profiler adds host time of its own.)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import flashgen
from flashgen.bench.competitors import COMPETITORS
from flashgen.kernels.problem import Problem
from flashgen.tune.check import make_inputs
from flashgen.tune.timing import SPIN_HZ, _flush_buffer, time_cuda

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PHASES = ("fwd", "to-node", "node", "after", "step")


def phases(fn: Attention, leaves: tuple[torch.Tensor, ...], do: torch.Tensor, caller: bool,
           reset: bool, steps: int, batches: int) -> list[float]:
    """Median microseconds of each of `PHASES` over `batches` x `steps` steps."""
    marks: dict[str, int] = {}

    def pre(_grads: object) -> None:
        marks["start"] = time.perf_counter_ns()

    def post(_inputs: object, _outputs: object) -> None:
        marks["end"] = time.perf_counter_ns()

    rows = []
    for _ in range(batches):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(0.15 * SPIN_HZ))  # a GPU spin: the steps queue behind it
        for _ in range(steps):
            if reset:
                for t in leaves:
                    t.grad = None
            t0 = time.perf_counter_ns()
            out = fn(*leaves)
            out.grad_fn.register_prehook(pre)
            out.grad_fn.register_hook(post)
            t1 = time.perf_counter_ns()
            with torch.autograd.set_multithreading_enabled(not caller):
                out.backward(do)
            t2 = time.perf_counter_ns()
            start, end = marks.pop("start"), marks.pop("end")
            rows.append((t1 - t0, start - t1, end - start, t2 - end, t2 - t0))
        torch.cuda.synchronize()
    return [statistics.median(column) / 1e3 for column in zip(*rows, strict=True)]


def gaps(fn: Attention, leaves: tuple[torch.Tensor, ...], do: torch.Tensor, label: str) -> None:
    """Print the bench-timed step's wall time, its kernels' busy time and its GPU idle time
    (see the module's docstring)."""
    flush = _flush_buffer(do.device)  # the bench's: an int8 fill, as `timeline` finds it

    def step() -> None:
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(do)

    wall = time_cuda(step, do.device, timer="wall")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            flush.zero_()
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    lead, busy, idle, between = timeline(kernels, skip=2)  # the first steps run slow
    med = statistics.median
    print(f"  {label:9s} wall {wall.median_ms * 1e3:8.1f} us (p20 {wall.p20_ms * 1e3:.1f}, p80 "
          f"{wall.p80_ms * 1e3:.1f}); busy {med(busy):8.1f}, lead {med(lead):6.1f}, idle "
          f"between kernels {med(idle):6.1f}", flush=True)
    for pair, values in between.items():
        print(f"      {med(values):7.1f} us  {pair}")


def timeline(kernels: list, skip: int = 0) -> tuple[list[float], list[float], list[float],
                                                   dict[str, list[float]]]:
    """From a profiler's GPU events (`name`, `time_range.start` and `.end`, us) of steps each
    queued behind an L2 flush (an int8 fill): per step after the first `skip`, the idle time
    from the flush's end to its first kernel (lead), its kernels' busy time, and its idle
    time between them; and each pair of consecutive kernels' gaps, by their names. A flush
    with no kernel after it counts no step."""
    steps: list[tuple[float, list]] = []  # (the flush's end, the step's kernels)
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        if "signed char" in e.name:  # the flush
            steps.append((e.time_range.end, []))
        elif steps:
            steps[-1][1].append(e)
    lead, busy, idle = [], [], []
    between: dict[str, list[float]] = defaultdict(list)
    for flushed, ks in steps[skip:]:
        if not ks:
            continue
        lead.append(ks[0].time_range.start - flushed)
        busy.append(sum(k.time_range.end - k.time_range.start for k in ks))
        idle.append(ks[-1].time_range.end - ks[0].time_range.start - busy[-1])
        for a, b in itertools.pairwise(ks):
            between[f"{_short(a.name)} -> {_short(b.name)}"].append(
                b.time_range.start - a.time_range.end)
    return lead, busy, idle, between


def _short(name: str) -> str:
    return name.removeprefix("void ")[:36]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", required=True, help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=50, help="steps a batch (under ~0.15 s)")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--gaps", action="store_true", help="GPU idle time in the bench's step")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f"; host us a step, medians of {args.batches} x {args.steps}")
    for text in args.shape:
        b, hq, hkv, nq, nk, d = map(int, text.split(","))
        problem = Problem(b, hq, hkv, nq, nk, d, args.dtype, args.causal)
        leaves = tuple(t.requires_grad_() for t in make_inputs(
            b, hq, hkv, nq, nk, d, problem.torch_dtype, "cuda", 0))
        do = torch.randn_like(leaves[0])
        cudnn = COMPETITORS["sdpa-cudnn"].prepare(problem, do.device).fn

        def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return flashgen.attention(q, k, v, causal=args.causal)

        for fn in (ours, cudnn):  # compiled and dispatched before timing
            fn(*leaves).backward(do)
        if args.gaps:
            print(problem)
            for _ in range(args.rounds):
                gaps(ours, leaves, do, "flashgen")
                gaps(cudnn, leaves, do, "cudnn")
            continue
        print(f"{problem}\n  {'':34s}" + "".join(f"{p:>9s}" for p in PHASES))
        for _ in range(args.rounds):
            for name, fn in (("flashgen", ours), ("cudnn", cudnn)):
                for caller in (True, False):
                    for reset in (True, False):
                        label = (f"{name}, {'calling thread' if caller else 'device thread'}"
                                 f", {'grad None' if reset else 'accumulate'}")
                        got = phases(fn, leaves, do, caller, reset, args.steps, args.batches)
                        print(f"  {label:34s}" + "".join(f"{v:9.1f}" for v in got),
                              flush=True)


if __name__ == "__main__":
    main()
