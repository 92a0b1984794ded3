"""Does host launch time leak into flashgen's GPU timings of short problems?

`flashgen.tune.timing` writes a 256 MB buffer before each timed launch, and the host must queue
the start event, the call and the end event before the GPU finishes that write (~85 us on an
H100), or the GPU idles inside the timed span. This script measures, per problem and per
callable (the tuner's `run_forward` path, `flashgen bench`'s dispatched call, SDPA cuDNN):

- host_us: host time to queue one call while the GPU is busy (so nothing waits on it);
- flush-only: the timing used before 2026-11-24, each launch queued right behind its flush;
- queued ahead: `flashgen.tune.timing.time_cuda` now, launches queued behind a GPU spin.

Where flush-only reads slower or spreads wider, host time leaked into its timed spans.
Run on the GPU machine:
`python3 scripts/probe_launch_gap.py --shape 32,16,16,512,512,128 --causal`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable

import torch

from flashgen.bench.competitors import COMPETITORS
from flashgen.kernels.hardware import device_info
from flashgen.kernels.problem import Problem
from flashgen.kernels.variant import Variant
from flashgen.serve import run_forward
from flashgen.tune.check import make_inputs
from flashgen.tune.timing import Timing, _flush_buffer, queue_seconds, time_cuda


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    """Median host microseconds to queue one call, over 5 runs of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    return statistics.median(queue_seconds(fn, calls) for _ in range(5)) * 1e6


def flush_only(fn: Callable[[], object], reps: int = 200) -> Timing:
    """The timing before 2026-11-24: each launch queued right behind its L2 flush, nothing
    holding the GPU while the host queues the call."""
    flush = _flush_buffer(torch.device("cuda"))
    for _ in range(20):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return Timing.from_samples([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


def fmt(t: Timing) -> str:
    return f"{t.median_ms * 1e3:7.1f} us ({t.p20_ms * 1e3:.1f}..{t.p80_ms * 1e3:.1f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", required=True, help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="fp16,bf16")
    ap.add_argument("--variant", action="append", default=[],
                    help="Variant JSON also timed through the tuner's run_forward path")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()} sms {device_info(dev).sm_count}")
    for shape in args.shape:
        b, hq, hkv, nq, nk, d = map(int, shape.split(","))
        for dtype in args.dtype.split(","):
            problem = Problem(b, hq, hkv, nq, nk, d, dtype, args.causal)
            q, k, v = make_inputs(b, hq, hkv, nq, nk, d, problem.torch_dtype, dev, 0)
            fns = {}
            for name in ("flashgen", "sdpa-cudnn"):
                prepared = COMPETITORS[name].prepare(problem, dev)
                fns[name] = functools.partial(prepared.fn, q, k, v)
                if name == "flashgen":
                    print(f"{problem}: {prepared.note}")
            for text in args.variant:
                variant = Variant.from_json(text)
                fns[f"tuner {variant}"] = functools.partial(run_forward, q, k, v, variant,
                                                            problem)
            for name, fn in fns.items():
                h = host_us(fn)
                for r in range(args.rounds):
                    old = flush_only(fn)
                    new = time_cuda(fn, dev)
                    print(f"  {dtype} {name:40s} host {h:6.1f} us  round {r}: flush-only "
                          f"{fmt(old)}  queued ahead {fmt(new)}  old/new "
                          f"{old.median_ms / new.median_ms:.3f}")


if __name__ == "__main__":
    main()
