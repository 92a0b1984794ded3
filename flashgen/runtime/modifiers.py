"""Modifiers (sliding window, softcap, sinks) and the packed variable-length layout: their
input checks and the extra kernel arguments they add.

Each modifier is a structure choice of the kernels (a flag of the call's `Shape`), while its
values (window sizes, the cap, the sink logits, the sequence offsets) are runtime arguments,
so one compiled kernel serves every window, cap and length mix. The kernels take the extra
arguments after their common ones, in this order: CU_Q, CU_K (varlen), WIN_LEFT, WIN_RIGHT
(window), SOFTCAP (softcap), SINKS (sinks), then for fp8 inputs the descales and their
strides.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .inputs import DTYPE_NAMES, MAX_HEAD_DIM, as_int, as_real


@dataclass(frozen=True)
class Varlen:
    """Packed sequences: sequence b is rows cu_q[b]:cu_q[b + 1] of q and cu_k[b]:cu_k[b + 1]
    of k and v; `max_q` / `max_k` bound their lengths (they size the grid). `offsets_q` and
    `offsets_k` are the same offsets on the host where the call read them (empty if not)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    offsets_q: tuple[int, ...] = ()
    offsets_k: tuple[int, ...] = ()

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1

    def schedule(self, block_m: int, causal: bool) -> tuple[torch.Tensor, int]:
        """The Q tiles of every sequence, costliest first, for kernels that walk a tile
        list: a (entries, 3) int32 tensor of (sequence, first row, last) on the offsets'
        device, and its length. See `tile_schedule`."""
        if not self.offsets_q or not self.offsets_k:
            raise ValueError("a tile schedule needs the offsets on the host (check_varlen)")
        return tile_schedule(self.offsets_q, self.offsets_k, block_m, causal,
                             self.cu_q.device)


