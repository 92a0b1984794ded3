"""Launching a backward entry: allocation, grids, and the three kernels' calls.

Kernels come by role from the caller: "preprocess", "dkdv" and "dq" (no "dq" in the atomic
dQ mode; no "preprocess" for a fused_delta variant, whose dQ kernel works out delta and runs
first), and "dkdv_plain" and "dq_plain" for the all-Triton twin of a variant with Gluon
(fa3) kernels, which runs where TMA cannot address the inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .forward import KernelOf, cdiv, gluon_descriptor, padded_head_dim, strides4, tma_ready
from .launch import bind
from .modifiers import Mods
from .table import Entry, Shape, knobs

#: (dO, q, k, v, out, lse, scale) -> (dq, dk, dv)
BwdLauncher = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def is_gluon(variant: Any, kernel: str) -> bool:
    """Whether backward kernel `kernel` ("preprocess", "dkdv", "dq") of `variant` is a Gluon
    one (its `fa3` knob: "none", "dq" or "both"; the atomic mode has no dQ kernel). The
    runtime's copy of `BwdVariant.gluon`: exported packages carry no flashgen.kernels."""
    return (kernel == "dq" and variant.fa3 in ("dq", "both") and variant.dq_mode == "separate"
            ) or (kernel == "dkdv" and variant.fa3 == "both")


def fa3_tile_rows(kernel: str, variant: Any) -> tuple[int, ...]:
    """Rows of the TMA tile of each tensor a Gluon backward kernel takes, in argument order:
    an owned tensor moves 64 rows per consumer warpgroup, a streamed one the kernel's
    streamed tile (block_m; the Gluon dQ kernel's own dq_block_streamed where set)."""
    own = kernel == "dq" and is_gluon(variant, "dq") and variant.dq_block_streamed
    rows = variant.dq_block_streamed if own else variant.block_streamed
    if kernel == "dkdv":  # q, k, v, do, dk, dv: K and V owned
        return (rows, 64, 64, rows, 64, 64)
    return (64, rows, rows, 64, 64)  # q, k, v, do, dq: Q and dO owned


def why_nondeterministic(entry: Entry) -> str | None:
    """Why `entry`'s gradients may differ bitwise from run to run (None: they never do).

    Only the atomic dQ mode is: its dK/dV programs add their shares of dQ with fp32 atomics
    in whatever order they reach them (Triton's or Gluon's). The separate dQ kernel owns its
    rows and GQA's dK/dV is summed on chip. The twin is asked too: it runs where TMA cannot
    address the inputs."""
    for data in (entry["variant"], entry.get("twin") or {}):
        if data.get("dq_mode") == "atomic":
            return ("its dq_mode 'atomic' adds dQ's fp32 shares (atomics or TMA reduces) in "
                    "an order that varies from run to run")
    return None


class _Kernels:
    """One variant's backward kernels and knobs, loaded once."""

    def __init__(self, variant: Any, kernel_of: KernelOf, suffix: str) -> None:
        self.variant = variant
        self.gluon = {role: is_gluon(variant, role) for role in ("dkdv", "dq")}
        # Gluon kernels' TMA descriptors are keyed like any argument (`runtime.launch`).
        self.dkdv = bind(kernel_of("dkdv" + suffix))
        # The atomic dQ mode has no dQ kernel: the dK/dV kernel (Triton or Gluon) adds dQ.
        self.dq = bind(kernel_of("dq" + suffix)) if variant.dq_mode == "separate" else None
        self.launch = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
        #: The dQ kernel works out delta (and runs before dK/dV): no preprocessing launch.
        #: Rows stored before the knob existed lack it.
        self.fused_delta = getattr(variant, "fused_delta", False)
        #: Each Gluon kernel's TMA tile rows (`fa3_tile_rows`), worked out once.
        self.tile_rows = {role: fa3_tile_rows(role, variant)
                          for role, gluon in self.gluon.items() if gluon}


