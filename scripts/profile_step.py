"""Where does one flashgen forward+backward call spend its time? GPU kernels vs the host.

Debug aid for GPU sessions: runs `flashgen.attention(...).backward(...)` on one shape under
torch.profiler and prints the per-kernel CUDA time next to the wall time per call, so a
host-bound case (wall >> kernels) and a slow kernel are told apart.
  python3 scripts/profile_step.py 32,16,16,512,512,128 --causal --dtype bf16
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashgen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    b, hq, hkv, nq, nk, d = (int(x) for x in a.shape.split(","))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, nk, d, device="cuda", dtype=dtype, requires_grad=True)
    do = torch.randn(b, hq, nq, d, device="cuda", dtype=dtype)

    def step() -> None:
        flashgen.attention(q, k, v, causal=a.causal).backward(do)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(a.calls):
        step()
    host = (time.perf_counter() - t) / a.calls
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / a.calls
    print(f"{a.shape} {a.dtype} causal={a.causal}: host {host * 1e3:.3f} ms/call, "
          f"wall {wall * 1e3:.3f} ms/call")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.calls):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
