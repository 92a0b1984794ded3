"""Where a dispatched forward call spends its host time, next to SDPA cuDNN's host time.

A call's host time decides whether a model that runs short attention eagerly keeps the GPU
busy: at N = 512 a forward kernel runs ~110-150 us on an H100, and a host that needs longer
to issue it leaves the GPU idle. For each problem this prints the host microseconds to queue
one call (the GPU held busy by a spin, so nothing waits on it) for `flashgen.attention`, for
its prepared launcher alone (`prepare_forward`, what dispatch ends in) and for SDPA cuDNN,
then a cProfile of the dispatched call. Run on the GPU machine:

  python3 scripts/profile_host.py --shape 32,16,16,512,512,128 --dtype bf16 --causal

`--grad` times forward+backward steps instead (`attention(q, k, v).backward(do)`), against
SDPA cuDNN's, and breaks the step down: the forward under grad, `Dispatcher.backward` called
on the main thread, and the step with autograd's backward on the calling thread
(`set_multithreading_enabled(False)`) as well as on its CUDA worker thread (the default):
that difference is what handing the backward to the worker costs. The cProfile is of the
step on the calling thread (cProfile sees one thread).

`--varlen S` packs each --shape's B x N tokens into S sequences (as `flashgen bench --varlen`)
and profiles `attention_varlen` on them, beside the dense call of the same tokens, forward
and (with `--grad`) forward+backward.

`--decode B,Hq,Hkv,Nq,Nk,D` does the same for `attention_with_kvcache` on a full contiguous
cache (the database from $FLASHGEN_DB or `--db`), against SDPA flash and cuDNN on it, plus
its launcher's host time three ways: the fast launch, through `launch.Bound`, through the JIT.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import time
from collections.abc import Callable

import torch
from probe_launch_gap import host_us

import flashgen
from flashgen.bench.competitors import COMPETITORS
from flashgen.kernels.problem import Problem
from flashgen.runtime.forward import default_scale
from flashgen.runtime.launch import Bound
from flashgen.serve import prepare_forward
from flashgen.tune.check import make_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=[], help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--decode", action="append", default=[], help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--db", help="tuning database for --decode (else the default ones)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--varlen", type=int, help="--shape's tokens packed into this many sequences")
    ap.add_argument("--grad", action="store_true", help="forward+backward steps instead")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()} "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for shape in args.decode:
        profile_decode(shape, args)
    for shape in args.shape if args.varlen else ():
        profile_varlen(shape, args)
    for shape in args.shape if args.grad and not args.varlen else ():
        profile_step(shape, args)
    for shape in args.shape if not (args.varlen or args.grad) else ():
        b, hq, hkv, nq, nk, d = map(int, shape.split(","))
        problem = Problem(b, hq, hkv, nq, nk, d, args.dtype, args.causal)
        q, k, v = make_inputs(b, hq, hkv, nq, nk, d, problem.torch_dtype, "cuda", 0)
        choice = flashgen.explain(q, k, v, causal=args.causal)
        launch = prepare_forward(choice.variant, problem)
        cudnn = COMPETITORS["sdpa-cudnn"].prepare(problem, q.device).fn
        calls = {
            "flashgen.attention": functools.partial(flashgen.attention, q, k, v,
                                                    causal=args.causal),
            "prepared launcher": functools.partial(launch, q, k, v, default_scale(d)),
            "sdpa cudnn": functools.partial(cudnn, q, k, v),
        }
        with torch.no_grad():
            print(f"{problem}: {choice.variant} ({choice.how})")
            for name, fn in calls.items():
                print(f"  {name:20s} {host_us(fn):7.1f} us host per call")
            _print_profile(calls["flashgen.attention"], args.top)


def _print_profile(fn: Callable[[], object], top: int, calls: int = 300) -> None:
    """cProfile of `calls` calls of `fn`, queued behind a GPU spin (nothing waits on the GPU).
    Keep calls x launches a call under about 1,000: past the driver's queue of pending
    launches a launch blocks until the GPU frees a place, and that wait shows up as the
    launch's own time."""
    profiler = cProfile.Profile()
    torch.cuda._sleep(400_000_000)
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).strip_dirs().sort_stats("tottime").print_stats(top)


def profile_varlen(text: str, args: argparse.Namespace) -> None:
    """Host time of `attention_varlen` on --varlen packed sequences, beside the dense call of
    the same tokens; then the cProfile of the packed call (forward, or forward+backward)."""
    from flashgen.bench.layouts import Layout

    b, hq, hkv, n, _, d = map(int, text.split(","))
    problem = Problem(b, hq, hkv, n, n, d, args.dtype, args.causal)
    layout = Layout(None, args.varlen)
    extra = layout.extra(problem, torch.device("cuda"), 0)  # the bench's offsets
    cu, longest = extra["cu"], extra["longest"]
    grad = args.grad
    q, k, v = (torch.randn(b * n, h, d, device="cuda", dtype=problem.torch_dtype,
                           requires_grad=grad) for h in (hq, hkv, hkv))
    dense = [t.detach().view(b, n, -1, d).transpose(1, 2).requires_grad_(grad)
             for t in (q, k, v)]
    do = torch.randn_like(q)
    do_dense = do.view(b, n, hq, d).transpose(1, 2)

    def packed() -> torch.Tensor:
        return flashgen.attention_varlen(q, k, v, cu, cu, longest, longest, causal=args.causal)

    def dense_call() -> torch.Tensor:
        return flashgen.attention(*dense, causal=args.causal)

    calls: dict[str, Callable[[], object]] = {
        "attention_varlen": packed, "attention (dense, same tokens)": dense_call}
    if grad:
        calls = {"attention_varlen fwd+bwd": lambda: packed().backward(do),
                 "attention (dense, same tokens) fwd+bwd":
                     lambda: dense_call().backward(do_dense)}
    print(f"{problem} packed into {cu.numel() - 1} sequences (longest {longest})")
    with torch.set_grad_enabled(grad):
        for name, fn in calls.items():
            print(f"  {name:36s} {host_us(fn):7.1f} us host per call")
        _print_profile(next(iter(calls.values())), args.top)


