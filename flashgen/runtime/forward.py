"""Launching a forward entry: output allocation, grid, and the kernel call.

The launch code reads a variant's knobs as attributes (`table.knobs` of an entry's dict, or a
flashgen `Variant`), and gets kernels by role from the caller: "fwd", and "fwd_plain" for
the pointer twin of a TMA variant (what runs on inputs TMA cannot address).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from .interpreter import exact_e4m3, on_interpreter
from .launch import SPEC_ATTR, bind, descriptor_spec
from .modifiers import Mods, Varlen
from .table import Entry, Shape, knobs

#: (q, k, v, scale[, mods]) -> (output like q, log-sum-exp (B, Hq, Nq) fp32; packed
#: (varlen) calls: (Hq, total_q))
Launcher = Callable[..., tuple[torch.Tensor, torch.Tensor]]
#: role -> the JIT function that plays it
KernelOf = Callable[[str], Any]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


#: The least head-dim tile of an fp8 kernel: 8-bit tensor-core products reduce over at least
#: 32 elements (`kernels.problem.FP8_MIN_D`, repeated so the runtime imports no tuner code).
FP8_MIN_D = 32


def padded_head_dim(head_dim: int, dtype: str = "") -> int:
    """The power of two (at least 16; 32 for fp8) the kernels tile the head dim with."""
    return max(FP8_MIN_D if dtype == "fp8" else 16, 1 << (head_dim - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; the interpreter counts as one, so persistent
    programs walk every tile."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these tensors: a unit last stride, other strides
    and the base address multiples of 16 bytes (the copy engine's rules). Every launch of a
    TMA kernel asks it of each tensor: the stride rule is cached by strides and element size,
    the address is read each time."""
    for t in tensors:
        if t.data_ptr() % 16 or not _tma_strides(t.stride(), t.element_size()):
            return False
    return True


@functools.lru_cache(maxsize=4096)
def _tma_strides(strides: tuple[int, ...], size: int) -> bool:
    """`tma_ready`'s stride rule: a unit last stride, the others multiples of 16 bytes."""
    return strides[-1] == 1 and not any((s * size) % 16 for s in strides[:-1])


@functools.cache
def _tma_descriptor_type() -> type:
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor


@functools.cache
def _gluon_descriptor_type() -> type:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor


def _unchecked(cls: type, t: torch.Tensor, rows: int, cols: int, gluon: bool) -> object:
    """`cls(t, shape, strides, [1, 1, rows, cols], ...)` without its __post_init__ checks,
    which cost ~8 us a descriptor on every call: `tma_ready` has made them (alignment, unit
    last stride) and the tiles are fixed per variant. Everything but the base tensor comes
    from `_fields`, cached by layout; the base is set anew on each call, on a new object, so
    a descriptor never addresses another tensor than its own. An empty tensor is left to the
    checked constructor."""
    shape = t.shape
    if 0 in shape:
        block = [1, 1, rows, cols]
        extra = {"layout": _gluon_tile_layout(rows, cols, t.dtype)} if gluon else {}
        return cls(t, list(shape), list(t.stride()), block, **extra)
    made = object.__new__(cls)
    fields = made.__dict__
    fields.update(_fields(cls, shape, t.stride(), rows, cols, t.dtype, gluon))
    fields["base"] = t
    return made


@functools.lru_cache(maxsize=4096)
def _fields(cls: type, shape: tuple[int, ...], strides: tuple[int, ...], rows: int, cols: int,
            dtype: torch.dtype, gluon: bool) -> dict[str, object]:
    """A descriptor's fields but its base, by what they depend on: shape, strides, tile,
    dtype (and, Gluon, the tile's shared layout from them); nothing of the address. The
    lists are shared by the descriptors of one layout, which only read them (Triton's
    launcher and `runtime.launch`'s key). With them the launch key's part for the descriptor
    (`launch.descriptor_spec`), worked out once."""
    block = [1, 1, rows, cols]
    fields: dict[str, object] = {"shape": list(shape), "strides": list(strides),
                                 "block_shape": block, "padding": "zero"}
    layout = None
    if gluon:
        layout = fields["layout"] = _gluon_tile_layout(rows, cols, dtype)
    fields[SPEC_ATTR] = descriptor_spec(cls, dtype, tuple(block), layout, "zero")
    return fields


