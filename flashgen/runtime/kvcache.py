"""The decode family's inputs and launches: a few queries against a long KV cache.

`check_kvcache` turns the arguments of `attention_with_kvcache` into a `DecodeShape` (or a
named error); `prepare_decode` loads an entry's kernels once and returns a function that
launches them: the split-KV pass (`templates/attn_decode_split.py.jinja`), and where a
sequence's keys are cut into several runs, the combine pass (for a `fused_combine` variant,
the split pass's last program of each tile: `split_counters`). Like every runtime module it
imports only torch, triton and the standard library (exports copy it verbatim).

Checks that read the values of `cache_seqlens` or `block_table` need them on the host. Where
they already are there (CPU tensors: the interpreter) they always run; for GPU tensors they
run only with FLASHGEN_DEBUG=1, because reading them back is a GPU sync on every call (a
decode step is a few microseconds of kernel). Without it the kernel clamps each length to
[0, cache capacity], so a bad length reads nothing out of bounds; a bad page id does.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from .forward import cdiv, padded_head_dim, sm_count
from .inputs import DTYPE_NAMES, MAX_HEAD_DIM
from .launch import bind, hooks_idle, int_spec, launch_context
from .modifiers import Mods
from .table import Entry, knobs

#: (q, k_cache, v_cache, cache_seqlens or None (every sequence full), block_table or None,
#: scale[, mods, cache_leftpad, keep_lse]) -> (out, lse); with keep_lse False the LSE is in
#: the stream's scratch buffer (`split_scratch`), for a caller that drops it
DecodeLauncher = Callable[..., tuple[torch.Tensor, torch.Tensor]]
KernelOf = Callable[[str], Any]

#: `attention` runs the decode family when Nq is at most this and Nk at least
#: DECODE_MIN_SEQ_K and DECODE_KEYS_PER_QUERY times Nq: there the forward's 16-row Q tile
#: per query head would read K/V once per query head with few programs per SM.
DECODE_MAX_SEQ_Q = 16
DECODE_MIN_SEQ_K = 256
DECODE_KEYS_PER_QUERY = 16
#: The most splits the launcher picks by itself; the combine holds splits x D fp32 a row.
MAX_AUTO_SPLITS = 64
#: Key tiles a split takes at least when the launcher picks the count: fewer and the
#: partial rows written and combined cost more than the keys they split.
MIN_TILES_PER_SPLIT = 2


#: flashgen's `DecodeProblem` fields, in its order, as one list (as `table.Shape` does).
_DECODE_SHAPE = NamedTuple("_DECODE_SHAPE", [  # noqa: UP014
    ("batch", int), ("heads_q", int), ("heads_kv", int), ("seq_q", int), ("seq_k", int),
    ("head_dim", int), ("dtype", str), ("causal", bool), ("page_size", int),
    ("window", bool), ("softcap", bool), ("sinks", bool), ("leftpad", bool)])
_DECODE_SHAPE.__new__.__defaults__ = (False, False, False, False)


class DecodeShape(_DECODE_SHAPE):
    """What a decode call asks for. seq_k is the cache capacity (Nmax, or max_pages x
    page_size: the lengths are on the device); page_size 0 is a contiguous cache; window,
    softcap and sinks say which modifiers its kernels render, leftpad whether each sequence
    starts at its own offset (`cache_leftpad`)."""

    __slots__ = ()

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        cache = f"paged{self.page_size}" if self.page_size else "contiguous"
        mods = "".join(f" {n}" for n in ("window", "softcap", "sinks", "leftpad")
                       if getattr(self, n))
        return (f"B{self.batch} Hq{self.heads_q} Hkv{self.heads_kv} Nq{self.seq_q} "
                f"Nk{self.seq_k} D{self.head_dim} {self.dtype} {mask} decode {cache}{mods}")


def serves_as_decode(nq: int, nk: int) -> bool:
    """Whether `attention` with Nq queries against Nk keys runs the decode family (same
    function: bottom-right causal alignment is the decode kernels' own)."""
    return (nq <= DECODE_MAX_SEQ_Q and nk >= DECODE_MIN_SEQ_K
            and nk >= DECODE_KEYS_PER_QUERY * nq)


def debug_checks() -> bool:
    """FLASHGEN_DEBUG=1: check lengths and page ids on the host even for GPU tensors."""
    return os.environ.get("FLASHGEN_DEBUG") == "1"


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None,
                  causal: bool, cache_leftpad: torch.Tensor | None = None,
                  empty: bool = False) -> DecodeShape:
    """Raise TypeError/ValueError naming the problem, else the call's `DecodeShape`
    (`empty`: a batch or Nq of 0 is fine, for a call answered without a kernel).
    `cache_seqlens` None: every sequence holds the whole cache."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D; got shape {tuple(t.shape)}")
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}; use float16, bfloat16 "
                            "or float32")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache, v_cache must share a dtype; got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    seqlens = None if cache_seqlens is None else _tensor("cache_seqlens", cache_seqlens)
    if seqlens is not None and seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {seqlens.dtype}")
    b, hq, nq, d = q.shape
    if block_table is None and k_cache.shape[0] != b:
        # Named before cache_seqlens' shape, which follows q's batch: the caches are the odd
        # one out more often.
        raise ValueError(f"batch sizes differ: q {b}, k_cache {k_cache.shape[0]} (a contiguous "
                         "cache is (B, Hkv, Nmax, D); pass block_table for a paged one)")
    if seqlens is not None and seqlens.shape != (b,):
        raise ValueError(f"cache_seqlens must have shape (batch,) = ({b},); got "
                         f"{tuple(seqlens.shape)}")
    if block_table is None:
        _, hkv, n_max, dk = k_cache.shape
        page_size = 0
    else:
        table = _tensor("block_table", block_table)
        if table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {table.dtype}")
        if table.dim() != 2 or table.shape[0] != b or table.shape[1] < 1:
            raise ValueError(f"block_table must have shape (batch, max_pages) with batch {b}; "
                             f"got {tuple(table.shape)}")
        _, page_size, hkv, dk = k_cache.shape
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size (k_cache.shape[1] of a paged cache (num_pages, "
                             f"page_size, Hkv, D)) must be a power of two, got {page_size} "
                             f"(k_cache {tuple(k_cache.shape)}; a contiguous cache takes no "
                             "block_table)")
        n_max = table.shape[1] * page_size
    # With a block table the caches are read as paged: where a contiguous cache passed with
    # one fails these checks, the message says how its dims were read.
    # The caches' first dim is the batch (or the pages): empty with the call's batch.
    if min(hq, d, *k_cache.shape[1:]) == 0 or (
            min(b, nq, k_cache.shape[0]) == 0 and not empty):
        raise ValueError(f"empty input: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    read_as = ("" if block_table is None else
               " (with block_table the caches are read as paged, (num_pages, page_size, Hkv, "
               f"D): k_cache {tuple(k_cache.shape)} gives Hkv {hkv}, D {dk})")
    if dk != d:
        raise ValueError(f"head dims differ: q {d}, k_cache/v_cache {dk}{read_as}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads "
                         f"({hkv}){read_as}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is over the supported maximum {MAX_HEAD_DIM}")
    if seqlens is None and causal and n_max < nq and not empty:
        raise ValueError(f"the cache holds {n_max} keys a sequence, fewer than Nq = {nq}: under "
                         "causal the last Nq keys of each sequence are the queries' own")
    devices = {t.device for t in (q, k_cache, v_cache)}
    if seqlens is not None:
        devices.add(seqlens.device)
    if block_table is not None:
        devices.add(block_table.device)
    if cache_leftpad is not None:
        pads = _tensor("cache_leftpad", cache_leftpad)
        if block_table is not None:
            raise ValueError("cache_leftpad is for contiguous caches; a paged cache's block "
                             "table already names where each sequence's keys are")
        if pads.dtype != torch.int32:
            raise TypeError(f"cache_leftpad must be int32, got {pads.dtype}")
        if seqlens is None:
            raise ValueError("cache_leftpad needs cache_seqlens: a row's keys run from its pad "
                             "to its length")
        if pads.shape != (b,):
            raise ValueError(f"cache_leftpad must have shape (batch,) = ({b},); got "
                             f"{tuple(pads.shape)}")
        devices.add(pads.device)
    if len(devices) > 1:
        raise ValueError(f"inputs are on different devices: {sorted(map(str, devices))}")
    if seqlens is None:
        if block_table is not None and (block_table.device.type == "cpu" or debug_checks()):
            check_pages(block_table, torch.full((b,), n_max), page_size, k_cache.shape[0])
    elif seqlens.device.type == "cpu" or debug_checks():
        check_lengths(seqlens, n_max, nq, causal)
        if block_table is not None:
            check_pages(block_table, seqlens, page_size, k_cache.shape[0])
        if cache_leftpad is not None:
            check_leftpad(cache_leftpad, seqlens)
    return DecodeShape(b, hq, hkv, nq, n_max, d, DTYPE_NAMES[q.dtype], bool(causal), page_size,
                       leftpad=cache_leftpad is not None)


def check_lengths(seqlens: torch.Tensor, n_max: int, nq: int, causal: bool) -> None:
    """Every length in [0, capacity], and under `causal` at least Nq (the queries' own keys
    are the last Nq of each sequence). Reads the lengths on the host."""
    lengths = seqlens.tolist()
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cache_seqlens[{i}] is negative ({n})")
        if n > n_max:
            raise ValueError(f"cache_seqlens[{i}] = {n} is longer than the cache ({n_max} keys)")
        if causal and n < nq:
            raise ValueError(f"cache_seqlens[{i}] = {n} is shorter than Nq = {nq}: under causal "
                             "the last Nq keys of each sequence are the queries' own")


def check_leftpad(pads: torch.Tensor, seqlens: torch.Tensor) -> None:
    """Every pad in [0, length]. Reads both on the host. (A pad over some of a row's queries
    is allowed: those queries are padding, and their rows see no key: 0, as padded rows are
    elsewhere.)"""
    for i, (pad, n) in enumerate(zip(pads.tolist(), seqlens.tolist(), strict=True)):
        if not 0 <= pad <= n:
            raise ValueError(f"cache_leftpad[{i}] = {pad} is outside [0, cache_seqlens[{i}] = "
                             f"{n}]")


def check_pages(block_table: torch.Tensor, seqlens: torch.Tensor, page_size: int,
                num_pages: int) -> None:
    """Every page id a sequence's valid keys use is in [0, num_pages)."""
    for i, (row, n) in enumerate(zip(block_table.tolist(), seqlens.tolist(), strict=True)):
        used = row[:cdiv(max(n, 0), page_size)]
        bad = [p for p in used if not 0 <= p < num_pages]
        if bad:
            raise ValueError(f"block_table[{i}] names page {bad[0]}, outside the "
                             f"{num_pages} pages of the cache")


