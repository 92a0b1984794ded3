"""Where a backward's GPU time goes, kernel by kernel: flashgen's dispatched backward next to
SDPA's cuDNN backward, on fa-bench-like problems.

For each problem: the backward alone (`torch.autograd.grad` of a saved forward) of each
backend under torch.profiler, its kernels' GPU time a call (memsets and copies included),
their sum against the wall-timed call (the gap is host time or idle GPU between launches),
and each flashgen kernel's registers and spills. The issue's "cause from a profile" for a
short cell starts here: which kernel, and whether it is the GPU's work or the gaps.

    python3 scripts/profile_bwd.py --dims 64,128 --lens 2048,8192 --causal yes,no

With --calls N the profiler is skipped and each backend runs N backwards, so Nsight Compute
can take both kernels in one process:
    ncu --clock-control none -k regex:"attn_bwd|bprop" --launch-skip 4 -c 4 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 scripts/profile_bwd.py --dims 128 --lens 8192 --causal no --calls 4
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen import serve
from flashgen.bench.suite import mode_flops
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.presets import TOKENS_PER_BATCH
from flashgen.tune.check import make_inputs
from flashgen.tune.timing import time_cuda

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Every JIT kernel the backward loaded, by kernel name, for the resource report.
LOADED: dict[str, Any] = {}
REPORTED: set[str] = set()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="128")
    ap.add_argument("--lens", default="2048,8192")
    ap.add_argument("--causal", default="yes,no")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--variant", default=None, help="a BwdVariant as JSON (default: served)")
    ap.add_argument("--steps", type=int, default=20, help="backwards profiled per backend")
    ap.add_argument("--calls", type=int, default=0, help="no profiler: N backwards each")
    ap.add_argument("--only", choices=["flashgen", "cudnn"], default=None,
                    help="run one backend (an ncu run's kernel filter stays simple)")
    a = ap.parse_args()
    variant = BwdVariant(**json.loads(a.variant)) if a.variant else None
    _record_loads()
    print(f"device: {torch.cuda.get_device_name()}")
    for d in (int(x) for x in a.dims.split(",")):
        for n in (int(x) for x in a.lens.split(",")):
            for causal in (c == "yes" for c in a.causal.split(",")):
                _problem(a.dtype, d, n, causal, variant, a.steps, a.calls, a.only)


def _record_loads() -> None:
    """Keep every backward kernel the dispatcher loads, to read its compiled resources."""
    real = serve.load_bwd_kernel

    def load(kernel: Any, variant: BwdVariant, problem: Any) -> Any:
        jit = real(kernel, variant, problem)
        LOADED[f"{kernel} {variant}"] = jit
        return jit

    serve.load_bwd_kernel = load  # type: ignore[assignment]


def _problem(dtype: str, d: int, n: int, causal: bool, variant: BwdVariant | None,
             steps: int, calls: int, only: str | None) -> None:
    b, h = max(1, TOKENS_PER_BATCH // n), 2048 // d
    dev = torch.device("cuda")
    q, k, v = make_inputs(b, h, h, n, n, d, DTYPES[dtype], dev, seed=0)
    do = torch.randn_like(q)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    runs: dict[str, Callable[[], Any]] = {}
    if only in (None, "flashgen"):
        out = flashgen.attention(*leaves, causal=causal, bwd_variant=variant)
        runs["flashgen"] = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)
    if only in (None, "cudnn"):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
        runs["cudnn"] = lambda: torch.autograd.grad(ref, leaves, do, retain_graph=True)
    label = f"{dtype} B{b} H{h} N{n} D{d} {'causal' if causal else 'full'}"
    flops = mode_flops(flashgen.Problem(b, h, h, n, n, d, dtype, causal), "bwd")
    print(f"\n## {label}\n")
    for fn in runs.values():
        for _ in range(max(calls, 3)):
            fn()
        torch.cuda.synchronize()
    for name in [name for name in LOADED if name not in REPORTED]:
        print(f"{name}: {_resources(LOADED[name])}")
        REPORTED.add(name)
    if calls:
        return
    print("\n| backend | kernel | calls | us a call | share |\n|---|---|---|---|---|")
    for name, fn in runs.items():
        kernels = _kernels(fn, steps)
        total = sum(us for _, us in kernels.values())
        wall = time_cuda(fn, dev, timer="wall").median_ms * 1e3
        for kernel, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
            print(f"| {name} | {kernel[:44]} | {count / steps:g} | {us / steps:.1f} | "
                  f"{us / total:.0%} |")
        print(f"| {name} | kernels' sum; wall median | | {total / steps:.1f}; {wall:.1f} | "
              f"{flops / wall / 1e6:.0f} TFLOP/s wall |")


def _kernels(fn: Callable[[], Any], steps: int) -> dict[str, tuple[int, float]]:
    """Each GPU kernel's (launches, total us) over `steps` calls of `fn`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    found: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            found[event.name][0] += 1
            found[event.name][1] += event.time_range.elapsed_us()
    return {name: (int(c), us) for name, (c, us) in found.items()}


def _resources(jit: Any) -> str:
    """Registers, spills and shared memory of a JIT kernel's compiled specialisations."""
    seen = []
    for cache in getattr(jit, "device_caches", {}).values():
        for compiled in cache[0].values():
            seen.append(f"{compiled.n_regs} regs, {compiled.n_spills} spills, "
                        f"{compiled.metadata.shared} B shared, "
                        f"{compiled.metadata.num_warps} warps")
    return "; ".join(seen) or "no compiled kernel found"


if __name__ == "__main__":
    main()
