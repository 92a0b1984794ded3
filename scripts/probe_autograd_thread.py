"""Where the ViT step's host time goes: a Python autograd node on autograd's device thread.

Run on the GPU machine, alone and under `taskset -c N` (one core), to see what the handoff
between the calling thread and autograd's device thread costs when they sit on different
cores (docs/timing.md, "The autograd thread's core decides the ViT step").

Steps timed (wall timer: L2 flushed, back to back) with their host time to queue (the GPU
held by a spin), over interleaved rounds in one process, B64 H12 N197 D64 bf16:
  flashgen   attention(q, k, v).backward(do)
  cudnn      SDPA's cuDNN backend, the same
  null-py    a Python autograd.Function that launches nothing (the cost of a Python node)
each again with torch.autograd.set_multithreading_enabled(False) (the backward on the
calling thread).

    python3 scripts/probe_autograd_thread.py [--rounds 3]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen
from flashgen.tune.timing import queue_seconds, time_cuda

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Null(torch.autograd.Function):
    """A node with no GPU work: what autograd's Python machinery costs alone."""

    @staticmethod
    def forward(ctx: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)


def cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dev = torch.device("cuda")
    shape = (64, 12, 197, 64)
    leaves = [torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True)
              for _ in range(3)]
    do = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    fns: dict[str, Attention] = {"flashgen": flashgen.attention, "cudnn": cudnn,
                                 "null-py": Null.apply}

    def step_of(f: Attention) -> Callable[[], None]:
        def step() -> None:
            for t in leaves:
                t.grad = None
            f(*leaves).backward(do)
        return step

    results: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for threaded in (True, False):
            torch.autograd.set_multithreading_enabled(threaded)
            for name, f in fns.items():
                step = step_of(f)
                step()
                torch.cuda.synchronize()
                wall = time_cuda(step, dev, timer="wall").median_ms * 1e3
                host = queue_seconds(step, calls=21) * 1e6
                key = name if threaded else f"{name} (calling thread)"
                results.setdefault(key, []).append((wall, host))
        torch.autograd.set_multithreading_enabled(True)
    print(torch.cuda.get_device_name())
    print(f"{'step, us':28} {'wall (rounds)':>24}  {'host (rounds)':>24}")
    for key, values in results.items():
        walls = " ".join(f"{w:7.1f}" for w, _ in values)
        hosts = " ".join(f"{h:7.1f}" for _, h in values)
        print(f"{key:28} {walls:>24}  {hosts:>24}")


if __name__ == "__main__":
    main()
