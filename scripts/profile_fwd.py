"""Resource report and profiling target for one forward problem: flashgen's dispatched
kernel next to SDPA's cuDNN backend.

Prints the dispatched variant and its compiled kernel's registers, spills and shared memory,
then runs each backend a few times, so Nsight Compute can profile both in one process:
  ncu --clock-control none -k regex:"attn_fwd|fprop" -c 2 --launch-skip 3 \\
      --section SpeedOfLight --section Occupancy \\
      python3 scripts/profile_fwd.py 1,16,16,16384,16384,128
With --variant (repeatable, Variant JSON) those variants run instead of the dispatched one,
each --calls times, in the order given, before cuDNN. `--dtype fp8` runs flashgen on the
inputs quantized by `flashgen.fp8.quantize` (block descales) and cuDNN on the bf16 inputs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen.kernels.render import load_kernel
from flashgen.kernels.variant import Variant


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--variant", action="append", default=[],
                    help="a variant as JSON (Variant.to_json); repeatable")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp8"])
    a = ap.parse_args()
    b, hq, hkv, nq, nk, d = (int(x) for x in a.shape.split(","))
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype)
    ours: tuple[torch.Tensor, ...] = (q, k, v)
    descales: dict[str, torch.Tensor] = {}
    if a.dtype == "fp8":
        fp8 = flashgen.fp8.quantize(q, k, v)
        ours = (fp8.q, fp8.k, fp8.v)
        descales = {"descale_q": fp8.descale_q, "descale_k": fp8.descale_k,
                    "descale_v": fp8.descale_v}
    variants = [Variant.from_json(j) for j in a.variant] or [
        flashgen.explain(*ours, causal=a.causal).variant]
    problem = flashgen.Problem.from_tensors(*ours, a.causal)
    for variant in variants:
        print(variant, flush=True)
        for _ in range(a.calls):
            flashgen.attention(*ours, causal=a.causal, variant=variant, **descales)
        torch.cuda.synchronize()
        jit = load_kernel(variant, problem)
        for cache in getattr(jit, "device_caches", {}).values():
            for compiled in cache[0].values():
                print(f"{variant}: {compiled.n_regs} registers/thread, "
                      f"{compiled.n_spills} spills, {compiled.metadata.shared} B shared, "
                      f"{compiled.metadata.num_warps} warps")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(a.calls):
            F.scaled_dot_product_attention(q, k, v, is_causal=a.causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