def prepare_backward(entry: Entry, shape: Shape, kernel_of: KernelOf,
                     preprocess_block_m: int) -> BwdLauncher:
    """Load `entry`'s backward kernels once and return a function giving the gradients
    (dq, dk, dv) of attention for the upstream gradient `dO` (shaped like q).

    `out` and `lse` are the forward's output and natural-log log-sum-exp (B, Hq, Nq) fp32;
    rows with LSE -inf (they saw no key) get zero gradient. Inputs are read in place through
    their strides, never copied, and the gradients keep their input's dtype, shape and memory
    layout. With GQA, dk and dv sum the contributions of every query head that shares the
    key/value head. Gluon kernels need 16-byte aligned rows (`tma_ready`); on inputs that are
    not, the entry's twin runs, which computes the same gradients.
    """
    pre: list[Any] = []  # the preprocessing kernel, loaded on first need (not fused_delta's)

    def preprocess() -> Any:
        if not pre:
            pre.append(bind(kernel_of("preprocess")))
        return pre[0]

    main = _Kernels(knobs(entry["variant"]), kernel_of, "")
    plain: list[_Kernels] = []  # the twin's, loaded on first need
    group = shape.group

    def kernels_for(lse: torch.Tensor, *tensors: torch.Tensor) -> _Kernels:
        """The entry's kernels, or its twin's where TMA cannot address `tensors` (the
        (B, H, N, D) views the Gluon kernels would get; an empty one takes no descriptor)
        or the LSE rows are strided."""
        if main.variant.fa3 == "none" or (lse.stride(-1) == 1 and tma_ready(*tensors)
                                          and all(map(torch.Tensor.numel, tensors))):
            return main
        if not plain:
            plain.append(_Kernels(knobs(entry["twin"]), kernel_of, "_plain"))
        return plain[0]

    def run(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, scale: float,
            mods: Mods | None = None) -> tuple[torch.Tensor, ...]:
        if mods is not None:
            return run_modified(do, q, k, v, out, lse, scale, mods)
        b, hq, nq, _ = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        ks = kernels_for(lse, q, k, v, do, dq, dk, dv)
        var = ks.variant
        delta = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
        rows = (*lse.stride()[:2], *delta.stride()[:2])

        def dq_kernel(extra: tuple[Any, ...] = ()) -> None:
            if ks.gluon["dq"]:
                _launch_gluon(ks.tile_rows["dq"], ks.dq, (cdiv(nq, var.block_owned), b * hq),
                              (q, k, v, do, dq), lse, delta, rows, scale, (nq, nk), hq, group,
                              extra)
            elif ks.dq is not None:
                _triton_dq(ks, (cdiv(nq, var.block_owned), b * hq),
                           (q, k, v, do, lse, delta, dq), torch.Tensor.stride,
                           (*lse.stride(), *delta.stride()), scale, (nq, nk), hq, group, extra)

        if ks.fused_delta:  # dQ first: it stores delta for the dK/dV kernel
            dq_kernel((out, *out.stride()))
        else:
            preprocess()[(cdiv(nq, preprocess_block_m), b * hq)](
                out, do, delta, *out.stride(), *do.stride(), *delta.stride(), nq, hq
            )
        if ks.gluon["dkdv"]:
            acc = _dq_buffer(var, q.shape, q.device)
            _launch_gluon(ks.tile_rows["dkdv"], ks.dkdv, (cdiv(nk, var.block_owned), b * hkv),
                          (q, k, v, do, dk, dv), lse, delta, rows, scale, (nq, nk), hkv, group,
                          dq_reduce_args(var, acc))
            if acc is not None:
                dq.copy_(acc)
        else:
            _triton_dkdv(ks, q, k, v, do, lse, delta, dq, dk, dv, scale, group)
        if not ks.fused_delta:
            dq_kernel()
        return dq, dk, dv

    def run_modified(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, scale: float,
                     mods: Mods) -> tuple[torch.Tensor, ...]:
        """The kernels with the modifiers' arguments after the common ones. A packed call
        is one batch to the preprocessing kernel (its rows are independent) and one
        (batch, head) row of programs per sequence to the others; the Gluon kernels get
        descriptors over the (1, H, total, D) views and, last, the gradients they store
        through a row mask with their row and head strides. With sinks, dsinks_h =
        -sum_i P_sink,i delta_i follows from delta and the LSE: P_sink,i =
        exp(sink_h - LSE_i); the kernels take no sink argument."""
        packed = mods.varlen is not None
        if packed:
            assert mods.varlen is not None
            hq, hkv = q.shape[1], k.shape[1]
            b, nq, nk = mods.varlen.batch, mods.varlen.max_q, mods.varlen.max_k
            rows = q.shape[0]
            delta = torch.empty((hq, rows), device=q.device, dtype=torch.float32)
            row_strides = (0, *lse.stride(), 0, *delta.stride())
        else:
            b, hq, nq, _ = q.shape
            hkv, nk = k.shape[1], k.shape[2]
            delta = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
            row_strides = (*lse.stride(), *delta.stride())
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        extra = mods.kernel_args(shape.causal, nq, nk)
        extra = [a for a in extra if a is not mods.sinks]  # the sinks stay in the launcher
        # The Gluon kernels' (B, H, N, D) views: packed (total, H, D) tensors are one batch.
        view = (lambda t: t.unsqueeze(0).transpose(1, 2)) if packed else (lambda t: t)
        ks = kernels_for(lse, *(view(t) for t in (q, k, v, do, dq, dk, dv)))
        var = ks.variant
        s4 = lambda t: strides4(t, packed)
        # Gluon: (B, H) strides of LSE and delta (packed: (0, H's)); stores by pointer, packed.
        gluon_rows = (row_strides[0], row_strides[1], row_strides[3], row_strides[4]) if (
            packed) else (*lse.stride()[:2], *delta.stride()[:2])

        def dq_kernel(fused_args: tuple[Any, ...] = ()) -> None:
            if ks.gluon["dq"]:
                stores = (dq, *dq.stride()[:2]) if packed else ()
                _launch_gluon(ks.tile_rows["dq"], ks.dq, (cdiv(nq, var.block_owned), b * hq),
                              tuple(view(t) for t in (q, k, v, do, dq)), lse, delta,
                              gluon_rows, scale, (nq, nk), hq, group,
                              (*extra, *stores, *fused_args))
            else:
                _triton_dq(ks, (cdiv(nq, var.block_owned), b * hq),
                           (q, k, v, do, lse, delta, dq), s4, row_strides, scale, (nq, nk), hq,
                           group, (*extra, *fused_args))

        if ks.fused_delta:  # dQ first: it stores delta for the dK/dV kernel
            dq_kernel((out, *s4(out)))
        elif packed:  # one batch to the preprocessing kernel: its rows are independent
            preprocess()[(cdiv(rows, preprocess_block_m), hq)](
                out, do, delta, *strides4(out, True), *strides4(do, True), 0,
                *delta.stride(), rows, hq,
            )  # fmt: skip
        else:
            preprocess()[(cdiv(nq, preprocess_block_m), b * hq)](
                out, do, delta, *out.stride(), *do.stride(), *delta.stride(), nq, hq
            )
        acc = _dq_buffer(var, q.shape, q.device)
        dq_target = dq if acc is None else acc
        if ks.gluon["dkdv"]:
            stores = (dk, dv, *dk.stride()[:2], *dv.stride()[:2]) if packed else ()
            # The fp32 dQ buffer the kernel adds into by TMA reduce, over the same view.
            dq_args = dq_reduce_args(var, None if acc is None else view(acc))
            _launch_gluon(ks.tile_rows["dkdv"], ks.dkdv, (cdiv(nk, var.block_owned), b * hkv),
                          tuple(view(t) for t in (q, k, v, do, dk, dv)), lse, delta,
                          gluon_rows, scale, (nq, nk), hkv, group, (*extra, *stores, *dq_args))
        else:
            ks.dkdv[(cdiv(nk, var.block_owned), b * hkv)](
                q, k, v, do, lse, delta, dk, dv, dq_target,
                *s4(q), *s4(k), *s4(v), *s4(do), *row_strides, *s4(dk), *s4(dv),
                *s4(dq_target), scale, nq, nk, hkv, group, *extra, **ks.launch,
            )  # fmt: skip
        if acc is not None:
            dq.copy_(acc)
        elif not ks.fused_delta:  # (a fused_delta dQ kernel ran first)
            dq_kernel()
        if mods.sinks is None:
            return dq, dk, dv
        # lse and delta: (B, Hq, N) or, packed, (Hq, total_q); heads are dim -2 in both.
        sink = mods.sinks.view(-1, 1)
        share = torch.exp(sink - lse) * delta
        dsinks = -(share.sum(dim=(0, 2)) if share.dim() == 3 else share.sum(dim=1))
        return dq, dk, dv, dsinks

    return run


