"""Runtime of a package written by `flashgen export`: tuned attention with only torch and triton.

flashgen copies this file verbatim as the exported package's `__init__.py`; flashgen itself
never imports it. It must not import flashgen, jinja2, optuna or sqlite-utils: the package
runs where none of them is installed. Everything it knows comes from `table.json` beside it,
and every kernel is a rendered Triton source under `kernels/` (Triton's JIT reads a kernel's
source back from its file, so they are real modules, not strings).

Dispatch follows flashgen's: an exact (dtype, causal, head dim, GQA ratio, Nq bucket, Nk
bucket) hit; else the nearest tuned bucket of the same kind whose tiles fit the lengths (the
"block longer than the sequence" rule, precomputed as the smallest power-of-two length each
tile needs); else the default variant of (dtype, causal, head dim), precomputed per clamped
length bucket. On a GPU or Triton version other than the tuned ones, one warning says so and
only the generic defaults (valid on any GPU Triton supports) are used.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton

_TABLE = json.loads((Path(__file__).with_name("table.json")).read_text(encoding="utf-8"))
#: The device name flashgen gives the Triton interpreter (CPU tensors, TRITON_INTERPRET=1).
CPU_INTERPRETER = "cpu-interpreter"
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_MAX_HEAD_DIM = 256
_LENGTHS: list[int] = _TABLE["lengths"]  # default-table buckets; blocks never exceed the last

__all__ = ["Choice", "attention", "explain", "tuned_gpus"]


class Choice(NamedTuple):
    """Which exported kernel a call runs and why (see `explain`)."""

    #: role -> kernels/ module: "fwd" (and "fwd_plain", a use_tma or fa3 kernel's pointer twin
    #: for unaligned inputs), or "preprocess", "dkdv" and "dq" for the backward
    kernels: dict[str, str]
    variant: dict[str, Any]
    how: str  # "exact", "nearest" or "default"
    reason: str
    #: the variant of the "<role>_plain" kernels, where there are any: what runs on inputs
    #: that TMA cannot address
    twin: dict[str, Any] | None = None


def tuned_gpus() -> dict[str, str]:
    """GPU name -> the Triton version it was tuned with, for every GPU in the table."""
    return {name: t["triton_version"] for name, t in _TABLE["gpus"].items()}


# ---- tables ----------------------------------------------------------------------------------


def _family(e: dict[str, Any]) -> tuple:
    return (e["dtype"], e["causal"], e["head_dim"])


class _Table:
    """One GPU's winners and defaults, indexed for lookup."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.tuned: dict[str, dict[tuple, list[dict[str, Any]]]] = {"fwd": {}, "bwd": {}}
        self.defaults: dict[str, dict[tuple, dict[tuple[int, int], dict[str, Any]]]] = {}
        for mode in ("fwd", "bwd"):
            for e in data.get(mode, []):
                self.tuned[mode].setdefault((*_family(e), e["gqa"]), []).append(e)
            grid = self.defaults.setdefault(mode, {})
            for e in data[f"{mode}_defaults"]:
                grid.setdefault(_family(e), {})[(e["seq_q_bucket"], e["seq_k_bucket"])] = e


_GENERIC = _Table(_TABLE["generic"])


@functools.cache
def _table(gpu_name: str) -> _Table:
    """The table for `gpu_name`, or the generic defaults if it was not tuned, or was tuned
    with another Triton: the tuned choices may not hold there. Cached, so it warns once."""
    data = _TABLE["gpus"].get(gpu_name)
    if data is None:
        warnings.warn(
            f"{__name__}: kernels were tuned for {sorted(_TABLE['gpus']) or 'no GPU'}, not "
            f"{gpu_name}; using the generic default variants", RuntimeWarning, stacklevel=2,
        )
        return _GENERIC
    if data["triton_version"] != triton.__version__:
        warnings.warn(
            f"{__name__}: kernels for {gpu_name} were tuned with Triton "
            f"{data['triton_version']}, this is Triton {triton.__version__}; using the generic "
            "default variants", RuntimeWarning, stacklevel=2,
        )
        return _GENERIC
    return _Table(data)


@functools.cache
def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return CPU_INTERPRETER
    return torch.cuda.get_device_name(device)


# ---- choosing --------------------------------------------------------------------------------


def _bucket(n: int) -> int:
    """flashgen's sequence bucket: the next power of two (n itself if it is one)."""
    return 1 << (n - 1).bit_length()


def _fits(e: dict[str, Any], nq: int, nk: int) -> bool:
    """The tile rule: a block may not be longer than the next power of two (>= 16) of the
    length it tiles; `need` holds the smallest such length per side."""
    need_q, need_k = e["need"]
    return max(16, _bucket(nq)) >= need_q and max(16, _bucket(nk)) >= need_k