def auto_splits(programs: int, n_max: int, block_n: int, device: torch.device) -> int:
    """Splits per sequence for num_splits = 0: enough for about two programs per SM, each
    taking at least MIN_TILES_PER_SPLIT key tiles of the longest possible sequence."""
    want = cdiv(2 * sm_count(device), programs)
    most = max(1, cdiv(n_max, block_n) // MIN_TILES_PER_SPLIT)
    return max(1, min(want, most, MAX_AUTO_SPLITS))


#: Arrival counters of fused-combine launches by (device, stream), kept zero between launches.
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
#: The fewest counters a kept buffer holds (4 KiB): growing it is an allocation and a fill.
MIN_COUNTERS = 1024


#: Each thread's scratch buffers for the split pass's partial rows, by (device, stream);
#: see `split_scratch`. Freed with the thread.
_SCRATCH = threading.local()
#: The largest scratch (fp32 values) kept between launches, 16 MiB: a call that needs more
#: does enough GPU work that one allocation of its own costs it nothing that shows.
MAX_SCRATCH = 1 << 22


#: Set while a compiled graph's op runs the decode family (`fresh_buffers`).
_FRESH = threading.local()


@contextlib.contextmanager
def fresh_buffers() -> Iterator[None]:
    """Within it, each call allocates its scratch and counters and keeps none. The compiled
    graph's op (`ops.attention_kvcache`) runs here: CUDA graph trees (torch.compile's
    "reduce-overhead", what a static-cache `generate()` compiles) run a graph's first calls
    on the graph's private memory pool, and a buffer kept past the call is then a live
    allocation of that pool that no output accounts for, which torch refuses ("tensor(s) in
    the cudagraph pool not tracked as outputs")."""
    before = getattr(_FRESH, "on", False)
    _FRESH.on = True
    try:
        yield
    finally:
        _FRESH.on = before


def _stream_key(device: torch.device) -> tuple[int, int] | None:
    """(device index, current raw stream) for a buffer kept between launches, or None where
    none may be: the CPU (the interpreter), CUDA graph capture (a replay may run on another
    stream, beside another replay) and compiled graphs (`fresh_buffers`)."""
    if (device.type != "cuda" or getattr(_FRESH, "on", False)
            or torch.cuda.is_current_stream_capturing()):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, torch._C._cuda_getCurrentRawStream(index)


def split_counters(tiles: int, device: torch.device) -> torch.Tensor:
    """`tiles` zeroed int32 arrival counters for a fused-combine launch on the current stream.

    The kernel's merging program sets each counter back to zero, and launches on one stream
    never overlap, so one buffer per stream serves every launch on it without a fill. Under
    CUDA graph capture and on the CPU each call gets its own zeroed buffer.
    """
    key = _stream_key(device)
    if key is None:
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def split_scratch(values: int, device: torch.device) -> torch.Tensor:
    """At least `values` fp32 values for the split pass's partial outputs and log-sum-exps,
    read back only by the combine of the same call.

    Launches on one stream run in order, so a call's split pass cannot start before the
    previous call's combine has read the buffer: one buffer per stream serves every call a
    thread makes on it, and a decode step pays no allocation for it (a few microseconds of
    host time a call, which a short decode step's time is made of). Per thread, because two
    threads calling on one stream (the default stream, say) may queue their launches
    between each other's split pass and combine. Under CUDA graph capture, on the CPU and
    beyond MAX_SCRATCH each call gets its own.
    """
    key = _stream_key(device) if values <= MAX_SCRATCH else None
    if key is None:
        return torch.empty(values, dtype=torch.float32, device=device)
    kept: dict[tuple[int, int], torch.Tensor] | None = getattr(_SCRATCH, "buffers", None)
    if kept is None:
        kept = _SCRATCH.buffers = {}
    scratch = kept.get(key)
    if scratch is None or scratch.numel() < values:
        scratch = torch.empty(values, dtype=torch.float32, device=device)
        kept[key] = scratch
    return scratch


#: See `merge_width`.
MERGE_VALUES = 32


def merge_width(block_d: int, num_warps: int) -> int:
    """Splits of a row a fused merge loads at once: as many as keep them within
    MERGE_VALUES fp32 values a thread, 4 to 64 (a power of two)."""
    fit = MERGE_VALUES * 32 * num_warps // block_d
    return 1 << (max(4, min(64, fit)).bit_length() - 1)


def narrow_offsets(k_strides: tuple[int, ...], v_strides: tuple[int, ...], rows: int,
                   slots: int, d: int) -> bool:
    """Whether a hoisted kernel's offsets from its head's base fit int32: the farthest is
    (rows - 1) row strides, (slots - 1) slot strides and (d - 1) elements away. Strides as
    the kernel takes them (row: a page; slot: a key). A contiguous cache passes rows = 1:
    the kernel adds its batch offset in int64."""
    return all((rows - 1) * s[0] + (slots - 1) * s[2] + (d - 1) * s[3] < 2**31
               for s in (k_strides, v_strides))


def _aligned(values: int) -> int:
    """`values` fp32 values rounded up to a multiple of four (16 bytes)."""
    return -(-values // 4) * 4


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


#: Call layouts a decode plan keeps fast launches for (`prepare_decode`); cleared when full.
MAX_FAST_LAYOUTS = 64
#: A layout that always takes the general launch (see `prepare_decode`): not recorded again.
_GENERAL = 0


def _fast_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor | None,
              table: torch.Tensor | None, keep_lse: bool, cache: tuple) -> tuple[tuple, tuple]:
    """(key, pointers) of a GPU call without modifiers. The key holds everything its launches'
    arguments and Triton's specialisation follow from: q's shape and strides, the caches'
    shape but a contiguous one's length, `cache` (their strides as the kernel takes them,
    the keys a sequence may hold, the split count and the offsets' width; the first three by
    what Triton specialises an int on, as `launch.int_spec` keys them, so a cache that grows
    a key a step keeps its layout), whether every input is 16-byte aligned, and
    `launch.launch_context()` (as the general launch's key). The addresses go to the
    launches as the pointers."""
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(),
            None if seqlens is None else seqlens.data_ptr(),
            None if table is None else table.data_ptr())
    aligned = not ((ptrs[0] | ptrs[1] | ptrs[2] | (ptrs[3] or 0) | (ptrs[4] or 0)) & 15)
    k_strides, v_strides, n_max, splits, narrow = cache
    # A paged cache's shape is fixed; a contiguous one's keys are in `cache`.
    key = (q.shape, q.stride(), k.shape if table is not None else k.shape[:2] + k.shape[3:],
           tuple(map(int_spec, (*k_strides, *v_strides, n_max))), splits, narrow,
           None if seqlens is None else seqlens.stride(),
           None if table is None else (table.shape, table.stride()), keep_lse, aligned,
           *launch_context())
    return key, ptrs