def descriptor(t: torch.Tensor, rows: int, cols: int) -> object:
    """A TMA descriptor over the (B, H, N, D) view moving [1, 1, rows, cols] tiles. Read
    only: its shape, strides and block_shape lists are shared with every descriptor of the
    same layout (`_fields`), which Triton reads and never edits."""
    return _unchecked(_tma_descriptor_type(), t, rows, cols, False)


@functools.cache
def _gluon_tile_layout(rows: int, cols: int, dtype: torch.dtype) -> object:
    """The widest shared-memory swizzle a [1, 1, rows, cols] tile allows (what the tensor
    cores read fastest). Cached: working it out costs ~10 us of Python, per descriptor."""
    from triton.experimental.gluon import language as gl

    element = {torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
               torch.float32: gl.float32}.get(dtype, gl.bfloat16)
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], element)


def gluon_descriptor(t: torch.Tensor, rows: int, cols: int | None = None) -> object:
    """A Gluon TMA descriptor over the 4-D view `t` moving [1, 1, rows, cols] tiles (cols:
    the whole last dim, D of a (B, H, N, D) view, unless given; wider than D, TMA zero-fills
    the columns past it on load and clips them on store). The caller has checked
    `tma_ready`. Read only, as `descriptor`'s are."""
    return _unchecked(_gluon_descriptor_type(), t, rows, t.shape[-1] if cols is None else cols,
                      True)


def module_flag(kernel: Any, name: str) -> bool:
    """Whether the module of `kernel` (a rendered kernel) sets `name` true: how a template
    tells its launcher of a structure that changes the arguments."""
    fn = getattr(kernel, "fn", None)
    return bool(getattr(fn, "__globals__", {}).get(name, False))


def k_row_groups(kernel: Any) -> bool:
    """Whether `kernel` (a rendered fa3 kernel) reads K as `k_groups_descriptor`'s 16-row
    groups (the persistent fp8 kernel, whose P V takes P from registers): its module says so."""
    return module_flag(kernel, "K_ROW_GROUPS")


def o_pointer(kernel: Any) -> bool:
    """Whether `kernel` (a rendered fa3 kernel) stores O through a pointer passed after its
    other arguments, with O's (B, H, N) strides (the persistent kernel above D128 rendered
    with `o_through_q` off, an A/B switch): its module says so."""
    return module_flag(kernel, "O_POINTER")


def k_groups_descriptor(k: torch.Tensor, block_n: int,
                        cols: int) -> tuple[object, int, int] | None:
    """K (B, H, N, D) as the 5-D Gluon descriptor of the persistent fp8 kernel with `p_regs`:
    16-row groups (G, h, q, e, D), strides (16, 2, 4, 1) rows, so a [block_n / 16, 2, 4, 2,
    cols] tile (cols >= D: TMA zero-fills the columns past D) lands in
    shared memory with row 16G + 8h + 2q + e holding key 16G + 4q + 2h + e (the kernel's
    `_key_of`); with the groups a batch and a head start at (KG_B, KG_H). None where K's rows
    cannot be taken so: a batch or head not starting on a 16-row boundary (a contiguous K
    whose N is not a multiple of 16), or memory that ends inside the last group."""
    b, h, n, d = k.shape
    sb, sh, sn, sd = k.stride()
    group = 16 * sn
    sb, sh = (sb if b > 1 else 0), (sh if h > 1 else 0)
    if not n or sd != 1 or sb % group or sh % group:
        return None
    groups = ((b - 1) * sb + (h - 1) * sh) // group + cdiv(n, 16)
    available = k.untyped_storage().nbytes() // k.element_size() - k.storage_offset()
    if (groups * 16 - 1) * sn + d > available:
        return None
    view = k.as_strided((groups, 2, 4, 2, d), (group, 2 * sn, 4 * sn, sn, 1))
    made = object.__new__(_gluon_descriptor_type())
    made.__dict__.update(_group_fields(tuple(view.shape), tuple(view.stride()), block_n, cols,
                                       k.dtype))
    made.__dict__["base"] = view
    return made, sb // group, sh // group


@functools.lru_cache(maxsize=1024)
def _group_fields(shape: tuple[int, ...], strides: tuple[int, ...], block_n: int, cols: int,
                  dtype: torch.dtype) -> dict[str, object]:
    """`k_groups_descriptor`'s fields but its base (as `_fields`)."""
    from triton.experimental.gluon import language as gl

    block = [block_n // 16, 2, 4, 2, cols]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return {"shape": list(shape), "strides": list(strides), "block_shape": block,
            "padding": "zero", "layout": layout,
            SPEC_ATTR: descriptor_spec(_gluon_descriptor_type(), dtype, tuple(block), layout,
                                       "zero")}


