"""Input checks for the public calls: bad input gets a named error, never a Triton crash."""

from __future__ import annotations

import math
import numbers
import operator

import torch

from .interpreter import check_interpreter_ready, on_interpreter
from .quantize import FP8_DTYPE, QUANT_BLOCK

#: The dtypes the kernels take, by the short names tables and tuning keys use.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
}
#: The longest head dim the kernels tile (their register and shared-memory budgets).
MAX_HEAD_DIM = 256


#: Every fp8 dtype torch has; only `FP8_DTYPE` (e4m3fn) is taken.
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                        torch.float8_e5m2fnuz})
#: The output dtypes of fp8 attention (bf16 the default), and the least compute capability
#: with fp8 tensor cores (Ada, sm89; Hopper and Blackwell after it).
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)
FP8_MIN_CAPABILITY = (8, 9)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: bool = False,
                 empty: bool = False) -> None:
    """Raise TypeError/ValueError naming the problem if q, k, v cannot go to a kernel
    (`fp8`: `check_fp8` has vetted their dtypes; `empty`: a batch or a length of 0 is fine,
    for a call answered without one)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seq, head_dim); got shape {tuple(t.shape)}"
            )
        if t.dtype not in DTYPE_NAMES and not (fp8 and t.dtype == FP8_DTYPE):
            raise TypeError(
                f"{name} has unsupported dtype {t.dtype}; use float16, bfloat16 or float32"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {q.device}; use a CUDA GPU (or the CPU with "
                         "TRITON_INTERPRET=1 set before triton is imported)")
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
    if min(hq, hk) == 0:
        raise ValueError(f"empty input: no heads (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is over the supported maximum {MAX_HEAD_DIM}")
    if d == 0 or (min(bq, nq, nk) == 0 and not empty):
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")


def as_int(name: str, value: object) -> int:
    """`value` as an int: Python ints and what stands for one (numpy ints, 0-d integer
    tensors: `operator.index`), never a bool."""
    if type(value) is int:
        return value  # type: ignore[return-value]
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type_name(value)}")


def type_name(value: object) -> str:
    """`value`'s type for an error, module-qualified outside the builtins: numpy's bool
    calls itself "bool", so "causal must be a bool, got bool" said nothing."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__name__
    return f"{kind.__module__}.{kind.__qualname__}"


def as_real(name: str, value: object) -> float:
    """`value` as a float: Python and numpy real numbers, never a bool."""
    if type(value) is float:
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type_name(value)}")
    return float(value)