def _dq_buffer(variant: Any, shape: torch.Size, device: torch.device) -> torch.Tensor | None:
    """The zeroed fp32 buffer the atomic dQ mode sums every key block's share into (q's
    shape, contiguous), or None in the separate mode."""
    if variant.dq_mode != "atomic":
        return None
    return torch.zeros(shape, device=device, dtype=torch.float32)


def dq_reduce_args(variant: Any, acc: torch.Tensor | None) -> tuple[Any, ...]:
    """The Gluon dK/dV kernel's atomic-mode argument: a descriptor over the fp32 dQ buffer
    (a (B, H, N, D) view) moving the tile each consumer adds, block_streamed rows by its
    share of the columns (D split over block_owned / 64 consumers)."""
    if acc is None:
        return ()
    return (gluon_descriptor(acc, variant.block_streamed,
                             padded_head_dim(acc.shape[-1]) // (variant.block_owned // 64)),)


def _launch_gluon(rows: tuple[int, ...], fn: Any, grid: tuple[int, int],
                  tensors: tuple[torch.Tensor, ...], lse: torch.Tensor, delta: torch.Tensor,
                  row_strides: tuple[int, ...], scale: float, lengths: tuple[int, int],
                  heads: int, group: int, extra: tuple[Any, ...] = ()) -> None:
    """One Gluon backward kernel on `tensors` ((B, H, N, D) views of q, k, v, do, then its
    outputs), moving tiles of `rows` rows each (`fa3_tile_rows` of the kernel);
    `row_strides`: LSE's and delta's batch and head strides; `lengths`: N_Q and
    N_K (packed: the longest sequences'); `heads`: the heads its grid spans, H_KV or H_Q;
    `extra`: the modifiers' arguments (and a packed call's gradient pointers and strides).
    A head dim below the kernels' tile (80, 96, 112) is padded by TMA: tiles of the padded
    width, zero-filled on load and clipped on store."""
    cols = padded_head_dim(tensors[0].shape[-1])
    q, k, v, do, *outs = tensors
    fn[grid](
        gluon_descriptor(q, rows[0], cols), gluon_descriptor(k, rows[1], cols),
        gluon_descriptor(v, rows[2], cols), gluon_descriptor(do, rows[3], cols),
        *[gluon_descriptor(t, r, cols) for t, r in zip(outs, rows[4:], strict=True)],
        lse, delta, *row_strides, scale, *lengths, heads, group, *extra, num_warps=4,
    )  # fmt: skip


def _triton_dq(ks: _Kernels, grid: tuple[int, int], tensors: tuple[torch.Tensor, ...],
               stride: Callable[[torch.Tensor], tuple[int, ...]], row_strides: tuple[int, ...],
               scale: float, lengths: tuple[int, int], heads: int, group: int,
               extra: Sequence[Any] = ()) -> None:
    """The Triton dQ kernel on `tensors` (q, k, v, do, lse, delta, dq). Each program owns
    block_owned query rows (the pair swaps; see flashgen's BwdVariant). `stride`: a tensor's
    (B, H, N, D) strides (a packed call's: `strides4`); `row_strides`: LSE's and delta's
    three each; `extra`: the modifiers' arguments, then a fused_delta kernel's O and its
    strides."""
    q, k, v, do, lse, delta, dq = tensors
    assert ks.dq is not None
    ks.dq[grid](
        q, k, v, do, lse, delta, dq, *stride(q), *stride(k), *stride(v), *stride(do),
        *row_strides, *stride(dq), scale, *lengths, heads, group, *extra, **ks.launch,
    )  # fmt: skip


def _triton_dkdv(ks: _Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 do: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor,
                 dk: torch.Tensor, dv: torch.Tensor, scale: float, group: int) -> None:
    """The Triton dK/dV kernel; in the atomic dq mode it also fills `dq`."""
    b, nq = q.shape[0], q.shape[2]
    hkv, nk = k.shape[1], k.shape[2]
    acc = _dq_buffer(ks.variant, q.shape, q.device)
    dq_target = dq if acc is None else acc
    rows = (*lse.stride(), *delta.stride())
    ks.dkdv[(cdiv(nk, ks.variant.block_owned), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, dq_target,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *rows,
        *dk.stride(), *dv.stride(), *dq_target.stride(),
        scale, nq, nk, hkv, group,
        **ks.launch,
    )  # fmt: skip

    if acc is not None:
        dq.copy_(acc)
