"""The yardstick: torch's scaled_dot_product_attention at its best on the same device.

SDPA picks a backend by heuristics, not by speed, so each backend that accepts the problem
(cuDNN, FlashAttention, memory-efficient) is timed on its own and the fastest one is the
baseline. A speed-up over anything slower would flatter the generated kernels.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashgen.tune.timing import Timing

Timer = Callable[[Callable[[], object]], Timing]


@dataclass(frozen=True)
class Baseline:
    backend: str  # "cudnn", "flash", "efficient", or "cpu" on the interpreter device
    timing: Timing


def _sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal: bool) -> Callable[[], object]:
    kwargs: dict[str, object] = {}
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    nq, nk = q.shape[2], k.shape[2]
    if causal and nq != nk:
        # is_causal aligns top-left; flashgen (and FlashAttention 2+) align bottom-right.
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(nq, nk)
    else:
        kwargs["is_causal"] = causal
    return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)


def _backends() -> dict[str, object]:
    from torch.nn.attention import SDPBackend

    names = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
             "efficient": "EFFICIENT_ATTENTION"}
    return {name: getattr(SDPBackend, attr) for name, attr in names.items()
            if hasattr(SDPBackend, attr)}


def sdpa_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  timer: Timer) -> Baseline | None:
    """The fastest SDPA backend on q, k, v (None if none accepts them)."""
    call = _sdpa_call(q, k, v, causal)
    if q.device.type == "cpu":
        return Baseline("cpu", timer(call))
    return _fastest(lambda: call, timer)


def sdpa_backward_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           do: torch.Tensor, causal: bool, timer: Timer) -> Baseline | None:
    """The fastest SDPA backend's backward pass on q, k, v with upstream gradient `do`: only
    the gradient computation is timed, from a forward run once per backend (as flashgen's
    backward is timed from saved forward outputs)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    forward = _sdpa_call(*leaves, causal)

    def backward_call() -> Callable[[], object]:
        out = forward()  # inside the backend's context, so its backward is that backend's
        return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)

    if q.device.type == "cpu":
        return Baseline("cpu", timer(backward_call()))
    return _fastest(backward_call, timer)


def _fastest(make_call: Callable[[], Callable[[], object]], timer: Timer) -> Baseline | None:
    """Time the call that `make_call` prepares under each SDPA backend; the fastest wins."""
    from torch.nn.attention import sdpa_kernel

    best: Baseline | None = None
    for name, backend in _backends().items():
        try:
            # A backend that cannot take the problem raises (RuntimeError, or others on some
            # torch versions) after warning why; the warning is noise here, the skip is data.
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")
                call = make_call()
                call()
                timing = timer(call)
        except Exception:
            continue
        if best is None or timing.median_ms < best.timing.median_ms:
            best = Baseline(name, timing)
    return best