def check_options(causal: object, scale: object, return_lse: object = False) -> float | None:
    """`causal` and `return_lse` must be bools and `scale` None or a finite, positive real
    number, returned as a float: anything else would reach the kernel as a wrong mask, a
    Triton type error, or a constant that turns every output into NaN (nan, inf; a negative
    scale turns the softmax's running max into a min and a masked score's -inf into +inf)
    or a plain mean of v (0)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type_name(causal)}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type_name(return_lse)}")
    if scale is None:
        return None
    scale = as_real("scale", scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if scale == 0:
        raise ValueError("scale must be nonzero (0 would ignore q and k); None means 1/sqrt(D)")
    if scale < 0:
        raise ValueError(f"scale must be positive, got {scale} (the kernels' running max "
                         "assumes it); None means 1/sqrt(D)")
    return scale


def check_dispatcher(dispatcher: object, kind: type) -> None:
    """`dispatcher` must be None or a `kind` (a runtime Dispatcher)."""
    if dispatcher is not None and not isinstance(dispatcher, kind):
        raise TypeError(f"dispatcher must be a {kind.__module__.partition('.')[0]}.Dispatcher "
                        f"or None, got {type(dispatcher).__name__}")


def check_runnable(device: torch.device, dtype: torch.dtype | None = None) -> None:
    """CPU tensors can only run under the Triton interpreter: say so instead of crashing. And
    the interpreter computes bf16 dot products wrongly (errors of order 1e8, no exception), so
    bf16 there is refused rather than answered with garbage."""
    interpreted = on_interpreter()
    if device.type == "cpu" and not interpreted:
        raise ValueError(
            "CPU tensors run only under the Triton interpreter: set "
            "TRITON_INTERPRET=1 before triton is imported, or move them to a GPU"
        )
    if device.type == "cpu":
        check_interpreter_ready()
    if dtype == torch.bfloat16 and (interpreted or device.type == "cpu"):
        raise TypeError(
            "bf16 (torch.bfloat16) needs a GPU: Triton's interpreter computes bf16 dot "
            "products wrongly; use float16 or float32 on the CPU, or move the tensors to a GPU"
        )


def _is_fp8(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def asks_for_fp8(q: object, k: object, v: object, descales: tuple[object, ...],
                 out_dtype: object) -> bool:
    """Whether a call has anything fp8 about it (an fp8 input, a descale, an `out_dtype`):
    the cheap gate in front of `check_fp8`, which a plain call then skips (~0.2 us against
    ~0.8 us on the CPU machine; every `attention` call pays it)."""
    dq, dk, dv = descales
    return (out_dtype is not None or dq is not None or dk is not None or dv is not None
            or getattr(q, "dtype", None) in FP8_DTYPES or getattr(k, "dtype", None) in FP8_DTYPES
            or getattr(v, "dtype", None) in FP8_DTYPES)


def check_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              descales: tuple[torch.Tensor | None, ...], out_dtype: torch.dtype | None) -> bool:
    """Whether q, k, v are fp8 inputs, all checked: True when all three are `FP8_DTYPE` with
    good (descale_q, descale_k, descale_v) and `out_dtype`; False when none is fp8 (then
    descales are refused and `out_dtype` must be None or q's dtype). Anything between is a
    named error: mixed dtypes, another fp8 format, missing or misshapen descales."""
    names = ("descale_q", "descale_k", "descale_v")
    if not any(_is_fp8(t) for t in (q, k, v)):
        for name, d in zip(names, descales, strict=True):
            if d is not None:
                raise ValueError(f"{name} is only for fp8 inputs; q is {_dtype_of(q)}")
        if out_dtype is not None and out_dtype != getattr(q, "dtype", None):
            raise ValueError(f"out_dtype is only for fp8 inputs (the output of {_dtype_of(q)} "
                             "inputs is in their dtype); leave it None")
        return False
    if not all(_is_fp8(t) for t in (q, k, v)):
        raise TypeError(f"mixed fp8 and non-fp8 inputs: q {_dtype_of(q)}, k {_dtype_of(k)}, "
                        f"v {_dtype_of(v)}; quantize all three (flashgen.fp8.quantize)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} is {t.dtype}, which flashgen does not support: fp8 "
                            f"inputs must be {FP8_DTYPE} (flashgen.fp8.quantize makes them)")
    check_inputs(q, k, v, fp8=True)
    for name, t, d in zip(names, (q, k, v), descales, strict=True):
        _check_descale(name, t, d)
    if out_dtype is not None and out_dtype not in FP8_OUT_DTYPES:
        raise TypeError(f"out_dtype of fp8 attention must be torch.bfloat16 (the default) or "
                        f"torch.float16, got {out_dtype}")
    return True


def _dtype_of(t: object) -> str:
    return str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_descale(name: str, t: torch.Tensor, d: object) -> None:
    """A descale is fp32 on t's device: 0-d or (1,) for a per-tensor scale, else one per
    (batch, head, block of QUANT_BLOCK rows) of t."""
    if d is None:
        raise ValueError(f"fp8 inputs need descale_q, descale_k and descale_v (fp32, per "
                         f"tensor or per block of {QUANT_BLOCK} rows); {name} is missing: "
                         "flashgen.fp8.quantize returns them")
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {d.dtype}")
    if d.device != t.device:
        raise ValueError(f"{name} is on {d.device} but its input is on {t.device}")
    b, h, n, _ = t.shape
    blocked = (b, h, -(-n // QUANT_BLOCK))
    if tuple(d.shape) not in ((), (1,), blocked):
        raise ValueError(f"{name} has shape {tuple(d.shape)}; expected () or (1,) for a "
                         f"per-tensor scale, or {blocked} (batch, heads, "
                         f"ceil({n} / {QUANT_BLOCK})) for per-block scales")


def check_fp8_device(device: torch.device, capability: tuple[int, int] | None = None) -> None:
    """fp8 needs fp8 tensor cores (compute capability >= 8.9). On the CPU only Triton's
    interpreter runs it (it computes e4m3 products exactly: for tests, not speed).
    `capability` stands in for the device's (tests)."""
    if device.type != "cuda":
        if device.type == "cpu" and on_interpreter():
            return
        raise TypeError("fp8 attention needs a GPU with fp8 tensor cores (compute capability "
                        f"8.9 or newer), or Triton's interpreter (TRITON_INTERPRET=1) for CPU "
                        f"tensors; {device.type} tensors cannot run it here")
    major, minor = capability or torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        raise TypeError(f"fp8 attention needs fp8 tensor cores (compute capability 8.9 or "
                        f"newer); {device} has {major}.{minor}: use bf16 or fp16 on it")