def fa2_grid(variant: Any, nq: int, heads: int, device: torch.device) -> tuple[int, int]:
    """The fa2 launch grid (Q-tile programs per head, B * H_Q).

    A persistent variant caps the first axis near `persistent` programs per SM in all (never
    below one per head); its programs then walk several Q tiles each.
    """
    tiles = cdiv(nq, variant.block_m)
    if not variant.programs_per_sm:
        return tiles, heads
    return max(1, min(tiles, cdiv(sm_count(device) * variant.programs_per_sm, heads))), heads


def fa3_grid(variant: Any, nq: int, heads: int,
             device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The fa3 launch grid and the arguments it adds after fa3's common ones.

    One program per (Q tile, head); on a persistent grid one program per SM (at most one per
    tile), whose kernel takes the number of heads (B * H_Q) to enumerate the tiles itself.
    """
    tiles = cdiv(nq, variant.block_m)
    if not variant.programs_per_sm:
        return (tiles, heads), ()
    return (min(tiles * heads, sm_count(device)),), (heads,)


def fa3_packed_grid(variant: Any, lens: Varlen, causal: bool, heads: int,
                    device: torch.device) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """fa3's launch grid on packed sequences and the arguments it adds after fa3's common ones.

    One-tile: one program per (Q tile of the longest sequence, sequence x head); programs
    past their sequence's end return at once. Persistent: one program per SM (at most one per
    unit) walking the tile schedule (`Varlen.schedule`, costliest first) head by head; its
    kernel takes the entry count and the (entries, 3) table. For a packing with queries (with
    none, `run_packed` launches nothing), so at least one tile.
    """
    if not variant.programs_per_sm:
        return fa3_grid(variant, lens.max_q, lens.batch * heads, device)
    table, tiles = lens.schedule(variant.block_m, causal)
    return (min(tiles * heads, sm_count(device)),), (tiles, table)


def strides4(t: torch.Tensor, packed: bool) -> tuple[int, ...]:
    """`t`'s strides as the kernels' (B, H, N, D) ones; a packed (total, H, D) tensor is one
    batch whose sequences the kernel finds by offset, so its batch stride is 0."""
    if not packed:
        return t.stride()
    return 0, t.stride(1), t.stride(0), t.stride(2)


def prepare_forward(entry: Entry, shape: Shape, kernel: KernelOf, strict: bool) -> Launcher:
    """Load `entry`'s kernel once and return a function that launches it on checked inputs.

    Everything that depends only on the entry and the shape's kind is settled here, so a
    launch does nothing but allocate the outputs and call the kernel: the dispatch fast path.
    Strides go to the kernel as they are, so (B, H, N, D) tensors and (B, N, H, D) memory
    viewed as (B, H, N, D) both run without a copy. The output keeps q's memory layout.

    A `use_tma` or fa3 variant needs 16-byte aligned rows (`tma_ready`). Given inputs that
    are not, a strict launcher (an explicitly requested variant) raises; otherwise the
    entry's pointer twin runs (role "fwd_plain"), which computes the same function.
    """
    variant = knobs(entry["variant"])
    if variant.use_tma or variant.loop_order == "fa3":
        launcher = _prepare_tma(entry, shape, kernel, strict)
    else:
        launcher = _prepare_pointers(variant, shape, bind(kernel("fwd")))
    # In a process on Triton's interpreter (which never launches on a GPU) an fp8 kernel
    # rounds P to e4m3 as the GPU does; elsewhere its launcher is left as it is.
    return _exact_e4m3(launcher) if shape.dtype == "fp8" and on_interpreter() else launcher


def _exact_e4m3(launcher: Launcher) -> Launcher:
    """`launcher` run inside `interpreter.exact_e4m3`."""

    def run(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        with exact_e4m3():
            return launcher(*args)

    return run


def _prepare_pointers(variant: Any, shape: Shape, kernel: Any) -> Launcher:
    launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    group, fa1 = shape.group, variant.loop_order == "fa1"
    padded = padded_head_dim(shape.head_dim)

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        mods: Mods | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if mods is not None:
            return run_modified(q, k, v, scale, mods)
        b, hq, nq, _ = q.shape
        nk = k.shape[2]
        out = torch.empty_like(q)
        lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
        args = (q, k, v, out, lse)
        if fa1:
            # fa1 keeps the running output, max and sum in fp32 scratch between K/V tiles.
            acc = torch.zeros((b * hq, nq, padded), device=q.device, dtype=torch.float32)
            m = torch.full((b * hq, nq), float("-inf"), device=q.device, dtype=torch.float32)
            lsum = torch.zeros((b * hq, nq), device=q.device, dtype=torch.float32)
            args = (*args, acc, m, lsum)
            grid: tuple[int, ...] = (b * hq,)
        else:
            grid = fa2_grid(variant, nq, b * hq, q.device)
        kernel[grid](
            *args,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride(),
            *lse.stride()[:2],
            scale,
            nq,
            nk,
            hq,
            group,
            **launch,
        )
        return out, lse

    def run_modified(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mods: Mods) -> tuple[torch.Tensor, torch.Tensor]:
        """fa2 with modifiers: their arguments follow the common ones; a packed call runs
        one (batch, head) row of programs per sequence, its LSE (Hq, total_q)."""
        packed = mods.varlen is not None
        if packed:
            assert mods.varlen is not None
            hq, b, nq, nk = q.shape[1], mods.varlen.batch, mods.varlen.max_q, mods.varlen.max_k
            lse = torch.empty((hq, q.shape[0]), device=q.device, dtype=torch.float32)
            lse_strides = (0, lse.stride(0))
        else:
            b, hq, nq, _ = q.shape
            nk = k.shape[2]
            lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
            lse_strides = lse.stride()[:2]
        out = torch.empty_like(q, dtype=mods.fp8.out_dtype) if mods.fp8 else torch.empty_like(q)
        args: tuple = (q, k, v, out, lse)
        if fa1:  # its fp32 scratch, as in `run` (never packed: the rules keep varlen to fa2)
            args = (*args, torch.zeros((b * hq, nq, padded), device=q.device,
                                       dtype=torch.float32),
                    torch.full((b * hq, nq), float("-inf"), device=q.device,
                               dtype=torch.float32),
                    torch.zeros((b * hq, nq), device=q.device, dtype=torch.float32))
            grid: tuple[int, ...] = (b * hq,)
        else:
            grid = fa2_grid(variant, nq, b * hq, q.device)
        kernel[grid](
            *args,
            *strides4(q, packed), *strides4(k, packed), *strides4(v, packed),
            *strides4(out, packed), *lse_strides,
            scale, nq, nk, hq, group, *mods.kernel_args(shape.causal, nq, nk), **launch,
        )  # fmt: skip
        return out, lse

    return run


def _prepare_tma(entry: Entry, shape: Shape, kernel_of: KernelOf, strict: bool) -> Launcher:
    variant = knobs(entry["variant"])
    raw = kernel_of("fwd")
    kernel = bind(raw)  # descriptors are keyed too (`runtime.launch`)
    k_groups = k_row_groups(raw)
    o_ptr = o_pointer(raw)
    launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    bm, bn = variant.block_m, variant.block_n
    d = padded_head_dim(shape.head_dim, shape.dtype)
    group, fa3 = shape.group, variant.loop_order == "fa3"
    # fa3: each consumer warpgroup moves its own 16 x num_warps rows of Q and O.
    rows = 16 * variant.num_warps
    # fp8 V is addressed keys-inner: its (B, H, D, N) memory (`fp8.quantize`'s layout); the
    # descales and the output dtype come with each call as `mods.fp8`.
    fp8 = shape.dtype == "fp8"
    plain: list[Launcher] = []  # the pointer twin, prepared on first need

    def twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
             mods: Mods | None, why: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs TMA cannot address: the pointer twin runs them (a strict launcher raises)."""
        if strict:
            raise ValueError(
                f"variant {entry['variant']} uses TMA, which needs a unit last stride and "
                f"16-byte aligned rows and base addresses{why}; these inputs are not")
        if not plain:
            # The twin's own tiles, warps and grid: an fa3 twin is a plain fa2 kernel.
            plain.append(_prepare_pointers(knobs(entry["twin"]), shape, kernel_of("fwd_plain")))
        return plain[0](q, k, v, scale) if mods is None else plain[0](q, k, v, scale, mods)

    def run_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   mods: Mods) -> tuple[torch.Tensor, torch.Tensor]:
        """fa3 on packed sequences: descriptors over the (1, H, total, D) views of the
        (total, H, D) tensors; LSE (Hq, total_q); O's rows also go as a pointer (the kernel
        stores them through a per-sequence mask). The persistent kernel walks the tile
        schedule (`fa3_packed_grid`)."""
        lens = mods.varlen
        assert lens is not None
        out = torch.empty_like(q)
        hq = q.shape[1]
        lse = torch.empty((hq, q.shape[0]), device=q.device, dtype=torch.float32)
        if not q.shape[0]:
            # Every sequence is empty (no tile to schedule): no launch, and no descriptor,
            # which TMA does not take over an empty tensor.
            return out, lse
        views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, out)]
        if not k.shape[0]:
            # No key in the whole packing: TMA takes no descriptor over it; the pointer twin
            # gives every row its output (zeros, or the sinks' share) and LSE. An explicit
            # variant (strict) is not silently replaced: a named error.
            if strict:
                raise ValueError(f"variant {entry['variant']} uses TMA, which takes no "
                                 "descriptor over a packing with no key; call without "
                                 "variant= (a pointer kernel then runs it)")
            return twin(q, k, v, scale, mods)
        if not tma_ready(*views):
            return twin(q, k, v, scale, mods)
        grid, extra = fa3_packed_grid(variant, lens, shape.causal, hq, q.device)
        kernel[grid](
            gluon_descriptor(views[0], rows, d), gluon_descriptor(views[1], bn, d),
            gluon_descriptor(views[2], bn, d), gluon_descriptor(views[3], rows, d), lse, 0,
            lse.stride(0), scale, lens.max_q, lens.max_k, hq, group, *extra,
            *mods.kernel_args(shape.causal, lens.max_q, lens.max_k), out, out.stride(0),
            out.stride(1), num_warps=variant.num_warps,
        )  # fmt: skip
        return out, lse

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        mods: Mods | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Modified calls (fa3 only, by the rules) pass their values as `mods`.
        out = (torch.empty_like(q, dtype=mods.fp8.out_dtype)  # type: ignore[union-attr]
               if fp8 else torch.empty_like(q))
        vt = v.transpose(-1, -2) if fp8 else v
        if not tma_ready(q, k, vt, out):
            return twin(q, k, v, scale, mods,
                        " (fp8: v keys-inner, as fp8.quantize lays it out)" if fp8 else "")
        b, hq, nq, _ = q.shape
        lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
        if fa3:
            grid, extra = fa3_grid(variant, nq, b * hq, q.device)
            # fp8: V's tiles are (D, BLOCK_N) of its keys-inner memory; the descales follow.
            # A head dim below the tiles' d (80, 96) is padded by TMA: d-wide tiles, zero fill.
            v_tiles = gluon_descriptor(vt, d, bn) if fp8 else gluon_descriptor(v, bn, d)
            if mods is not None:
                extra = (*extra, *mods.kernel_args(shape.causal, nq, k.shape[2]))
            if k_groups:
                grouped = k_groups_descriptor(k, bn, d)
                if grouped is None:
                    return twin(q, k, v, scale, mods, " (fp8 with P V from registers: each "
                                "batch and head of k starting on a 16-row boundary)")
                k_tiles, group_b, group_h = grouped
                extra = (*extra, group_b, group_h)
            else:
                k_tiles = gluon_descriptor(k, bn, d)
            if o_ptr:
                extra = (*extra, out, *out.stride()[:3])
            kernel[grid](
                gluon_descriptor(q, rows, d), k_tiles, v_tiles,
                gluon_descriptor(out, rows, d), lse, *lse.stride()[:2],
                scale, nq, k.shape[2], hq, group, *extra, num_warps=variant.num_warps,
            )  # fmt: skip
            return out, lse
        v_tiles = descriptor(vt, d, bn) if fp8 else descriptor(v, bn, d)
        extra = mods.kernel_args(shape.causal, nq, k.shape[2]) if mods is not None else ()
        kernel[fa2_grid(variant, nq, b * hq, q.device)](
            descriptor(q, bm, d), descriptor(k, bn, d), v_tiles,
            descriptor(out, bm, d), lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride()[:2],
            scale, nq, k.shape[2], hq, group, *extra, **launch,
        )  # fmt: skip
        return out, lse

    # Packed sequences reach TMA kernels only in fa3 (the rules).
    return run_packed if shape.varlen and fa3 else run