def _heads_fit(var: dict[str, Any], nq: int, heads: int, sms: int) -> bool:
    """flashgen's dispatch check `space.head_units_leave_programs_idle`, repeated here (the
    runtime cannot import it): a whole-heads winner serves only launches with heads enough
    to keep its programs as busy as tile pairs would; a small batch takes the next winner."""
    if not var.get("head_units"):
        return True
    num_m = _cdiv(nq, var["block_m"])
    programs = min(num_m * heads, sms)
    return (_cdiv(heads, programs) * num_m * (num_m + 1) // 2
            <= _cdiv(heads * _cdiv(num_m, 2), programs) * (num_m + 1))


def _clamp(n: int) -> int:
    return min(_LENGTHS[-1], max(_LENGTHS[0], _bucket(n)))


@functools.lru_cache(maxsize=4096)  # per shape: later calls skip the search
def _choose(mode: str, table: _Table, dtype: str, causal: bool, d: int, group: int, nq: int,
            nk: int, heads: int, sms: int) -> Choice:
    want_q, want_k = _bucket(nq), _bucket(nk)

    def distance(e: dict[str, Any]) -> tuple[float, int]:
        dq = abs(math.log2(e["seq_q_bucket"] / want_q))
        dist = dq + abs(math.log2(e["seq_k_bucket"] / want_k))
        return dist, -e["seq_q_bucket"]  # ties: the longer bucket, as flashgen does

    for e in sorted(table.tuned[mode].get((dtype, causal, d, group), []), key=distance):
        if not _fits(e, nq, nk) or not _heads_fit(e["variant"], nq, heads, sms):
            continue
        got = (e["seq_q_bucket"], e["seq_k_bucket"])
        if got == (want_q, want_k):
            return Choice(e["kernels"], e["variant"], "exact", f"tuned winner for bucket {got}",
                          e.get("twin"))
        return Choice(e["kernels"], e["variant"], "nearest",
                      f"no winner for bucket {(want_q, want_k)}; nearest valid tuned bucket {got}",
                      e.get("twin"))
    for source in (table, _GENERIC):
        grid = source.defaults[mode].get((dtype, causal, d))
        if grid is not None:
            e = grid[(_clamp(nq), _clamp(nk))]
            why = "generic default" if source is _GENERIC else "default"
            return Choice(e["kernels"], e["variant"], "default",
                          f"{why}: nothing tuned fits {dtype} causal={causal} D={d} GQA={group}",
                          e.get("twin"))
    have = sorted({f"{k[0]} causal={k[1]} D={k[2]}" for k in _GENERIC.defaults[mode]})
    raise ValueError(
        f"this export has no {mode} kernel for {dtype} causal={causal} head dim {d}; it holds: "
        f"{', '.join(have)}. Export again from a database tuned for this kind of problem."
    )


# ---- checks ----------------------------------------------------------------------------------


def _check(q: Any, k: Any, v: Any, causal: Any, scale: Any) -> None:
    """Every bad input is a named TypeError/ValueError here, never a Triton crash."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seq, head_dim); got {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has unsupported dtype {t.dtype}; use float16, bfloat16 or float32"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if q.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("CPU tensors run only under the Triton interpreter: set "
                             "TRITON_INTERPRET=1 before triton is imported, or use a GPU")
    elif q.device.type != "cuda":
        raise ValueError(f"unsupported device {q.device}; use a CUDA GPU")
    (bq, hq, nq, d), (bk, hk, nk, dk), (bv, hv, nv, dv) = q.shape, k.shape, v.shape
    if not (bq == bk == bv):
        raise ValueError(f"batch sizes differ: q {bq}, k {bk}, v {bv}")
    if hk != hv or nk != nv:
        raise ValueError(f"k and v must have the same heads and length; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (d == dk == dv):
        raise ValueError(f"head dims differ: q {d}, k {dk}, v {dv}")
    if min(bq, hq, hk, nq, nk, d) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    if d > _MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is over the supported maximum {_MAX_HEAD_DIM}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")


# ---- launching -------------------------------------------------------------------------------


@functools.cache
def _kernel(module: str, function: str) -> Any:
    return getattr(importlib.import_module(f"{__name__}.kernels.{module}"), function)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: one "SM", so persistent programs walk every tile
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fa2_grid(var: dict[str, Any], nq: int, heads: int, device: torch.device) -> tuple:
    """(Q-tile programs per head, heads); a persistent variant caps the first axis near
    `persistent` programs per SM, and its programs walk several tiles each."""
    tiles, per_sm = _cdiv(nq, var["block_m"]), var.get("persistent", 0)
    if not per_sm:
        return tiles, heads
    return max(1, min(tiles, _cdiv(_sm_count(device) * per_sm, heads))), heads


def _fa3_grid(var: dict[str, Any], nq: int, heads: int, device: torch.device) -> tuple:
    """(grid, extra arguments) of an fa3 kernel: a program per (Q tile, head), or on a
    persistent grid a program per SM, the kernel then taking the number of heads last."""
    tiles = _cdiv(nq, var["block_m"])
    if not var.get("persistent"):
        return (tiles, heads), ()
    return (min(tiles * heads, _sm_count(device)),), (heads,)


def _problem(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple:
    return (_DTYPES[q.dtype], causal, q.shape[3], q.shape[1] // k.shape[1], q.shape[2],
            k.shape[2])


def _pick(mode: str, q: torch.Tensor, k: torch.Tensor, causal: bool) -> Choice:
    return _choose(mode, _table(_device_name(q.device)), *_problem(q, k, causal),
                   q.shape[0] * q.shape[1], _sm_count(q.device))


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need a unit last stride and 16-byte aligned rows and base address."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _descriptor(t: torch.Tensor, rows: int, cols: int) -> Any:
    """A TMA descriptor over the (B, H, N, D) view moving [1, 1, rows, cols] tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])


