"""How much host time `flashgen.attention`'s dispatch adds over launching the kernel directly.

Both sides launch the same compiled Triton kernel on the same small problem and allocate the
same outputs; the difference is the dispatcher (key, dict lookup, closure call). The problem
is small so the GPU keeps up with the host and the loop measures host time per call.
Median of repeats; run on the GPU machine: `python3 benchmarks/dispatch_overhead.py`.
"""

from __future__ import annotations

import statistics
import time

import torch

import flashgen
from flashgen.kernels.render import load_kernel

CALLS = 2000
REPEATS = 5


def per_call_us(fn) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(samples)


def main() -> None:
    b, h, n, d = 1, 2, 128, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    problem = flashgen.Problem.from_tensors(q, k, v)
    variant = flashgen.explain(q, k, v).variant
    kernel = load_kernel(variant, problem)
    scale = d**-0.5

    def direct() -> None:
        out = torch.empty_like(q)
        lse = torch.empty((b, h, n), device="cuda", dtype=torch.float32)
        kernel[(-(-n // variant.block_m), b * h)](
            q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            *lse.stride()[:2], scale, n, n, h, 1,
            num_warps=variant.num_warps, num_stages=variant.num_stages,
        )

    dispatched = lambda: flashgen.attention(q, k, v)
    # Interleave the two many times: drift in clocks or load hits both sides alike.
    rounds = [(per_call_us(direct), per_call_us(dispatched)) for _ in range(5)]
    direct_us = statistics.median(r[0] for r in rounds)
    dispatch_us = statistics.median(r[1] for r in rounds)
    overhead = statistics.median(r[1] - r[0] for r in rounds)
    print(f"device: {torch.cuda.get_device_name()}  variant {variant}")
    print(f"direct Triton launch : {direct_us:7.2f} us per call (median of 5 rounds)")
    print(f"flashgen.attention   : {dispatch_us:7.2f} us per call")
    print(f"dispatch overhead    : {overhead:7.2f} us per call (median of paired rounds; "
          "target <= 3)")

if __name__ == "__main__":
    main()