def prepare_decode(entry: Entry, shape: DecodeShape, kernel: KernelOf) -> DecodeLauncher:
    """Load `entry`'s kernels once and return a function launching them on checked inputs.

    Strides go to the kernels as they are: q of any layout, a contiguous cache viewed as
    (B, Hkv, Nmax, D) from (B, Nmax, Hkv, D) memory, a paged cache's page and slot strides.
    The output keeps q's memory layout.

    A GPU call without modifiers whose layout (`_fast_key`) comes a second time gets a fast
    launch: its other integer arguments, grid and scratch offsets kept from that call, and
    both kernels launched through Triton's C launcher with the addresses as ints. A decode
    step's host time is what a short call is timed at, and the per-argument work of a
    general launch (`launch.Bound`) was most of it.
    """
    variant = knobs(entry["variant"])
    fused = getattr(variant, "fused_combine", False)  # rows stored before the knob lack it
    hoisted = getattr(variant, "hoisted", False)
    split_kernel = bind(kernel("decode"))
    # An exported package's cubin launcher has no direct launch to record.
    recordable = hasattr(split_kernel, "direct")
    combine: list[Any] = []  # the combine kernel, loaded on first need
    launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    group, paged = shape.group, bool(shape.page_size)
    row_tiles = cdiv(group * shape.seq_q, variant.block_m)
    padded = padded_head_dim(shape.head_dim)
    if fused:
        launch["MERGE"] = merge_width(padded, variant.num_warps)
    #: layout -> False (seen once), its fast launch, or _GENERAL
    fast: dict[tuple, Any] = {}

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: torch.Tensor | None,
            block_table: torch.Tensor | None, scale: float, mods: Mods | None = None,
            leftpad: torch.Tensor | None = None,
            keep_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        b, hq, nq, d = q.shape
        if paged:
            assert block_table is not None
            hkv, page = k.shape[2], k.shape[1]
            n_max = block_table.shape[1] * page
            # Pages play the batch's part, slots the sequence's.
            k_strides = (k.stride(0), k.stride(2), k.stride(1), k.stride(3))
            v_strides = (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
        else:
            page = 1
            hkv, n_max = k.shape[1], k.shape[2]
            k_strides, v_strides = k.stride(), v.stride()
        splits = variant.num_splits or auto_splits(b * hkv * row_tiles, n_max, variant.block_n,
                                                   q.device)
        narrow = narrow_offsets(k_strides, v_strides, k.shape[0] if paged else 1,
                                page if paged else n_max, d) if hoisted else None
        key = None
        if recordable and mods is None and leftpad is None and q.is_cuda:
            key, ptrs = _fast_key(q, k, v, seqlens, block_table, keep_lse,
                                  (k_strides, v_strides, n_max, splits, narrow))
            hit = fast.get(key)
            if hit:
                if hooks_idle():
                    return hit(q, ptrs, scale, k_strides, v_strides, n_max)
                key = None  # a profiler's hooks: the general launch, and nothing recorded
            elif hit is None:
                if len(fast) >= MAX_FAST_LAYOUTS:
                    fast.clear()
                fast[key] = False
                key = None
            elif hit is _GENERAL:
                key = None
            elif not (key[-4] and (seqlens is None or seqlens.stride(0) == 1)
                      and (block_table is None or block_table.stride(1) == 1)):
                # Recorded only where the launches take the inputs themselves.
                fast[key] = _GENERAL
                key = None
        if paged:
            assert block_table is not None
            table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
            table_stride = table.stride(0)
        else:
            table, table_stride = None, 0  # no table
        out = torch.empty_like(q)
        # Scratch (`split_scratch`, no allocation a call): the partial outputs and their
        # log-sum-exps where the keys are split, and the LSE where the caller drops it. Each
        # part starts 16-byte aligned, as an allocation of its own would.
        rows = b * hq * nq * splits if splits > 1 else 0
        at_lse = _aligned(rows * d)
        at_out_lse = _aligned(at_lse + rows)
        # The kernels take the partial rows' strides as arguments, so they get the buffer and
        # a slice of it (one tensor op, not a view of each shape).
        out_lse_strides = (hq * nq, nq, 1)
        used = at_out_lse if keep_lse else at_out_lse + b * hq * nq
        work = split_scratch(used, q.device) if used else None
        lse = (torch.empty((b, hq, nq), device=q.device, dtype=torch.float32) if keep_lse
               else work.as_strided((b, hq, nq), out_lse_strides, at_out_lse))  # type: ignore[union-attr]
        if splits == 1:
            part, part_lse = out, lse
            part_strides = (*out.stride()[:3], 0, out.stride(3))
            lse_strides = (*out_lse_strides, 0)
        else:
            assert work is not None
            part, part_lse = work, work[at_lse:]
            part_strides = (hq * nq * splits * d, nq * splits * d, splits * d, d, 1)
            lse_strides = (hq * nq * splits, nq * splits, splits, 1)
        extra = [] if mods is None else mods.kernel_args(shape.causal, nq, n_max)
        if shape.leftpad:
            assert leftpad is not None
            extra.append(leftpad if leftpad.stride(0) == 1 else leftpad.contiguous())
        if seqlens is not None and seqlens.stride(0) != 1:  # the kernel reads them at stride 1
            seqlens = seqlens.contiguous()
        fused_ints = (*out.stride(), *out_lse_strides)
        if fused:
            extra += [split_counters(b * hkv * row_tiles, q.device), out, lse, *fused_ints]
        grid = (splits, b * hkv, row_tiles)
        after = (table_stride, *part_strides, *lse_strides)
        split_args = (q, k, v, seqlens, table, part, part_lse, *q.stride(), *k_strides,
                      *v_strides, *after, scale, nq, n_max, hkv, group, splits, *extra)
        split_named = {"PAGE_SIZE": page, **({} if narrow is None else {"NARROW": narrow}),
                       **launch}
        split_kernel[grid](*split_args, **split_named)
        combine_args: tuple = ()
        combine_ints: tuple = ()
        if splits > 1 and not fused:
            if not combine:
                combine.append(bind(kernel("decode_combine")))
            width = _pow2(splits)
            combine_ints = (*part_strides, *lse_strides, *out.stride(), *out_lse_strides, nq,
                            hq, splits)
            combine_args = (part, part_lse, out, lse, *combine_ints,
                            *([] if mods is None or mods.sinks is None else [mods.sinks]))
            combine_named = {"SPLITS": width,
                             "num_warps": 4 if width * padded <= 4096 else 8}
            combine[0][(b * hq * nq,)](*combine_args, **combine_named)
        if key is not None:  # a layout's second call: keep its fast launch
            go = split_kernel.direct(split_args, split_named)
            merge = (combine[0].direct(combine_args, combine_named)
                     if combine_args and go is not None else None)
            if go is None or (merge is None and combine_args):
                fast[key] = _GENERAL  # a launcher that needs Triton's runner
            else:
                fast[key] = _fast_launch(
                    go, grid, q.stride(), after, (nq,), (hkv, group, splits), merge,
                    (b * hq * nq, 1, 1), combine_ints,
                    _Scratch(splits, used, at_lse, at_out_lse, (b, hq, nq), out_lse_strides,
                             keep_lse),
                    (b * hkv * row_tiles, fused_ints) if fused else None)
        return out, lse

    return run


class _Scratch(NamedTuple):
    """Where a fast launch's partial rows and LSEs go (see `prepare_decode`'s `run`)."""

    splits: int
    used: int
    at_lse: int
    at_out_lse: int
    lse_shape: tuple[int, int, int]
    lse_strides: tuple[int, int, int]
    keep_lse: bool


def _fast_launch(go: Callable[..., None], grid: tuple[int, int, int], q_strides: tuple,
                 after: tuple, before_n: tuple, after_n: tuple,
                 merge: Callable[..., None] | None, merge_grid: tuple[int, int, int],
                 merge_ints: tuple, scratch: _Scratch,
                 fused: tuple[int, tuple] | None) -> Callable[..., Any]:
    """A layout's fast launch: `run`'s work with everything but the addresses, the caches'
    strides and their capacity kept. Pointers go as ints; the scratch and counters are the
    stream's, as `run` takes them."""
    splits, used, at_lse, at_out_lse, lse_shape, lse_strides, keep_lse = scratch
    device_index = torch.cuda.current_device()

    def launch(q: torch.Tensor, ptrs: tuple, scale: float, k_strides: tuple,
               v_strides: tuple, n_max: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = q.device
        out = torch.empty_like(q)
        o = out.data_ptr()
        work = split_scratch(used, device) if used else None
        base = 0 if work is None else work.data_ptr()
        if keep_lse:
            lse = torch.empty(lse_shape, device=device, dtype=torch.float32)
            lse_ptr = lse.data_ptr()
        else:
            lse = work.as_strided(lse_shape, lse_strides, at_out_lse)  # type: ignore[union-attr]
            lse_ptr = base + 4 * at_out_lse
        part, part_lse = (o, lse_ptr) if splits == 1 else (base, base + 4 * at_lse)
        extra = () if fused is None else (
            split_counters(fused[0], device).data_ptr(), o, lse_ptr, *fused[1])
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        go(*grid, stream, *ptrs, part, part_lse, *q_strides, *k_strides, *v_strides, *after,
           scale, *before_n, n_max, *after_n, *extra)
        if merge is not None:
            merge(*merge_grid, stream, part, part_lse, o, lse_ptr, *merge_ints)
        return out, lse

    return launch
