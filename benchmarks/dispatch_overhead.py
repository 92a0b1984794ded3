"""How much host time `flashgen.attention`'s dispatch adds over launching the kernel directly.

Both sides launch the same compiled Triton kernel on the same small problem and allocate the
same outputs; the difference is the dispatcher (key, dict lookup, closure call). The problem
is small so the GPU keeps up with the host and the loop measures host time per call.
Median of repeats; run on the GPU machine: `python3 benchmarks/dispatch_overhead.py`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import flashgen
from flashgen.runtime.dispatch import Dispatcher
from flashgen.serve import default_dispatcher  # flashgen's dispatcher, plugged into the runtime

CALLS = 2000
REPEATS = 5
ROUNDS = 5
WARMUP = 50


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(fn: Callable[[], object], device: torch.device, calls: int = CALLS,
                repeats: int = REPEATS, warmup: int = WARMUP) -> float:
    """Median host microseconds per call of `fn` over `repeats` loops of `calls` calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def direct_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  dispatcher: Dispatcher) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The launch dispatch prepared for this shape, called as its fast path calls it: the
    runtime's own launcher, so the kernel's arguments cannot drift from what it passes."""
    dispatcher.forward(q, k, v)  # the first call compiles, and settles any fallback
    plan = dispatcher._plan(q, k, v, False, None)
    return lambda: plan.launch(q, k, v, plan.scale)


def measure(device: str = "cuda", shape: tuple[int, int, int, int] = (1, 2, 128, 64),
            dtype: torch.dtype = torch.float16, calls: int = CALLS, repeats: int = REPEATS,
            rounds: int = ROUNDS, warmup: int = WARMUP) -> dict[str, object]:
    """Per-call host time of the direct launch and of `flashgen.attention` on one shape."""
    target = torch.device(device)
    q, k, v = (torch.randn(*shape, device=target, dtype=dtype) for _ in range(3))
    direct = direct_launch(q, k, v, default_dispatcher())
    dispatched = lambda: flashgen.attention(q, k, v)
    # Interleave the two many times: drift in clocks or load hits both sides alike.
    pairs = [(per_call_us(direct, target, calls, repeats, warmup),
              per_call_us(dispatched, target, calls, repeats, warmup)) for _ in range(rounds)]
    return {
        "variant": flashgen.explain(q, k, v).variant,
        "direct_us": statistics.median(r[0] for r in pairs),
        "dispatch_us": statistics.median(r[1] for r in pairs),
        "overhead_us": statistics.median(r[1] - r[0] for r in pairs),
    }


def main() -> None:
    r = measure()
    print(f"device: {torch.cuda.get_device_name()}  variant {r['variant']}")
    print(f"direct Triton launch : {r['direct_us']:7.2f} us per call (median of {ROUNDS} rounds)")
    print(f"flashgen.attention   : {r['dispatch_us']:7.2f} us per call")
    print(f"dispatch overhead    : {r['overhead_us']:7.2f} us per call (median of paired rounds; "
          "target <= 3)")


if __name__ == "__main__":
    main()