@functools.cache
def _gluon_tile_layout(rows: int, cols: int, dtype: torch.dtype) -> Any:
    """The widest swizzle a [1, 1, rows, cols] tile allows (~10 us of Python: cached)."""
    from triton.experimental.gluon import language as gl

    element = gl.float16 if dtype == torch.float16 else gl.bfloat16
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], element)


def _gluon_descriptor(t: torch.Tensor, rows: int) -> Any:
    """A Gluon TMA descriptor over the (B, H, N, D) view moving [1, 1, rows, D] tiles (fa3)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    cols = t.shape[-1]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols],
                            _gluon_tile_layout(rows, cols, t.dtype))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    choice = _pick("fwd", q, k, causal)
    var = choice.variant
    b, hq, nq, d = q.shape
    nk, group = k.shape[2], hq // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    padded = max(16, 1 << (d - 1).bit_length())
    tail = (*lse.stride()[:2], scale, nq, nk, hq, group)
    launch = {"num_warps": var["num_warps"], "num_stages": var["num_stages"]}
    if var["loop_order"] == "fa3" and _tma_ready(q, k, v, out):
        # Gluon kernel: each consumer warpgroup moves its own 16 x num_warps rows of Q and O.
        rows, bn = 16 * var["num_warps"], var["block_n"]
        grid, extra = _fa3_grid(var, nq, b * hq, q.device)
        _kernel(choice.kernels["fwd"], "attn_fwd")[grid](
            _gluon_descriptor(q, rows), _gluon_descriptor(k, bn), _gluon_descriptor(v, bn),
            _gluon_descriptor(out, rows), lse, *tail, *extra, num_warps=var["num_warps"],
        )  # fmt: skip
        return out, lse
    if var.get("use_tma") and _tma_ready(q, k, v, out):
        bm, bn = var["block_m"], var["block_n"]
        _kernel(choice.kernels["fwd"], "attn_fwd")[_fa2_grid(var, nq, b * hq, q.device)](
            _descriptor(q, bm, padded), _descriptor(k, bn, padded), _descriptor(v, bn, padded),
            _descriptor(out, bm, padded), lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *tail, **launch,
        )  # fmt: skip
        return out, lse
    args: tuple = (q, k, v, out, lse)
    # A TMA kernel's twin has its own tiles and grid (an fa3 twin is a plain fa2 kernel).
    var = choice.twin or var
    launch = {"num_warps": var["num_warps"], "num_stages": var["num_stages"]}
    if var["loop_order"] == "fa1":
        # fa1 keeps the running output, max and sum in fp32 scratch between K/V tiles.
        acc = torch.zeros((b * hq, nq, padded), device=q.device, dtype=torch.float32)
        m = torch.full((b * hq, nq), float("-inf"), device=q.device, dtype=torch.float32)
        lsum = torch.zeros((b * hq, nq), device=q.device, dtype=torch.float32)
        args, grid = (*args, acc, m, lsum), (b * hq,)
    else:
        grid = _fa2_grid(var, nq, b * hq, q.device)
    name = choice.kernels.get("fwd_plain", choice.kernels["fwd"])  # a TMA kernel's twin
    _kernel(name, "attn_fwd")[grid](
        *args, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *tail, **launch,
    )  # fmt: skip
    return out, lse


def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, causal: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    choice = _pick("bwd", q, k, causal)
    var, names = choice.variant, dict(choice.kernels)
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa3 = var.get("fa3", "none")
    if fa3 != "none" and (lse.stride(-1) != 1 or not _tma_ready(q, k, v, do, dq, dk, dv)):
        # The Gluon kernels need TMA-addressable rows; the Triton twin computes the same.
        assert choice.twin is not None, "an fa3 backward entry ships its twin"
        var, fa3 = choice.twin, "none"
        names.update(dkdv=names["dkdv_plain"], dq=names["dq_plain"])
    launch = {"num_warps": var["num_warps"], "num_stages": var["num_stages"]}
    delta = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    _kernel(names["preprocess"], "attn_bwd_preprocess")[
        (_cdiv(nq, _TABLE["preprocess_block_m"]), b * hq)
    ](out, do, delta, *out.stride(), *do.stride(), *delta.stride(), nq, hq)
    tail = (scale, nq, nk)
    if fa3 == "both":
        # Gluon dK/dV: consumers own 64 keys each; Q and dO stream in block_m-row tiles.
        bm = var["block_m"]
        _kernel(names["dkdv"], "attn_bwd_dkdv")[(_cdiv(nk, var["block_n"]), b * hkv)](
            *(_gluon_descriptor(t, r) for t, r in ((q, bm), (k, 64), (v, 64), (do, bm),
                                                   (dk, 64), (dv, 64))),
            lse, delta, *lse.stride()[:2], *delta.stride()[:2], *tail, hkv, hq // hkv,
            num_warps=4,
        )  # fmt: skip
    else:
        atomic = var["dq_mode"] == "atomic"
        # Atomic mode sums each K block's share of dQ into a zeroed fp32 buffer.
        dq_acc = (torch.zeros((b, hq, nq, d), device=q.device, dtype=torch.float32)
                  if atomic else dq)
        _kernel(names["dkdv"], "attn_bwd_dkdv")[(_cdiv(nk, var["block_n"]), b * hkv)](
            q, k, v, do, lse, delta, dk, dv, dq_acc,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(),
            *delta.stride(), *dk.stride(), *dv.stride(), *dq_acc.stride(),
            *tail, hkv, hq // hkv, **launch,
        )  # fmt: skip
        if atomic:
            dq.copy_(dq_acc)
            return dq, dk, dv
    if fa3 != "none":
        # Gluon dQ: consumers own 64 query rows each; K and V stream in dq_block_m-row tiles
        # (0 or absent: block_m).
        bm = var.get("dq_block_m") or var["block_m"]
        _kernel(names["dq"], "attn_bwd_dq")[(_cdiv(nq, var["block_n"]), b * hq)](
            *(_gluon_descriptor(t, r) for t, r in ((q, 64), (k, bm), (v, bm), (do, 64),
                                                   (dq, 64))),
            lse, delta, *lse.stride()[:2], *delta.stride()[:2], *tail, hq, hq // hkv,
            num_warps=4,
        )  # fmt: skip
    else:
        # The dQ kernel owns block_n query rows per program (flashgen's BwdVariant pair swap).
        _kernel(names["dq"], "attn_bwd_dq")[(_cdiv(nq, var["block_n"]), b * hq)](
            q, k, v, do, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(),
            *delta.stride(), *dq.stride(), *tail, hq, hq // hkv, **launch,
        )  # fmt: skip
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """Saves only q, k, v, the output and the log-sum-exp: the backward recomputes blocks."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _grad_lse: Any) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention softmax(q k^T * scale) v, q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D).

    The same call as `flashgen.attention`: GQA/MQA (Hq % Hkv == 0), causal masking aligned
    bottom-right when Nq != Nk, any strides, default scale 1/sqrt(D). Differentiable in q, k
    and v (no gradient flows through the log-sum-exp). Returns the output (like q), and with
    `return_lse` also the log-sum-exp (B, Hq, Nq) fp32.
    """
    _check(q, k, v, causal, scale)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _Attention.apply(q, k, v, causal, scale)
    else:
        out, lse = _forward(q, k, v, causal, scale)
    return (out, lse) if return_lse else out


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
            backward: bool = False) -> Choice:
    """Which kernel `attention(q, k, v, causal=...)` runs (its backward with `backward`), how
    it was found (exact, nearest, default) and why."""
    _check(q, k, v, causal, None)
    return _pick("bwd" if backward else "fwd", q, k, causal)


def _check_at_import() -> None:
    """Say at import, not at the first call, when this GPU or Triton is not the tuned one."""
    if torch.cuda.is_available():
        _table(torch.cuda.get_device_name())
    elif os.environ.get("TRITON_INTERPRET") == "1":
        _table(CPU_INTERPRETER)


_check_at_import()
