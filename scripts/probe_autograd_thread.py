"""Where the ViT step's host time goes: a Python autograd node on autograd's device thread.

Run on the GPU machine, alone and under `taskset -c N` (one core), to see what the autograd
thread's handoff between cores costs (docs/timing.md, "The autograd thread's core").

Steps timed (wall timer, L2 flushed, back to back) and their host time to queue (GPU held
by a spin), interleaved over rounds, one process, B64 H12 N197 D64 bf16:
  flashgen   attention(q, k, v).backward(do)
  cudnn      SDPA's cuDNN backend, same
  null-py    a Python autograd.Function doing no GPU work: forward returns an empty tensor,
             backward three empty tensors (the cost of a Python node, nothing else)
  flashgen / null-py / cudnn again with torch.autograd.set_multithreading_enabled(False)
"""
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

import flashgen
from flashgen.tune.timing import queue_seconds, time_cuda

dev = torch.device("cuda")
b, h, n, d = 64, 12, 197, 64
leaves = [torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
          for _ in range(3)]
do = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)


class Null(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)


def reset():
    for t in leaves:
        t.grad = None


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


fns = {"flashgen": flashgen.attention, "cudnn": cudnn, "null-py": Null.apply}


def step_of(f):
    def step():
        reset()
        f(*leaves).backward(do)
    return step


results: dict[str, list[tuple[float, float]]] = {}
for rnd in range(3):
    for threaded in (True, False):
        torch.autograd.set_multithreading_enabled(threaded)
        for name, f in fns.items():
            step = step_of(f)
            step(); torch.cuda.synchronize()
            t = time_cuda(step, dev, timer="wall")
            host = queue_seconds(step, calls=21) * 1e6
            key = f"{name}{'' if threaded else ' (calling thread)'}"
            results.setdefault(key, []).append((t.median_ms * 1e3, host))
    torch.autograd.set_multithreading_enabled(True)
print(torch.cuda.get_device_name(), flush=True)
print(f"{'step':32} {'wall us (rounds)':>28} {'host us (rounds)':>28}")
for key, vals in results.items():
    wall = " ".join(f"{w:7.1f}" for w, _ in vals)
    host = " ".join(f"{x:7.1f}" for _, x in vals)
    print(f"{key:32} {wall:>28} {host:>28}")