def profile_step(text: str, args: argparse.Namespace) -> None:
    """Host time of a forward+backward step and of its parts, against SDPA cuDNN's."""
    from flashgen.runtime.dispatch import Saved
    from flashgen.serve import default_dispatcher

    b, hq, hkv, nq, nk, d = map(int, text.split(","))
    problem = Problem(b, hq, hkv, nq, nk, d, args.dtype, args.causal)
    q, k, v = (t.requires_grad_() for t in make_inputs(b, hq, hkv, nq, nk, d,
                                                        problem.torch_dtype, "cuda", 0))
    do = torch.randn_like(q)
    cudnn = COMPETITORS["sdpa-cudnn"].prepare(problem, q.device).fn
    dispatcher = default_dispatcher()
    out, lse = flashgen.attention(q, k, v, causal=args.causal, return_lse=True)
    saved = Saved(q.detach(), k.detach(), v.detach(), out.detach(), lse)

    def step() -> None:
        flashgen.attention(q, k, v, causal=args.causal).backward(do)

    def cudnn_step() -> None:
        cudnn(q, k, v).backward(do)

    def on_caller(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with torch.autograd.set_multithreading_enabled(False):
                fn()
        return run

    calls: list[tuple[str, Callable[[], object]]] = [
        ("flashgen step", step),
        ("  on the calling thread", on_caller(step)),
        ("  forward under grad", functools.partial(flashgen.attention, q, k, v,
                                                   causal=args.causal)),
        ("  Dispatcher.backward", functools.partial(dispatcher.backward, do, saved,
                                                    args.causal)),
        ("sdpa cudnn step", cudnn_step),
        ("  on the calling thread", on_caller(cudnn_step)),
        ("  forward under grad", functools.partial(cudnn, q, k, v)),
    ]
    choice = flashgen.explain(q, k, v, causal=args.causal)
    print(f"{problem} forward+backward: {choice.variant}; {choice.backward.variant}")
    # 60 steps a reading, about 10 launches each: under the driver's launch queue (see
    # `_print_profile`). Twice: this host's timings drift within a run.
    for _ in range(2):
        for name, fn in calls:
            print(f"  {name:26s} {host_us(fn, 60):7.1f} us host per call")
            q.grad = k.grad = v.grad = None
    _print_profile(on_caller(step), args.top, calls=60)


def _through_jit(self: Bound, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
    self.fn[grid](*args, **kwargs)


def profile_decode(text: str, args: argparse.Namespace) -> None:
    """Host time of a decode call, its parts and its competitors; then its cProfile."""
    from flashgen.bench.decoding import _other
    from flashgen.kernels.problem import DecodeProblem
    from flashgen.runtime import kvcache
    from flashgen.runtime.launch import hooks_idle
    from flashgen.serve import Dispatcher, default_dispatcher
    from flashgen.store.table import shipped_db_path
    from flashgen.tune.decode_bench import make_kvcache

    b, hq, hkv, nq, nk, d = map(int, text.split(","))
    problem = DecodeProblem(b, hq, hkv, nq, nk, d, args.dtype, args.causal)
    c = make_kvcache(problem, torch.device("cuda"), 0)
    dispatcher = (Dispatcher([args.db, shipped_db_path()]) if args.db
                  else default_dispatcher())
    call = functools.partial(flashgen.attention_with_kvcache, c.q, c.k, c.v, c.seqlens,
                             causal=args.causal, dispatcher=dispatcher)
    choice = dispatcher.explain_kvcache(c.q, c.k, c.v, c.seqlens, causal=args.causal)
    plan = dispatcher._decode_plan(c.q, c.k, c.v, c.seqlens, None, args.causal, None)
    calls = {
        "attention_with_kvcache": call,
        "its plan's launcher": functools.partial(plan.launch, c.q, c.k, c.v, c.seqlens, None,
                                                 plan.scale),
        "torch.empty x4": lambda: [torch.empty((b, hq, nq, d), device="cuda")
                                   for _ in range(4)],
    }
    for name in ("sdpa-flash", "sdpa-cudnn"):
        fn, _ = _other(name, problem, torch.device("cuda"))
        calls[name] = functools.partial(fn, c)
    with torch.no_grad():
        print(f"{problem}: {choice.variant} ({choice.how}: {choice.reason})")
        for name, fn in calls.items():
            print(f"  {name:24s} {host_us(fn):7.1f} us host per call")
        # The same launcher three ways, interleaved (this host's timings drift between
        # runs): the fast launch of a layout seen before (`kvcache.prepare_decode`), every
        # launch through `launch.Bound` (what a new layout takes), and through Triton's JIT.
        launcher = calls["its plan's launcher"]
        bound_launch = Bound.launch
        for _ in range(3):
            fast = host_us(launcher)
            kvcache.hooks_idle = lambda: False  # the fast launch steps aside, as for a hook
            try:
                bound = host_us(launcher)
                Bound.launch = _through_jit  # type: ignore[method-assign]
                jit = host_us(launcher)
            finally:
                Bound.launch = bound_launch  # type: ignore[method-assign]
                kvcache.hooks_idle = hooks_idle
            print(f"  launcher fast {fast:6.1f} us, bound {bound:6.1f} us, "
                  f"through the JIT {jit:6.1f} us")
        _print_profile(call, args.top)


if __name__ == "__main__":
    main()
