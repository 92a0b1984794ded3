"""Input checks for the public calls: bad input gets a named error, never a Triton crash."""

from __future__ import annotations

import math
import os

import torch

#: The dtypes the kernels take, by the short names tables and tuning keys use.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
}
#: The longest head dim the kernels tile (their register and shared-memory budgets).
MAX_HEAD_DIM = 256


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise TypeError/ValueError naming the problem if q, k, v cannot go to a kernel."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seq, head_dim); got shape {tuple(t.shape)}"
            )
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(
                f"{name} has unsupported dtype {t.dtype}; use float16, bfloat16 or float32"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {q.device}; use a CUDA GPU")
    bq, hq, nq, d = q.shape
    bk, hk, nk, dk = k.shape
    bv, hv, nv, dv = v.shape
    if not (bq == bk == bv):
        raise ValueError(f"batch sizes differ: q {bq}, k {bk}, v {bv}")
    if hk != hv:
        raise ValueError(f"k and v must have the same number of heads; got {hk} and {hv}")
    if nk != nv:
        raise ValueError(f"k and v must have the same sequence length; got {nk} and {nv}")
    if not (d == dk == dv):
        raise ValueError(f"head dims differ: q {d}, k {dk}, v {dv}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is over the supported maximum {MAX_HEAD_DIM}")
    if min(bq, hq, hk, nq, nk, d) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")


def check_options(causal: object, scale: object) -> None:
    """`causal` must be a bool and `scale` None or a finite, nonzero real number: anything else
    would reach the kernel as a wrong mask, a Triton type error, or a constant that turns every
    output into NaN (nan, inf) or a plain mean of v (0)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if scale == 0:
        raise ValueError("scale must be nonzero (0 would ignore q and k); None means 1/sqrt(D)")


def check_runnable(device: torch.device, dtype: torch.dtype | None = None) -> None:
    """CPU tensors can only run under the Triton interpreter: say so instead of crashing. And
    the interpreter computes bf16 dot products wrongly (errors of order 1e8, no exception), so
    bf16 there is refused rather than answered with garbage."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cpu" and not interpreted:
        raise ValueError(
            "CPU tensors run only under the Triton interpreter: set "
            "TRITON_INTERPRET=1 before triton is imported, or move them to a GPU"
        )
    if dtype == torch.bfloat16 and (interpreted or device.type == "cpu"):
        raise TypeError(
            "bf16 (torch.bfloat16) needs a GPU: Triton's interpreter computes bf16 dot "
            "products wrongly; use float16 or float32 on the CPU, or move the tensors to a GPU"
        )