@dataclass(frozen=True)
class Fp8:
    """fp8 (e4m3) inputs: their descales as (B, H, blocks of QUANT_BLOCK rows) fp32 views (a
    per-tensor descale expanded with zero strides, so the kernel reads one layout), and the
    output dtype."""

    descale_q: torch.Tensor
    descale_k: torch.Tensor
    descale_v: torch.Tensor
    out_dtype: torch.dtype

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, descales: tuple[torch.Tensor, ...],
           out_dtype: torch.dtype | None, block: int) -> Fp8:
        """From checked descales (`inputs.check_fp8`): 0-d, (1,) or (B, H, blocks)."""
        views = []
        for t, d in zip((q, k, k), descales, strict=True):
            b, h, n = t.shape[0], t.shape[1], t.shape[2]
            views.append(d.reshape(1, 1, 1).expand(b, h, -(-n // block)) if d.numel() == 1
                         and d.dim() < 3 else d)
        return cls(*views, out_dtype or torch.bfloat16)

    def kernel_args(self) -> list[Any]:
        return [self.descale_q, self.descale_k, self.descale_v, *self.descale_q.stride(),
                *self.descale_k.stride(), *self.descale_v.stride()]


@dataclass(frozen=True)
class Mods:
    """What a call adds to plain attention; None: not asked for. `window` is normalised:
    (-1, -1) (nothing cut) is None."""

    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (Hq,) fp32, contiguous
    varlen: Varlen | None = None
    fp8: Fp8 | None = None  # not a modifier flag: the Shape's dtype says fp8

    @property
    def flags(self) -> tuple[bool, bool, bool, bool]:
        """The structure this call needs: window, softcap, sinks, varlen (a `Shape`'s tail)."""
        return (self.window is not None, self.softcap is not None, self.sinks is not None,
                self.varlen is not None)

    @property
    def plan_key(self) -> tuple:
        """What a cached launch plan depends on beyond the tensors' shapes."""
        lens = (self.varlen.batch, self.varlen.max_q, self.varlen.max_k) if self.varlen else ()
        fp8 = (self.fp8.out_dtype,) if self.fp8 else ()
        return (*self.flags, *lens, *fp8)

    def kernel_args(self, causal: bool, n_q: int, n_k: int) -> list[Any]:
        """The extra kernel arguments, in the kernels' order (see the module docstring).
        An unbounded window side becomes a bound past every key (n_q + n_k); under causal
        the right side is at most 0 (the diagonal), which lets the kernels bound their loops
        by the window alone."""
        args: list[Any] = []
        if self.varlen is not None:
            args += [self.varlen.cu_q, self.varlen.cu_k]
        if self.window is not None:
            far = n_q + n_k + 1
            left, right = (far if w < 0 else w for w in self.window)
            args += [left, min(right, 0) if causal else right]
        if self.softcap is not None:
            args.append(float(self.softcap))
        if self.sinks is not None:
            args.append(self.sinks)
        if self.fp8 is not None:
            args += self.fp8.kernel_args()
        return args


def check_window(window: object) -> tuple[int, int] | None:
    """None, or a pair of ints >= -1 (-1: unbounded), returned as a tuple; (-1, -1) is None."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints, got {window!r}")
    try:
        left, right = (as_int("window", side) for side in window)
    except TypeError:
        raise TypeError(f"window must be a pair (left, right) of ints, got {window!r}") from None
    if min(left, right) < -1:
        raise ValueError(f"window sides must be >= -1 (-1: unbounded), got {window!r}")
    return None if (left, right) == (-1, -1) else (left, right)


def check_softcap(softcap: object) -> float | None:
    """None, or a finite real number > 0."""
    if softcap is None:
        return None
    softcap = as_real("softcap", softcap)
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a finite number > 0, got {softcap}")
    return softcap


def check_sinks(sinks: object, heads_q: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor | None:
    """None, or a (Hq,) tensor of q's dtype or float32 on q's device."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape ({heads_q},), got "
                        f"{type(sinks).__name__}")
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape ({heads_q},) (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if sinks.dtype not in (dtype, torch.float32):
        wanted = "torch.float32" if dtype == torch.float32 else f"{dtype} (q's dtype) or float32"
        raise TypeError(f"sinks must be {wanted}, got {sinks.dtype}")
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, q on {device}")
    return sinks


def kernel_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels read the sinks as a contiguous fp32 (Hq,) vector."""
    return None if sinks is None else sinks.detach().float().contiguous()


def checked_mods(q: torch.Tensor, window: object, softcap: object, sinks: object,
                 varlen: Varlen | None = None) -> Mods:
    """A call's modifiers, each checked (sinks as the kernels read them), with its packing."""
    return Mods(check_window(window), check_softcap(softcap),
                kernel_sinks(check_sinks(sinks, q.shape[1], q.dtype, q.device)), varlen)


def kvcache_mods(q: object, window: object, softcap: object, sinks: object) -> Mods | None:
    """The checked modifiers of a KV-cache call, None where it asks for none."""
    if window is None and softcap is None and sinks is None:
        return None
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise TypeError("q must be a 4-D torch.Tensor (B, Hq, Nq, D)")
    mods = checked_mods(q, window, softcap, sinks)
    return None if mods.flags == (False, False, False, False) else mods


def check_packed(q: object, k: object, v: object) -> None:
    """q (total_q, Hq, D), k and v (total_k, Hkv, D): types, ranks, dtypes, heads, dims."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim) for "
                             f"attention_varlen; got shape {tuple(t.shape)}")
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}; use float16, bfloat16 "
                            "or float32")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dims differ: q {q.shape[2]}, k {k.shape[2]}")
    if min(q.shape[1], k.shape[1]) == 0:
        raise ValueError(f"empty input: no heads (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads "
                         f"({k.shape[1]})")
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[2]} is over the supported maximum {MAX_HEAD_DIM}")
    if min(q.shape[1], q.shape[2]) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}")


#: Offsets read from the device, by tensor: a tensor read once is not read again (each read
#: is a GPU sync) until it is written in place (its version changes) or freed. A write torch
#: does not count (a collective such as `dist.broadcast` into the buffer, `.data`, a numpy
#: view, a custom kernel) is not seen by the checks; the kernels read the offsets on the
#: device every call, so they compute with the new ones all the same.
_READ: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}


def _read_offsets(cu: torch.Tensor) -> tuple[int, ...]:
    """`cu`'s values on the host: read (one sync) once per tensor and in-place version.
    Inference tensors keep no version, so they are read every time."""
    try:
        version = cu._version
    except RuntimeError:  # an inference tensor
        return tuple(cu.tolist())
    key = id(cu)
    held = _READ.get(key)
    if held is not None and held[0]() is cu and held[1] == version:
        return held[2]
    offsets = tuple(cu.tolist())  # one host read: the checks below cannot run on the device

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _READ.get(key, (None,))[0] is ref:
            del _READ[key]

    _READ[key] = (weakref.ref(cu, forget), version, offsets)
    return offsets


#: Tile schedules by offsets, tile height, mask, device and stream (`tile_schedule`), least
#: recently used dropped first: a training step reuses one packing across its layers. By
#: stream, so a table is only read on the stream that copied it (and freed there).
_SCHEDULES: OrderedDict[tuple, tuple[torch.Tensor, int]] = OrderedDict()
_SCHEDULES_KEPT = 32
_SCHEDULES_LOCK = threading.Lock()


def tile_schedule(offsets_q: tuple[int, ...], offsets_k: tuple[int, ...], block_m: int,
                  causal: bool, device: torch.device) -> tuple[torch.Tensor, int]:
    """Every Q tile of every packed sequence as (sequence, first row, last), sorted by the
    keys its rows see, most first (ties: sequence order), so programs that take tiles in
    list order start the long ones first and the short ones fill the tail (longest
    processing time first). Under the causal mask (bottom-right) a tile of rows
    [r, r + block_m) of a sequence of Lq queries and Lk keys sees min(Lk, r + block_m +
    Lk - Lq) keys. `last` marks each sequence's last tile; an empty sequence gets one entry
    (row 0, last, sorted at the end), so every sequence has a last entry: kernels read the
    offsets again on the device, and a last entry takes the rows past it where the offsets
    have grown since these were read. Returns a (entries, 3) int32 tensor on `device` (on
    a GPU, for the current stream) and the number of entries (the batch size at least).
    Cached."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (offsets_q, offsets_k, block_m, causal, device, stream)
    with _SCHEDULES_LOCK:
        found = _SCHEDULES.get(key)
        if found is not None:
            _SCHEDULES.move_to_end(key)
            return found
    tiles: list[tuple[int, int, int, int]] = []  # (-keys, sequence, first row, last)
    spans = zip(itertools.pairwise(offsets_q), itertools.pairwise(offsets_k), strict=True)
    for b, ((q0, q1), (k0, k1)) in enumerate(spans):
        lq, lk = q1 - q0, k1 - k0
        for row in range(0, max(lq, 1), block_m):
            keys = min(lk, max(0, row + block_m + lk - lq)) if causal else lk
            tiles.append((-keys if lq else 0, b, row, int(row + block_m >= lq)))
    tiles.sort()
    table = torch.tensor([t[1:] for t in tiles], dtype=torch.int32).view(-1, 3)
    if device.type == "cuda":  # pinned, so the copy queues behind earlier work, no wait
        table = table.pin_memory().to(device, non_blocking=True)
    found = (table, len(tiles))
    with _SCHEDULES_LOCK:
        _SCHEDULES[key] = found
        if len(_SCHEDULES) > _SCHEDULES_KEPT:
            _SCHEDULES.popitem(last=False)
    return found


@functools.lru_cache(maxsize=64)
def _longest(offsets: tuple[int, ...]) -> int:
    """The longest sequence of `offsets`, or -1 where they decrease. Cached: a packing is
    checked on every call that takes it (each layer, forward and backward)."""
    steps = [b - a for a, b in itertools.pairwise(offsets)]
    return -1 if any(n < 0 for n in steps) else max(steps)


def _check_cu(name: str, cu: object, total: int, device: torch.device) -> tuple[int, ...]:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 offsets, got "
                        f"{type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D (batch + 1,) with at least 2 entries, got shape "
                         f"{tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, q on {device}")
    if not cu.is_contiguous():  # the kernels read offset b at cu + b
        raise ValueError(f"{name} must be contiguous, got stride {cu.stride(0)}")
    offsets = _read_offsets(cu)
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    if _longest(offsets) < 0:
        raise ValueError(f"{name} must not decrease, got {list(offsets)}")
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {offsets[-1]}")
    return offsets


def check_varlen(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: object, cu_seqlens_k: object,
                 max_seqlen_q: object, max_seqlen_k: object) -> Varlen:
    """The offsets and bounds of a packed call (see `Varlen`), each bad one a named error."""
    cq = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    ck = cq if cu_seqlens_k is cu_seqlens_q and k.shape[0] == q.shape[0] else _check_cu(
        "cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {len(cq)} and {len(ck)}")
    max_seqlen_q, max_seqlen_k = (as_int("max_seqlen_q", max_seqlen_q),
                                  as_int("max_seqlen_k", max_seqlen_k))
    for name, bound, offsets in (("max_seqlen_q", max_seqlen_q, cq),
                                 ("max_seqlen_k", max_seqlen_k, ck)):
        longest = _longest(offsets)
        if bound < longest:
            raise ValueError(f"{name} ({bound}) is smaller than the longest sequence "
                             f"({longest})")
    assert isinstance(cu_seqlens_q, torch.Tensor) and isinstance(cu_seqlens_k, torch.Tensor)
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    return Varlen(cu_seqlens_q, cu_seqlens_k, max(1, max_seqlen_q), max(1, max_seqlen_k), cq,
                  ck)
