"""Packed variable-length batches and the modifiers (sliding window, softcap, sinks), forward
and backward, against the float64 reference; their named input errors and validity rules.

Bounds follow tune/check.py: a kernel's error against the float64 truth may be ERROR_FACTOR
times the same-dtype eager reference's error, plus one rounding step of the largest value.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import flashgen
from flashgen.kernels.bwd_space import default_bwd_variant, why_invalid_bwd
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.fwd_space import default_variant, why_invalid
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import render
from flashgen.kernels.variant import Variant
from flashgen.tune import reference
from flashgen.tune.check import ERROR_FACTOR

pytestmark = pytest.mark.interpreter


def _bound_ok(got: torch.Tensor, truth: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype,
              what: str) -> None:
    finite = torch.isfinite(truth)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: non-finite where it should not be"
    err = (got.double() - truth)[finite].abs().max().item() if finite.any() else 0.0
    eager_err = (eager.double() - truth)[finite].abs().max().item() if finite.any() else 0.0
    rounding = torch.finfo(dtype).eps * max(1.0, truth[finite].abs().max().item())
    bound = ERROR_FACTOR * eager_err + rounding
    assert err <= bound, f"{what}: error {err:.2e} over bound {bound:.2e}"


def _check(call: Callable[..., tuple[torch.Tensor, torch.Tensor]],
           ref: Callable[..., tuple[torch.Tensor, torch.Tensor]],
           leaves: Sequence[torch.Tensor], seed: int = 1) -> None:
    """`call(*leaves)` (output, lse) and its gradients against `ref` in float64 (truth) and
    in the leaves' dtype (eager), for one random upstream gradient."""
    dtype = leaves[0].dtype
    out, lse = call(*leaves)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(
        out.device, dtype)
    grads = torch.autograd.grad(out, leaves, go)
    truth_leaves = [t.detach().double().requires_grad_() for t in leaves]
    truth, truth_lse = ref(*truth_leaves, dtype=torch.float64)
    truth_grads = torch.autograd.grad(truth, truth_leaves, go.double())
    eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    eager, eager_lse = ref(*eager_leaves, dtype=None)
    eager_grads = torch.autograd.grad(eager, eager_leaves, go)
    _bound_ok(out, truth, eager, dtype, "output")
    _bound_ok(lse, truth_lse, eager_lse, torch.float32, "lse")
    names = ("q", "k", "v", "sinks")
    for name, g, t, e in zip(names, grads, truth_grads, eager_grads, strict=False):
        _bound_ok(g, t, e, dtype, f"d{name}")


def _check_packed(lq: Sequence[int], lk: Sequence[int], d: int, causal: bool,
                  mods: dict | None = None, extra: Sequence[torch.Tensor] = (),
                  **options: Any) -> None:
    """`attention_varlen` on the GPU, bf16, 8 query heads on 2 K/V heads, with `mods` (and
    sinks in `extra`) and `options` (`variant=`, `bwd_variant=`), against the reference,
    gradients included."""
    dtype, mods = torch.bfloat16, mods or {}
    cu_q, cu_k = _cu(lq).cuda(), _cu(lk).cuda()
    leaves = [t.detach().cuda().requires_grad_()
              for t in [*_packed(lq, lk, 8, 2, d, dtype), *extra]]
    _check(lambda q, k, v, *s: flashgen.attention_varlen(
               q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
               sinks=s[0] if s else None, return_lse=True, **options, **mods),
           lambda q, k, v, *s, dtype: reference.attention_varlen(
               q, k, v, cu_q.cpu(), cu_k.cpu(), causal, None, dtype,
               sinks=s[0] if s else None, **mods),
           leaves)  # fmt: skip


def _cu(lengths: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(lq: Sequence[int], lk: Sequence[int], hq: int, hkv: int, d: int,
            dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    make = lambda n, h: torch.randn(n, h, d, generator=gen).to(dtype).requires_grad_()
    return [make(sum(lq), hq), make(sum(lk), hkv), make(sum(lk), hkv)]


LENGTHS = [5, 17, 1]

#: Persistent fa3 points on packed sequences: two 64-row consumers taking turns (the D128
#: default's tiles), the same without turns, 64-key tiles taking turns.
PERSISTENT_PACKED = [Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True),
                     Variant("fa3", 128, 128, 4, 2, programs_per_sm=1),
                     Variant("fa3", 128, 64, 4, 3, programs_per_sm=1, pingpong=True)]
#: Three 64-row consumers taking turns (D64 only: the persistent grid's 192-row tile).
THREE_CONSUMERS = Variant("fa3", 192, 128, 4, 3, programs_per_sm=1, pingpong=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keys", ["self", "cross"])
def test_varlen_matches_reference(dtype: torch.dtype, causal: bool, keys: str) -> None:
    lq = LENGTHS
    lk = LENGTHS if keys == "self" else [9, 3, 20]
    cq, ck = _cu(lq), _cu(lk)
    leaves = _packed(lq, lk, 4, 2, 16, dtype)
    _check(lambda q, k, v: flashgen.attention_varlen(q, k, v, cq, ck, max(lq), max(lk),
                                                    causal=causal, return_lse=True),
           lambda q, k, v, dtype: reference.attention_varlen(q, k, v, cq, ck, causal,
                                                             dtype=dtype),
           leaves)


MODIFIERS = {
    "window": {"window": (4, 2)},
    "window-left": {"window": (6, -1)},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": True},
    "all": {"window": (5, 3), "softcap": 2.0, "sinks": True},
}


def _sinks(mods: dict, hq: int, dtype: torch.dtype) -> tuple[dict, list[torch.Tensor]]:
    if not mods.get("sinks"):
        return mods, []
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(5)).to(dtype)
    return {k: v for k, v in mods.items() if k != "sinks"}, [sinks.requires_grad_()]


@pytest.mark.parametrize("name", list(MODIFIERS))
@pytest.mark.parametrize("causal", [False, True])
def test_modifier_matches_reference(name: str, causal: bool) -> None:
    dtype = torch.float32
    mods, extra = _sinks(MODIFIERS[name], 2, dtype)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 37, 16, generator=gen).requires_grad_() for h in (2, 1, 1))
    _check(lambda q, k, v, *s: flashgen.attention(q, k, v, causal=causal, sinks=s[0] if s
                                                  else None, return_lse=True, **mods),
           lambda q, k, v, *s, dtype: reference.attention(q, k, v, causal, None, dtype,
                                                          sinks=s[0] if s else None, **mods),
           [q, k, v, *extra])


@pytest.mark.parametrize("name", ["all", "window", "softcap", "sinks"])
@pytest.mark.parametrize("causal", [True, False])
def test_modifiers_on_packed_fp16(name: str, causal: bool) -> None:
    """Each modifier alone and all together on packed sequences, with gradients."""
    dtype = torch.float16
    mods, extra = _sinks(MODIFIERS[name], 4, dtype)
    lk = [9, 3, 20]
    cq, ck = _cu(LENGTHS), _cu(lk)
    leaves = [*_packed(LENGTHS, lk, 4, 2, 16, dtype), *extra]
    _check(lambda q, k, v, *s: flashgen.attention_varlen(
               q, k, v, cq, ck, 17, 20, causal=causal, sinks=s[0] if s else None,
               return_lse=True, **mods),
           lambda q, k, v, *s, dtype: reference.attention_varlen(
               q, k, v, cq, ck, causal, None, dtype, sinks=s[0] if s else None, **mods),
           leaves)  # fmt: skip


@pytest.mark.parametrize("name", ["none", "all"])
@pytest.mark.parametrize("causal", [True, False])
def test_fused_delta_on_packed_fp16(name: str, causal: bool) -> None:
    """The dQ kernel that works out delta itself (and runs first), on packed sequences with
    and without every modifier: its delta feeds dK/dV and the sinks' gradient."""
    dtype = torch.float16
    mods, extra = _sinks(MODIFIERS[name] if name != "none" else {}, 4, dtype)
    lk = [9, 3, 20]
    cq, ck = _cu(LENGTHS), _cu(lk)
    leaves = [*_packed(LENGTHS, lk, 4, 2, 16, dtype), *extra]
    bwd = BwdVariant(16, 16, 2, 1, fused_delta=True)
    _check(lambda q, k, v, *s: flashgen.attention_varlen(
               q, k, v, cq, ck, 17, 20, causal=causal, sinks=s[0] if s else None,
               return_lse=True, bwd_variant=bwd, **mods),
           lambda q, k, v, *s, dtype: reference.attention_varlen(
               q, k, v, cq, ck, causal, None, dtype, sinks=s[0] if s else None, **mods),
           leaves)  # fmt: skip


@pytest.mark.parametrize("variant", [
    Variant("fa2", 16, 16, 1, 1, split_mask=True),
    Variant("fa2", 16, 16, 1, 1, split_mask=False),
    Variant("fa2", 32, 16, 1, 1, split_mask=True, programs_per_sm=2),
    Variant("fa1", 16, 16, 1, 1),
], ids=str)
@pytest.mark.parametrize("bwd", [BwdVariant(16, 16, 1, 1),
                                 BwdVariant(16, 32, 1, 1, dq_mode="atomic"),
                                 BwdVariant(16, 16, 1, 1, fused_delta=True)], ids=str)
def test_window_tile_ranges(variant: Variant, bwd: BwdVariant) -> None:
    """Each loop shape (masked head, unmasked middle, masked tail; one masked range; a
    persistent grid; the atomic dQ) on windows narrower and wider than a tile, unequal
    lengths both ways."""
    for (nq, nk), window in (((70, 70), (20, 5)), ((23, 50), (3, 0)), ((50, 23), (-1, 17))):
        gen = torch.Generator().manual_seed(nq + nk)
        q, k, v = (torch.randn(1, 2, n, 16, generator=gen).requires_grad_()
                   for n in (nq, nk, nk))
        _check(lambda q, k, v, w=window: flashgen.attention(
                   q, k, v, window=w, return_lse=True, variant=variant, bwd_variant=bwd),
               lambda q, k, v, dtype, w=window: reference.attention(q, k, v, False, None,
                                                                    dtype, window=w),
               [q, k, v])


def test_unmodified_calls_render_the_plain_kernel() -> None:
    """A window of (-1, -1) is no window: the plain kernel serves it. A real one renders a
    kernel of its own, and only the fa2 pointer kernels take it."""
    p = Problem(1, 2, 1, 64, 64, 16, "fp32")
    v = default_variant(p, "cpu")
    assert render(v, p) == render(v, p.with_(window=False, softcap=False))
    assert render(v, p) != render(v, p.with_(window=True))
    q = torch.randn(1, 2, 8, 16)
    k = v_ = torch.randn(1, 1, 8, 16)
    torch.testing.assert_close(flashgen.attention(q, k, v_, window=(-1, -1)),
                               flashgen.attention(q, k, v_), rtol=0, atol=0)


def test_modifiers_keep_to_triton_kernels_and_the_one_tile_fa3() -> None:
    hopper = flashgen.DeviceInfo("H-test", (9, 0), 132, 232448)
    p = Problem(2, 8, 8, 1024, 1024, 128, "bf16", True, window=True)
    # Every modifier, alone or together, runs in the one-tile fa3 kernel too (16-bit); the
    # persistent kernel takes softcap, sinks and packing, not windows; fp8 keeps to fa1
    # and fa2.
    persistent = Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True)
    for fa3_ok in (p, p.with_(window=False, varlen=True), p.with_(varlen=True),
                   p.with_(window=False, softcap=True), p.with_(sinks=True, softcap=True),
                   p.with_(window=False, varlen=True, softcap=True, sinks=True)):
        assert why_invalid(Variant("fa3", 128, 128, 8, 2), fa3_ok, hopper) is None
        if fa3_ok.window:
            assert "persistent one takes sinks, softcap, varlen only" in why_invalid(
                persistent, fa3_ok, hopper)
        else:
            assert why_invalid(persistent, fa3_ok, hopper) is None
            # Tuned, not served untuned: the default stays fa2 until measured, but packed
            # D128 problems get the persistent kernel (measured on both GPUs).
            if fa3_ok.varlen:
                assert default_variant(fa3_ok, hopper) == persistent
            else:
                assert default_variant(fa3_ok, hopper).loop_order == "fa2"
    assert "fa1 and fa2 without use_tma" in why_invalid(Variant("fa3", 128, 128, 8, 2),
                                                        p.with_(dtype="fp8"), hopper)
    assert "fa1 and fa2 without use_tma" in why_invalid(
        Variant("fa2", 64, 64, 4, 2, use_tma=True), p, hopper)
    assert why_invalid(Variant("fa1", 64, 64, 4, 2), p, hopper) is None
    packed = p.with_(window=False, varlen=True)
    assert "not fa1" in why_invalid(Variant("fa1", 64, 64, 4, 2), packed, hopper)
    assert why_invalid(default_variant(p, hopper), p, hopper) is None
    assert default_variant(p, hopper).loop_order == "fa2"  # fa3 here is tuned, not a default
    # The Gluon backward kernels take every modifier too (sinks need nothing in them).
    for modified in (p, packed, p.with_(window=False, softcap=True), p.with_(sinks=True),
                     p.with_(varlen=True, softcap=True, sinks=True)):
        assert why_invalid_bwd(BwdVariant(64, 128, 4, 2, fa3="both"), modified, hopper) is None
        assert why_invalid_bwd(BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64),
                               modified.with_(head_dim=64), hopper) is None
        assert default_bwd_variant(modified, hopper).fa3 == "both"  # D128
    assert default_bwd_variant(p.with_(head_dim=64), hopper).smem_stats  # Gluon, D64 too
    assert str(p).endswith("causal window")


def test_a_modifier_the_gluon_backward_lacks_keeps_to_triton(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule names what the Gluon backward kernels do not take, and only that."""
    from flashgen.kernels import bwd_space

    hopper = flashgen.DeviceInfo("H-test", (9, 0), 132, 232448)
    monkeypatch.setattr(bwd_space, "FA3_BWD_MODIFIERS", frozenset({"varlen", "sinks"}))
    p = Problem(2, 8, 8, 1024, 1024, 128, "bf16", True, window=True, varlen=True)
    why = why_invalid_bwd(BwdVariant(64, 128, 4, 2, fa3="both"), p, hopper)
    assert why == "window run in the Triton backward kernels only (fa3 'none')"
    assert why_invalid_bwd(BwdVariant(64, 128, 4, 2, fa3="both"), p.with_(window=False),
                           hopper) is None
    assert default_bwd_variant(p, hopper).fa3 == "none"


def _bad_varlen(**change: object) -> None:
    q, k, v = (t.detach() for t in _packed(LENGTHS, LENGTHS, 2, 1, 16, torch.float32))
    args = {"cu_seqlens_q": _cu(LENGTHS), "cu_seqlens_k": _cu(LENGTHS), "max_seqlen_q": 17,
            "max_seqlen_k": 17, **change}
    flashgen.attention_varlen(q, k, v, args.pop("cu_seqlens_q"), args.pop("cu_seqlens_k"),
                              args.pop("max_seqlen_q"), args.pop("max_seqlen_k"), **args)


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"cu_seqlens_q": _cu(LENGTHS).long()}, TypeError, "cu_seqlens_q must be int32"),
    ({"cu_seqlens_k": torch.tensor([1, 5, 22, 23], dtype=torch.int32)}, ValueError,
     "must start at 0"),
    ({"cu_seqlens_q": torch.tensor([0, 5, 4, 23], dtype=torch.int32)}, ValueError,
     "must not decrease"),
    ({"cu_seqlens_q": torch.tensor([0, 5, 22, 22], dtype=torch.int32)}, ValueError,
     "must end at the packed length 23"),
    ({"max_seqlen_q": 16}, ValueError, r"max_seqlen_q \(16\) is smaller than the longest"),
    ({"max_seqlen_k": 1.5}, TypeError, "max_seqlen_k must be an int"),
    ({"window": (3,)}, TypeError, "window must be a pair"),
    ({"window": (2, 1.0)}, TypeError, "window must be a pair"),
    ({"window": (True, 1)}, TypeError, "window must be a pair"),
    ({"window": (-2, 1)}, ValueError, "window sides must be >= -1"),
    ({"softcap": 0.0}, ValueError, "softcap must be a finite number > 0"),
    ({"softcap": -1}, ValueError, "softcap must be a finite number > 0"),
    ({"softcap": "1"}, TypeError, "softcap must be a real number"),
    ({"sinks": torch.zeros(3)}, ValueError, r"sinks must have shape \(2,\)"),
    ({"sinks": torch.zeros(2, dtype=torch.float64)}, TypeError, "sinks must be"),
    ({"sinks": [0.0, 0.0]}, TypeError, "sinks must be a torch.Tensor"),
], ids=lambda x: str(x)[:40])
def test_bad_input_is_a_named_error(change: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _bad_varlen(**change)


def test_bad_packed_shapes_are_named_errors() -> None:
    q = torch.randn(23, 2, 16)
    with pytest.raises(ValueError, match="must be 3-D"):
        flashgen.attention_varlen(q[None], q, q, _cu(LENGTHS), _cu(LENGTHS), 17, 17)
    with pytest.raises(ValueError, match="same length"):
        flashgen.attention_varlen(q, q, q, _cu(LENGTHS), _cu([22, 1]), 17, 22)
    with pytest.raises(ValueError, match="softcap"):
        flashgen.attention(q[None], q[None], q[None], softcap=float("inf"))


def test_modified_calls_run_outside_the_graph_under_torch_compile() -> None:
    """Packed and modified calls read offsets on the host: under torch.compile they break the
    graph and run eagerly (eager calls skip that wrapper), giving eager's answer."""
    q, k, v = (t.detach() for t in _packed(LENGTHS, LENGTHS, 2, 1, 16, torch.float32))
    cu = _cu(LENGTHS)

    def calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        packed = flashgen.attention_varlen(q, k, v, cu, cu, 17, 17, causal=True, softcap=5.0)
        dense = flashgen.attention(q[None].transpose(1, 2), k[None].transpose(1, 2),
                                   v[None].transpose(1, 2), window=(3, 0))
        return packed.sum() + dense.sum()

    torch._dynamo.reset()
    compiled = torch.compile(calls, backend="eager")(q, k, v)
    assert torch.allclose(compiled, calls(q, k, v), rtol=1e-5, atol=1e-5)


def test_offsets_are_read_once_per_tensor_and_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each host read of the offsets is a GPU sync, which stalls a train step's every layer:
    a tensor already checked is not read again until torch sees it written in place. A bad
    value written later is still a named error, and a freed tensor leaves no entry behind."""
    import gc

    from flashgen.runtime import modifiers

    reads: list[int] = []
    tolist = torch.Tensor.tolist

    def counted(t: torch.Tensor) -> list:
        reads.append(t.numel())
        return tolist(t)

    q = torch.randn(23, 2, 16)
    cu, other = _cu(LENGTHS), _cu(LENGTHS)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    first = modifiers.check_varlen(q, q, cu, cu, 17, 17)
    assert len(reads) == 1  # q's and k's offsets are one tensor: read once
    again = modifiers.check_varlen(q, q, cu, cu, 17, 17)
    assert len(reads) == 1 and again.offsets_q is first.offsets_q
    modifiers.check_varlen(q, q, cu, other, 17, 17)
    assert len(reads) == 2  # equal values, but another tensor: read
    cu[1] = 30  # in place: read again, and refused
    with pytest.raises(ValueError, match="must not decrease"):
        modifiers.check_varlen(q, q, cu, cu, 17, 17)
    assert len(reads) == 3
    key = id(other)
    del other
    gc.collect()
    assert key not in modifiers._READ


@pytest.mark.parametrize("causal", [False, True])
def test_tile_schedule_lists_every_tile_costliest_first(causal: bool) -> None:
    """The tile list of the persistent packed kernels: every (sequence, Q tile) once, by the
    keys its rows see (counted here from the mask itself), most first; each sequence's last
    tile marked, and an empty sequence listed once (row 0, marked, last in the list)."""
    from flashgen.runtime.modifiers import tile_schedule

    lens_q, lens_k = [5, 17, 0, 1, 9], [9, 17, 3, 20, 4]
    offsets = lambda lens: tuple(int(x) for x in torch.tensor([0, *lens]).cumsum(0))
    table, count = tile_schedule(offsets(lens_q), offsets(lens_k), 4, causal,
                                 torch.device("cpu"))
    entries = [tuple(r) for r in table.tolist()]
    assert count == len(entries) == sum(max(1, -(-n // 4)) for n in lens_q)
    assert sorted(entries) == [(b, r, int(r + 4 >= n)) for b, n in enumerate(lens_q)
                               for r in range(0, max(n, 1), 4)]
    assert (2, 0, 1) in entries  # the empty sequence: cost 0, with the last entries

    def seen(b: int, row: int) -> int:  # keys any row of the (full-height) tile sees
        lq, lk = lens_q[b], lens_k[b]
        return max((sum(1 for j in range(lk) if not causal or j <= i + lk - lq)
                    for i in range(row, min(row + 4, lq))), default=0)

    costs = [seen(b, r) for b, r, _ in entries]
    assert costs == sorted(costs, reverse=True) and costs[0] == 20
    assert tile_schedule(offsets(lens_q), offsets(lens_k), 4, causal,
                         torch.device("cpu"))[0] is table  # cached
    empty, one = tile_schedule((0, 0), (0, 3), 4, causal, torch.device("cpu"))
    assert one == 1 and empty.tolist() == [[0, 0, 1]]


def test_a_package_without_modified_kernels_names_them() -> None:
    """A dispatcher that renders no modifiers, asked for one, says so instead of launching
    a kernel of the wrong signature (an exported package names the sets it lacks:
    test_export.py)."""
    from flashgen.runtime.dispatch import Dispatcher
    from flashgen.runtime.modifiers import Mods

    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="plain attention kernels only"):
        Dispatcher().forward(q, q, q, False, None, None, Mods(softcap=1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["none", "window", "softcap", "sinks", "all"])
def test_packed_bf16_on_the_gpu(causal: bool, name: str) -> None:
    """Real sizes in bf16: twelve sequences of 1 to 700 tokens, self-attention, D128, GQA 4."""
    dtype = torch.bfloat16
    mods, extra = _sinks(MODIFIERS.get(name, {}), 8, dtype)
    lengths = [1, 700, 63, 129, 5, 512, 256, 17, 640, 2, 300, 64]
    cu = _cu(lengths).cuda()
    leaves = [t.detach().cuda().requires_grad_()
              for t in [*_packed(lengths, lengths, 8, 2, 128, dtype), *extra]]
    _check(lambda q, k, v, *s: flashgen.attention_varlen(
               q, k, v, cu, cu, max(lengths), max(lengths), causal=causal,
               sinks=s[0] if s else None, return_lse=True, **mods),
           lambda q, k, v, *s, dtype: reference.attention_varlen(
               q, k, v, cu.cpu(), cu.cpu(), causal, None, dtype, sinks=s[0] if s else None,
               **mods),
           leaves)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", [Variant("fa3", 128, 128, 8, 2), Variant("fa3", 128, 64, 4, 3),
                                     Variant("fa3", 64, 64, 4, 2)], ids=str)
@pytest.mark.parametrize("d", [64, 96, 128])
def test_packed_fa3_on_the_gpu(causal: bool, variant: Variant, d: int) -> None:
    """The one-tile fa3 kernel on packed sequences: tiles that run into the next sequence
    (lengths not multiples of any tile), empty and one-token sequences, cross-attention; D96
    padded to 128 (its masked O store must leave the next head's columns alone)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    _check_packed([1, 700, 63, 129, 0, 512, 256, 17, 640, 2, 300, 64],
                  [3, 650, 63, 200, 5, 512, 1, 17, 700, 2, 300, 70], d, causal, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("variant", "d", "mods"), [
    *((v, d, "plain") for v in PERSISTENT_PACKED for d in (64, 128)),
    (PERSISTENT_PACKED[0], 96, "plain"),  # padded: the O store leaves the next head's columns
    (PERSISTENT_PACKED[0], 128, "softcap+sinks"), (THREE_CONSUMERS, 64, "plain"),
    (THREE_CONSUMERS, 64, "softcap+sinks")], ids=str)
def test_persistent_packed_fa3_on_the_gpu(causal: bool, variant: Variant, d: int,
                                          mods: str) -> None:
    """The persistent fa3 kernel on packed sequences, walking the tile schedule: empty and
    one-token sequences, a sequence with no keys, lengths off every tile size and over
    several tiles, cross-attention, GQA (8 query heads on 2), D96 padded to 128, more
    (tile, head) units than programs (so the Q buffers and the K/V ring run on across units
    of different sequences); softcap and sinks together in one case a point."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    dtype = torch.bfloat16
    lq = [1, 700, 63, 129, 0, 512, 256, 17, 640, 2, 300, 64, 1000]
    lk = [3, 650, 63, 200, 5, 512, 0, 17, 700, 2, 300, 70, 1000]
    wanted, extra = _sinks({"softcap": 20.0, "sinks": True} if mods != "plain" else {}, 8,
                           dtype)
    cu_q, cu_k = _cu(lq).cuda(), _cu(lk).cuda()
    leaves = [t.detach().cuda().requires_grad_()
              for t in [*_packed(lq, lk, 8, 2, d, dtype, seed=19), *extra]]
    _check(lambda q, k, v, *s: flashgen.attention_varlen(
               q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
               sinks=s[0] if s else None, return_lse=True, variant=variant, **wanted),
           lambda q, k, v, *s, dtype: reference.attention_varlen(
               q, k, v, cu_q.cpu(), cu_k.cpu(), causal, None, dtype,
               sinks=s[0] if s else None, **wanted),
           leaves)  # fmt: skip


@pytest.mark.gpu
def test_packed_fa3_without_any_key() -> None:
    """A packing with queries and no key at all: TMA takes no descriptor over the empty K,
    so the forward and the backward run the pointer twins (explicit fa3 variants are invalid
    for so few keys; the dispatched ones on Hopper are fa3); every row's output is 0, its
    LSE -inf, and dq is 0."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    q = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(0, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.zeros(0, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_q, cu_k = _cu([100, 200]).cuda(), _cu([0, 0]).cuda()
    out, lse = flashgen.attention_varlen(q, k, v, cu_q, cu_k, 200, 1, return_lse=True)
    out.sum().backward()
    assert not out.any() and bool((lse == float("-inf")).all())
    assert q.grad is not None and not q.grad.any()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", [PERSISTENT_PACKED[0], Variant("fa3", 128, 128, 4, 2)],
                         ids=str)
def test_packed_fa3_reads_offsets_changed_unseen(causal: bool, variant: Variant) -> None:
    """Offsets written where torch counts no write (`.data`; a collective into the buffer
    alike) are not read again on the host, but the kernels read them on the device: the
    persistent kernel's tile schedule (built from the old ones) only orders its work, so a
    sequence that grew by several tiles and one that shrank to nothing are still right."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    dtype = torch.bfloat16
    before, after = [300, 500, 40, 160], [900, 0, 40, 60]  # same total: the host check holds
    cu = _cu(before).cuda()
    q, k, v = (t.detach().cuda() for t in _packed(before, before, 8, 2, 128, dtype, seed=5))
    call = lambda: flashgen.attention_varlen(q, k, v, cu, cu, 900, 900, causal=causal,
                                             return_lse=True, variant=variant)
    with torch.no_grad():
        call()  # reads `before` on the host, builds the schedule from it
        cu.data.copy_(_cu(after).cuda())
        assert cu.tolist() == [0, 900, 900, 940, 1000]
        out, lse = call()
        offsets = _cu(after)
        truth, truth_lse = reference.attention_varlen(
            q.double(), k.double(), v.double(), offsets, offsets, causal, None, torch.float64)
        eager, eager_lse = reference.attention_varlen(q, k, v, offsets, offsets, causal, None,
                                                      None)
    _bound_ok(out, truth, eager, dtype, "output")
    _bound_ok(lse, truth_lse, eager_lse, torch.float32, "lse")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(256, 0), (100, 37), (-1, 64), (0, 0)], ids=str)
@pytest.mark.parametrize("variant", [Variant("fa3", 128, 128, 8, 2), Variant("fa3", 128, 64, 4, 3),
                                     Variant("fa3", 64, 64, 4, 2)], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_window_fa3_on_the_gpu(window: tuple[int, int], variant: Variant, packed: bool) -> None:
    """The one-tile fa3 kernel under a sliding window: K/V ranges that start past tile 0,
    masked edges on both sides, Nq != Nk; packed, sequences of 1 to 900 tokens."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    dtype = torch.bfloat16
    if packed:
        lq, lk = [1, 900, 63, 300, 17], [5, 900, 80, 290, 17]
        cu_q, cu_k = _cu(lq).cuda(), _cu(lk).cuda()
        leaves = [t.detach().cuda().requires_grad_() for t in _packed(lq, lk, 8, 2, 128, dtype)]
        _check(lambda q, k, v: flashgen.attention_varlen(
                   q, k, v, cu_q, cu_k, max(lq), max(lk), window=window, return_lse=True,
                   variant=variant),
               lambda q, k, v, dtype: reference.attention_varlen(
                   q, k, v, cu_q.cpu(), cu_k.cpu(), False, None, dtype, window=window),
               leaves)  # fmt: skip
        return
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, h, n, 128, generator=gen).to("cuda", dtype).requires_grad_()
               for h, n in ((8, 1300), (2, 1500), (2, 1500)))
    _check(lambda q, k, v: flashgen.attention(q, k, v, window=window, return_lse=True,
                                              variant=variant),
           lambda q, k, v, dtype: reference.attention(q, k, v, False, None, dtype,
                                                      window=window),
           [q, k, v])


def _fa3_modifiers(name: str, dtype: torch.dtype) -> tuple[dict, list[torch.Tensor]]:
    """The modifiers `name` ("all": with a window too) for 8 query heads, and the sinks."""
    mods, extra = _sinks({**MODIFIERS[name], **({"window": (300, 40)} if name == "all"
                                                 else {})}, 8, dtype)
    if "softcap" in mods:
        mods["softcap"] = 20.0  # Gemma 2's 50 and 30 barely bend N(0, 1) scores
    return mods, extra


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softcap", "sinks", "all"])
@pytest.mark.parametrize("variant", [Variant("fa3", 128, 128, 8, 2), Variant("fa3", 128, 64, 4, 3),
                                     Variant("fa3", 64, 64, 4, 2)], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_modified_fa3_on_the_gpu(name: str, variant: Variant, packed: bool,
                                 causal: bool) -> None:
    """The one-tile fa3 kernel with softcap, sinks and all modifiers (window too), dense and
    packed, in bf16 at D128, with the Triton backward behind it."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    dtype = torch.bfloat16
    mods, extra = _fa3_modifiers(name, dtype)
    if packed:
        _check_packed([1, 900, 63, 300, 17], [5, 900, 80, 290, 17], 128, causal, mods, extra,
                      variant=variant)
        return
    _check_dense_gqa(variant, causal, mods, extra, 128, dtype, seed=13)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softcap", "sinks", "all"])
@pytest.mark.parametrize("causal", [False, True])
def test_split_head_dim_fa3_with_modifiers_on_the_gpu(name: str, causal: bool) -> None:
    """The one-tile fa3 kernel at D192 (split_d: products over the 256 tile's first 192
    columns, O in two accumulators) with softcap, sinks and all modifiers, in bf16 (the
    persistent one: `test_persistent_fa3_softcap_and_sinks_on_the_gpu`)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    dtype = torch.bfloat16
    mods, extra = _fa3_modifiers(name, dtype)
    _check_dense_gqa(Variant("fa3", 128, 64, 4, 2), causal, mods, extra, 192, dtype, seed=17)


def _check_dense_gqa(variant: Variant | None, causal: bool, mods: dict,
                     extra: list[torch.Tensor], d: int, dtype: torch.dtype, seed: int,
                     **options: Any) -> None:
    """`variant` (None: dispatched) with `mods` (and sinks in `extra`) and `options` (a
    `bwd_variant=`) on the GPU against the reference, with gradients: 8 query heads on 2
    K/V heads, 1300 queries against 1500 keys."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [t.to("cuda", dtype).requires_grad_() for t in (
        torch.randn(2, 8, 1300, d, generator=gen), torch.randn(2, 2, 1500, d, generator=gen),
        torch.randn(2, 2, 1500, d, generator=gen))] + [t.cuda().detach().requires_grad_()
                                                        for t in extra]
    _check(lambda q, k, v, *s: flashgen.attention(
               q, k, v, causal=causal, sinks=s[0] if s else None, return_lse=True,
               variant=variant, **options, **mods),
           lambda q, k, v, *s, dtype: reference.attention(
               q, k, v, causal, None, dtype, sinks=s[0] if s else None, **mods),
           leaves)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softcap", "sinks", "both"])
@pytest.mark.parametrize(("variant", "d"), [
    (Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True), 128),
    (Variant("fa3", 128, 64, 4, 3, programs_per_sm=1), 128),
    (Variant("fa3", 192, 128, 4, 3, programs_per_sm=1, pingpong=True), 64),
    # split_d: products over the 256 tile's first 192 columns
    (Variant("fa3", 128, 64, 4, 2, programs_per_sm=1, pingpong=True), 192)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_fa3_softcap_and_sinks_on_the_gpu(name: str, variant: Variant, d: int,
                                                     causal: bool) -> None:
    """The persistent fa3 kernel with softcap and sinks: many tiles a program, the causal
    half-width step, GQA, Nq != Nk; D64 for three consumers, D192 (split_d), else D128."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    dtype = torch.bfloat16
    wanted = {"softcap": 20.0} if name != "sinks" else {}
    mods, extra = _sinks({**wanted, **({"sinks": True} if name != "softcap" else {})}, 8,
                         dtype)
    _check_dense_gqa(variant, causal, mods, extra, d, dtype, seed=17)


@pytest.mark.parametrize("causal", [False, True])
def test_persistent_fa3_softcap_and_sinks_compile_for_hopper(causal: bool) -> None:
    """Two consumers at D128 take the cap and the sink without spilling."""
    from flashgen.tune.gluon_compile import report_in_subprocess

    variant = Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True)
    problem = Problem(2, 16, 16, 4096, 4096, 128, "bf16", causal, softcap=True, sinks=True)
    found = report_in_subprocess(variant, problem)
    assert found["wgmma"] and found["tma"] and found["byte_permutes"] == 0
    assert any("0 bytes spill stores" in line for line in found["ptxas"]), found["ptxas"]


@pytest.mark.parametrize("variant", [Variant("fa3", 128, 128, 8, 2),
                                     Variant("fa3", 128, 128, 4, 2)], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_packed_fa3_compiles_for_hopper(variant: Variant, d: int) -> None:
    """Compiled for sm90a on any machine (`gluon_compile`): warpgroup products, TMA loads,
    the softmax under P V, no spills."""
    from flashgen.tune.gluon_compile import report_in_subprocess

    hopper = flashgen.DeviceInfo("H-test", (9, 0), 132, 232448)
    problem = Problem(2, 16, 16, 4096, 4096, d, "bf16", True, varlen=True)
    assert why_invalid(variant, problem, hopper) is None
    found = report_in_subprocess(variant, problem)
    assert found["wgmma"] and found["tma"] and found["wait_one"]
    assert found["exp_under_pv"] and all(found["exp_under_pv"]), found["exp_under_pv"]
    # The masked O store packs bf16 pairs (a byte permute each, D / 4 per consumer thread);
    # P is never repacked in the loop, which would cost one per P element pair and step.
    consumers = variant.block_m // (16 * variant.num_warps)
    assert found["byte_permutes"] <= consumers * d // 4, found["byte_permutes"]
    assert found["shared"] <= hopper.shared_memory
    assert any("0 bytes spill stores" in line for line in found["ptxas"]), found["ptxas"]


@pytest.mark.parametrize("d", [96, 128])
def test_packed_one_tile_staged_o_store_compiles_for_hopper(d: int) -> None:
    """`o_staged_one_tile` (on; off is the register store, kept for A/Bs): the one-tile
    kernel's packed O staged in Q's buffer and read back 16 bytes a lane compiles as the
    register store does, no spills and the same shared memory."""
    from flashgen.kernels.render import _templates, render_with
    from flashgen.tune.gluon_compile import report_in_subprocess

    variant = Variant("fa3", 128, 128, 4, 2)
    problem = Problem(2, 16, 16, 4096, 4096, d, "bf16", True, varlen=True)
    assert render(variant, problem) == render_with(_templates(), variant, problem,
                                                   {"o_staged_one_tile": True})
    staged = report_in_subprocess(variant, problem)
    plain = report_in_subprocess(variant, problem, overrides={"o_staged_one_tile": False})
    assert staged["shared"] == plain["shared"]
    assert staged["exp_under_pv"] == plain["exp_under_pv"]
    assert any("0 bytes spill stores" in line for line in staged["ptxas"]), staged["ptxas"]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_one_tile_staged_o_store_on_the_gpu(d: int, causal: bool) -> None:
    """The staged O store computes what the register store does, bit for bit: only the way
    O leaves differs (sequences that end inside a tile, an empty one, D96's padded columns)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3 runs on Hopper")
    from flashgen.kernels.problem import mix_bucket
    from flashgen.kernels.render import _load_module, _templates, render_with, source_hash
    from flashgen.runtime.modifiers import Mods, Varlen
    from flashgen.serve import prepare_forward

    lens = [1, 700, 63, 0, 129, 300]
    offsets = (0, *itertools.accumulate(lens))
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    total = offsets[-1]
    q, k, v = (torch.randn(total, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    variant = Variant("fa3", 128, 128, 4, 2)
    problem = Problem(len(lens), 8, 8, max(lens), max(lens), d, "bf16", causal, varlen=True,
                      mix=mix_bucket(len(lens), max(lens), total))
    source = render_with(_templates(), variant, problem, {"o_staged_one_tile": False})
    registers = prepare_forward(variant, problem,
                                kernel=_load_module(source_hash(source), source).attn_fwd)
    mods = Mods(varlen=Varlen(cu, cu, max(lens), max(lens), offsets, offsets))
    want = registers(q, k, v, d ** -0.5, mods)[0]
    assert torch.equal(prepare_forward(variant, problem)(q, k, v, d ** -0.5, mods)[0], want)


def _spilled(report: dict) -> int:
    """Bytes of spill stores a thread in a `gluon_compile` report's ptxas lines, which must
    have ptxas's spill line."""
    from flashgen.tune.gluon_compile import spill_store_bytes

    assert any("spill stores" in line for line in report["ptxas"]), report["ptxas"]
    return spill_store_bytes(report["ptxas"])


def _packed_and_dense_reports(variant: Variant, problem: Problem) -> tuple[dict, dict]:
    """`gluon_compile`'s reports of `variant` on packed `problem` and on its dense twin."""
    from flashgen.tune.gluon_compile import report_in_subprocess

    hopper = flashgen.DeviceInfo("H-test", (9, 0), 132, 232448)
    assert why_invalid(variant, problem, hopper) is None
    return (report_in_subprocess(variant, problem),
            report_in_subprocess(variant, problem.with_(varlen=False)))


@pytest.mark.parametrize(("variant", "d", "causal"), [
    (PERSISTENT_PACKED[0], 64, False), (PERSISTENT_PACKED[0], 64, True),
    (PERSISTENT_PACKED[0], 128, False), (PERSISTENT_PACKED[0], 128, True),
    (PERSISTENT_PACKED[1], 128, False), (PERSISTENT_PACKED[1], 128, True),
    (PERSISTENT_PACKED[2], 128, True)], ids=str)
def test_persistent_packed_fa3_compiles_for_hopper(variant: Variant, d: int,
                                                   causal: bool) -> None:
    """The persistent kernel's varlen structure, compiled for sm90a: warpgroup products, TMA
    loads, few spills with two consumers, and the same scheduling of the softmax against the
    P V product as the dense kernel (that kernel runs faster without the pin that holds the
    softmax under P V in the one-tile kernel, docs/fa3-hopper.md, so ptxas puts the wait
    first in both)."""
    packed, dense = _packed_and_dense_reports(
        variant, Problem(2, 16, 16, 4096, 4096, d, "bf16", causal, varlen=True))
    assert packed["wgmma"] == dense["wgmma"] and packed["tma"] and packed["wait_one"]
    assert packed["setmaxnreg"]
    assert packed["exp_under_pv"] == dense["exp_under_pv"], packed["exp_under_pv"]
    # The packed O store reads O back from shared memory; with no alignment hints (this
    # compile has none, a launch has) it stores 16-bit elements and unpacks bf16 pairs with
    # byte permutes, at most one an element. P repacked before every P V product would add
    # about one per P element pair, product site and consumer (64 and more a consumer).
    o_elements = variant.fa3_consumers * variant.fa3_rows * d // (32 * variant.num_warps)
    assert packed["byte_permutes"] - dense["byte_permutes"] <= o_elements, (
        packed["byte_permutes"], dense["byte_permutes"])
    # No O staging buffer: less shared memory than the dense kernel.
    assert packed["shared"] < dense["shared"]
    # The walk that reads each entry's offsets on the device (and may take more than one
    # tile) and the Q buffer held until O has been read back from it cost consumers at D128
    # up to 32 bytes a thread of spill stores (measured 20; the tuner weighs it); nothing at
    # D64.
    assert _spilled(packed) <= (48 if d == 128 else 0), packed["ptxas"]


@pytest.mark.parametrize(("variant", "d"), [(PERSISTENT_PACKED[0], 128), (THREE_CONSUMERS, 64)],
                         ids=str)
def test_persistent_packed_fa3_with_softcap_and_sinks_compiles_for_hopper(variant: Variant,
                                                                          d: int) -> None:
    """Packing, softcap and sinks together under the causal mask: two consumers at D128
    spill at most the device-side walk's few bytes; three at D64 spill (the dense kernel
    does too, 160 registers a thread), and packing adds no spills to the dense kernel's."""
    packed, dense = _packed_and_dense_reports(variant, Problem(
        2, 16, 16, 4096, 4096, d, "bf16", True, varlen=True, softcap=True, sinks=True))
    assert packed["wgmma"] and packed["tma"] and packed["wait_one"]

    if variant.fa3_consumers == 2:  # the device-side walk's spill (see above)
        assert _spilled(packed) <= 48, packed["ptxas"]
    else:
        assert _spilled(packed) <= _spilled(dense), (packed["ptxas"], dense["ptxas"])


def test_persistent_fa3_takes_packed_sequences() -> None:
    """The rules: the persistent fa3 kernel takes packed sequences (with softcap and sinks,
    two or three consumers), not with whole heads (the tile schedule balances the work),
    windows or fp8; the tuner's space and portfolio hold it, and at D128 it is the untuned
    default."""
    from flashgen.kernels.fwd_space import portfolio, search_space

    hopper = flashgen.DeviceInfo("H-test", (9, 0), 132, 232448)
    packed = Problem(4, 16, 4, 2048, 2048, 128, "bf16", True, varlen=True)
    for v in PERSISTENT_PACKED:
        assert why_invalid(v, packed, hopper) is None
        assert why_invalid(v, packed.with_(causal=False, softcap=True, sinks=True),
                           hopper) is None
    d64 = packed.with_(head_dim=64)
    assert why_invalid(THREE_CONSUMERS, d64.with_(causal=False), hopper) is None
    heads = Variant("fa3", 128, 128, 4, 3, programs_per_sm=1, head_units=True)
    assert why_invalid(heads, d64.with_(varlen=False), hopper) is None
    assert "tile schedule" in why_invalid(heads, d64, hopper)
    assert "persistent one takes sinks, softcap, varlen only" in why_invalid(
        PERSISTENT_PACKED[0], packed.with_(window=True), hopper)
    assert "fp8 packed sequences are not built" in why_invalid(
        PERSISTENT_PACKED[0], packed.with_(dtype="fp8"), hopper)
    space = search_space(d64, hopper)
    assert any(v.loop_order == "fa3" and v.programs_per_sm for v in space)
    assert not any(v.head_units for v in space)
    assert PERSISTENT_PACKED[0] in portfolio(packed, hopper)
    # The packed default is a D128 one; D64 packed problems run fa3 when tuned.
    assert default_variant(packed, hopper).loop_order == "fa3"
    assert default_variant(d64, hopper).loop_order == "fa2"


def test_an_explicit_fa3_variant_names_a_packing_without_keys() -> None:
    """TMA takes no descriptor over a packing with no key: dispatched, the pointer twin runs
    it (GPU test above); an explicit fa3 variant is not silently replaced but refused."""
    from flashgen.runtime import forward
    from flashgen.runtime.modifiers import Mods, Varlen
    from flashgen.runtime.table import Shape

    lens = Varlen(_cu([3, 4]), _cu([0, 0]), 4, 1, (0, 3, 7), (0, 0, 0))
    shape = Shape(2, 2, 2, 4, 1, 128, "bf16", False, varlen=True, mix=1)
    variant = Variant("fa3", 128, 128, 4, 2)
    run = forward._prepare_tma({"variant": variant.to_dict()}, shape, lambda role: None, True)
    q, k = torch.zeros(7, 2, 128, dtype=torch.bfloat16), torch.zeros(0, 2, 128,
                                                                    dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="packing with no key"):
        run(q, k, k, 0.125, Mods(varlen=lens))


@pytest.mark.parametrize("variant", [PERSISTENT_PACKED[0], Variant("fa3", 128, 128, 4, 2)],
                         ids=str)
def test_packed_fa3_launch_matches_the_kernel_signature(variant: Variant,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's packed fa3 call, argument by argument against the rendered kernel's
    signature (fa3 cannot run on the CPU): the persistent kernel gets one program per SM,
    at most one per (tile, head) unit, and the tile schedule's length and table after
    GROUP; the one-tile kernel its (Q tiles, sequences x heads) grid. Every sequence empty:
    no launch (nor a descriptor over the empty packing, which TMA refuses)."""
    import ast

    from flashgen.runtime import forward
    from flashgen.runtime.modifiers import Mods, Varlen, tile_schedule
    from flashgen.runtime.table import Shape

    calls: list[tuple] = []

    class Kernel:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            return lambda *args, **kw: calls.append((grid, args, kw))

    monkeypatch.setattr(forward, "bind", lambda kernel: kernel)
    monkeypatch.setattr(forward, "sm_count", lambda device: 132)
    hq, hkv, d = 8, 2, 128

    def call(lq: list[int], lk: list[int]) -> tuple[torch.Tensor, torch.Tensor, Mods]:
        oq = tuple(int(x) for x in _cu(lq))
        ok = tuple(int(x) for x in _cu(lk))
        lens = Varlen(_cu(lq), _cu(lk), max(1, *lq), max(1, *lk), oq, ok)
        mods = Mods(softcap=20.0, sinks=torch.zeros(hq), varlen=lens)
        shape = Shape(len(lq), hq, hkv, lens.max_q, lens.max_k, d, "bf16", True, softcap=True,
                      sinks=True, varlen=True, mix=2)
        run = forward._prepare_tma({"variant": variant.to_dict()}, shape,
                                   lambda role: Kernel(), True)
        q = torch.zeros(sum(lq), hq, d, dtype=torch.bfloat16)
        k = torch.zeros(sum(lk), hkv, d, dtype=torch.bfloat16)
        out, lse = run(q, k, k, 0.125, mods)
        return out, lse, mods

    lq, lk = [300, 0, 129, 1], [250, 4, 129, 0]
    out, lse, mods = call(lq, lk)
    [(grid, args, kw)] = calls
    source = render(variant, Problem(4, hq, hkv, 300, 250, d, "bf16", True, softcap=True,
                                     sinks=True, varlen=True))
    kernel = next(node for node in ast.parse(source).body
                  if isinstance(node, ast.FunctionDef) and node.name == "attn_fwd")
    names = [a.arg for a in kernel.args.args]
    assert len(names) == len(args)
    named = dict(zip(names, args, strict=True))
    tiles = sum(max(1, -(-n // variant.block_m)) for n in lq)  # an entry per empty one
    if variant.programs_per_sm:
        assert grid == (min(tiles * hq, 132),)
        table, count = tile_schedule(_offsets(lq), _offsets(lk), variant.block_m, True,
                                     torch.device("cpu"))
        assert named["TILES"] == count == tiles and torch.equal(named["SCHED"], table)
    else:
        assert grid == (-(-max(lq) // variant.block_m), len(lq) * hq)
    assert named["CU_Q"] is mods.varlen.cu_q and named["CU_K"] is mods.varlen.cu_k
    assert (named["H_Q"], named["GROUP"], named["SOFTCAP"]) == (hq, hq // hkv, 20.0)
    assert named["SINKS"] is mods.sinks and named["O"] is out and named["LSE"] is lse
    assert (named["stride_lb"], named["stride_lh"]) == (0, sum(lq))
    assert (named["stride_on"], named["stride_oh"]) == out.stride()[:2]
    assert kw == {"num_warps": variant.num_warps}
    calls.clear()
    out, lse, _ = call([0, 0], [3, 0])
    assert out.shape == (0, hq, d) and lse.shape == (hq, 0)
    assert calls == []


def _offsets(lengths: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in _cu(lengths))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", [Variant("fa3", 128, 128, 8, 2), Variant("fa3", 64, 64, 4, 3)],
                         ids=str)
def test_modified_fa3_compiles_for_hopper(variant: Variant, causal: bool) -> None:
    """Window, softcap and sinks at D64, where nothing spills (at D128 the window's masks
    and the sink spill 4-36 bytes a thread in some tiles: the tuner weighs those points)."""
    from flashgen.tune.gluon_compile import report_in_subprocess

    hopper = flashgen.DeviceInfo("H-test", (9, 0), 132, 232448)
    problem = Problem(2, 16, 16, 4096, 4096, 64, "bf16", causal, window=True, softcap=True,
                      sinks=True)
    assert why_invalid(variant, problem, hopper) is None
    found = report_in_subprocess(variant, problem)
    assert found["wgmma"] and found["tma"] and found["wait_one"]
    assert found["exp_under_pv"] and all(found["exp_under_pv"]), found["exp_under_pv"]
    assert found["byte_permutes"] == 0, found["byte_permutes"]
    assert any("0 bytes spill stores" in line for line in found["ptxas"]), found["ptxas"]


#: Bounds on spill stores (bytes a thread, ptxas on sm_90a, bf16) of the modified Gluon
#: backward kernels that spill plain too, or nearly: (kernel, streamed tile, head dim).
#: Measured: dK/dV on 64-row steps at D128 236 plain, 292 packed (the row-masked stores'
#: bases and N_K beside dK and dV), 192 capped, 284 with everything; dK/dV on 128-row steps
#: at D64 84-96 plain, 24-48 modified; dQ on 128-key tiles at D128 0 plain and packed, 12
#: with everything. Every other kernel here spills nothing, plain or modified.
_SPILL_BOUNDS = {("dkdv", 64, 128): 300, ("dkdv", 128, 64): 96, ("dq", 128, 128): 16}
_FA3_BWD_COMPILED = [
    ("dkdv", BwdVariant(64, 128, 4, 2, fa3="both"), 128),
    ("dkdv", BwdVariant(64, 128, 4, 3, fa3="both"), 64),
    ("dkdv", BwdVariant(128, 128, 4, 2, fa3="both"), 64),
    ("dq", BwdVariant(64, 128, 4, 2, fa3="both"), 128),
    ("dq", BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64), 64),
    ("dq", BwdVariant(64, 128, 4, 2, fa3="both", dq_block_streamed=128), 128),
]
_FA3_BWD_MODS = {"varlen": {"varlen": True}, "softcap": {"softcap": True},
                 "all": {"varlen": True, "window": True, "softcap": True, "sinks": True}}


@pytest.mark.parametrize(("kernel", "variant", "d"), _FA3_BWD_COMPILED,
                         ids=lambda x: str(x).replace(" ", "-"))
@pytest.mark.parametrize(("name", "causal"), [("varlen", True), ("softcap", False),
                                              ("all", False), ("all", True)])
def test_modified_fa3_backward_compiles_for_hopper(kernel: str, variant: BwdVariant, d: int,
                                                   name: str, causal: bool) -> None:
    """The Gluon dK/dV and dQ kernels with the packed layout, softcap and window, compiled
    for sm90a (`gluon_compile`): warpgroup products with one left in flight, TMA, and
    spills within `_SPILL_BOUNDS` (none where the plain kernel has none, but for 12 bytes in
    the dQ kernel's 128-key tiles at D128 with every modifier)."""
    pytest.importorskip("triton.experimental.gluon")
    from flashgen.tune.gluon_compile import report_in_subprocess, spill_store_bytes

    hopper = flashgen.DeviceInfo("H-test", (9, 0), 132, 232448)
    problem = Problem(2, 16, 4, 4096, 4096, d, "bf16", causal, **_FA3_BWD_MODS[name])
    assert why_invalid_bwd(variant, problem, hopper) is None
    found = report_in_subprocess(variant, problem, kernel)
    assert found["wgmma"] and found["tma"] and found["setmaxnreg"] and found["wait_one"]
    assert found["shared"] <= hopper.shared_memory
    bound = _SPILL_BOUNDS.get((kernel, variant.streamed(kernel), d), 0)
    assert spill_store_bytes(found["ptxas"]) <= bound, found["ptxas"]


#: Packed lengths for the Gluon backward: empty and one-token sequences, lengths that are no
#: multiple of any tile, several tiles, queries longer and shorter than keys.
_LQ = [1, 700, 63, 129, 0, 512, 256, 17, 640, 2, 300, 64]
_LK = [3, 650, 63, 200, 5, 512, 1, 17, 700, 2, 300, 70]
_FA3_BWD_POINTS = [BwdVariant(64, 128, 4, 2, fa3="both"), BwdVariant(128, 128, 4, 2, fa3="both"),
                   BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64),
                   BwdVariant(64, 128, 4, 2, fa3="both", dq_block_streamed=128),
                   BwdVariant(64, 128, 4, 2, "atomic", "both"),
                   BwdVariant(64, 128, 4, 2, fa3="both", fused_delta=True),
                   BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=64, fused_delta=True),
                   BwdVariant(64, 128, 4, 2, "atomic", "both", smem_stats=True),
                   BwdVariant(64, 128, 4, 2, fa3="both", smem_stats=True),
                   BwdVariant(128, 128, 4, 2, fa3="both", smem_stats=True),
                   # D256 and D192 (split_d) in the modifier test: the wide dK/dV kernel
                   # (not packed)
                   BwdVariant(64, 64, 4, 2, fa3="both", fused_delta=True),
                   BwdVariant(64, 64, 4, 2, fa3="both", fused_delta=True, smem_stats=True)]


def _gluon_bwd_or_skip(bwd: BwdVariant, problem: Problem) -> None:
    from flashgen.kernels.hardware import device_info

    if not device_info("cuda").is_hopper:
        pytest.skip("the fa3 backward kernels are Gluon kernels for Hopper")
    if why_invalid_bwd(bwd, problem, "cuda") is not None:
        pytest.skip(f"{bwd} does not serve {problem}: {why_invalid_bwd(bwd, problem, 'cuda')}")


@pytest.mark.gpu
@pytest.mark.parametrize("bwd", _FA3_BWD_POINTS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_packed_fa3_backward_on_the_gpu(bwd: BwdVariant, causal: bool, d: int) -> None:
    """The Gluon dK/dV and dQ kernels on packed sequences (cross-attention, GQA 8:2): tiles
    that run into the next sequence must neither read its rows as theirs nor write them."""
    _gluon_bwd_or_skip(bwd, Problem(12, 8, 2, max(_LQ), max(_LK), d, "bf16", causal,
                                    varlen=True))
    _check_packed(_LQ, _LK, d, causal, bwd_variant=bwd)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softcap", "window", "all"])
@pytest.mark.parametrize("bwd", _FA3_BWD_POINTS, ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_modified_fa3_backward_on_the_gpu(name: str, bwd: BwdVariant, packed: bool,
                                          causal: bool) -> None:
    """The Gluon backward with softcap, a window, and all modifiers (sinks' gradient from
    the launcher), dense (1300 queries, 1500 keys, GQA 8:2) and packed, D128 and, for the
    128-row step, D64; for the 64-key programs D256 and D192 (the wide dK/dV kernel, dense
    only; D192 with split_d's products over the 256 tile's first 192 columns)."""
    dtype = torch.bfloat16
    wide = 192 if bwd.smem_stats else 256
    d = wide if bwd.block_owned == 64 else 64 if bwd.block_streamed == 128 else 128
    mods, extra = _sinks({**MODIFIERS[name], **({"window": (300, 40)} if name != "softcap"
                                                 else {})}, 8, dtype)
    if "softcap" in mods:
        mods["softcap"] = 20.0
    flags = {"softcap": "softcap" in mods, "window": "window" in mods, "sinks": bool(extra)}
    _gluon_bwd_or_skip(bwd, Problem(2, 8, 2, 1300, 1500, d, "bf16", causal, varlen=packed,
                                    **flags))
    if not packed:
        _check_dense_gqa(None, causal, mods, extra, d, dtype, seed=19, bwd_variant=bwd)
        return
    _check_packed([1, 900, 63, 300, 0, 17], [5, 900, 80, 290, 3, 17], d, causal, mods, extra,
                  bwd_variant=bwd)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(256, 0), (100, 37), (-1, 64)])
def test_window_bf16_on_the_gpu(window: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, h, 1500, 128, generator=gen).to("cuda", torch.bfloat16)
               .requires_grad_() for h in (8, 2, 2))
    _check(lambda q, k, v: flashgen.attention(q, k, v, window=window, softcap=20.0,
                                              return_lse=True),
           lambda q, k, v, dtype: reference.attention(q, k, v, False, None, dtype,
                                                      window=window, softcap=20.0),
           [q, k, v])


#: Compiles the modified fa2 forward and Triton backward kernels (JSON lines on stdin: kind,
#: kernel, variant, problem) for sm90 with Triton's own compiler, no GPU and no interpreter:
#: the interpreter is lenient where the compiler is not (early returns, pointer updates).
_SM90_COMPILE = """
import ast, importlib.util, json, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from flashgen.kernels.bwd_render import render_bwd
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import render
from flashgen.kernels.variant import Variant
FP32 = {"LSE", "DELTA", "SINKS"}
for line in sys.stdin:
    kind, kernel, variant, problem = json.loads(line)
    p = Problem.from_dict(problem)
    v = (Variant if kind == "fwd" else BwdVariant).from_dict(variant)
    src = render(v, p) if kind == "fwd" else render_bwd(kernel, v, p)
    name = "attn_fwd" if kind == "fwd" else f"attn_bwd_{kernel}"
    path = Path(tempfile.mkdtemp()) / "k.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("k", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name)
    atomic = kind == "bwd" and v.dq_mode == "atomic"
    sig = {}
    for arg in fn.arg_names:
        if arg in FP32 or (arg == "DQ" and atomic):
            sig[arg] = "*fp32"
        elif arg in ("CU_Q", "CU_K"):
            sig[arg] = "*i32"
        elif arg.isupper() and arg.isalpha() and len(arg) <= 2:
            sig[arg] = "*" + p.dtype
        elif arg in ("sm_scale", "SOFTCAP"):
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options(
        {"num_warps": v.num_warps, "num_stages": v.num_stages})
    try:
        triton.compile(triton.compiler.ASTSource(fn, sig, {}, {}), target=target,
                       options=options.__dict__)
        print("ok", flush=True)
    except Exception as exc:
        print("fail", type(exc).__name__, str(exc).splitlines()[-1][:200], flush=True)
"""


def test_modified_kernels_compile_for_hopper() -> None:
    import dataclasses
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    jobs = []
    for causal in (True,):  # each compile takes a second or two: the causal kind only
        p = Problem(2, 8, 2, 1024, 1024, 128, "bf16", causal, window=True, softcap=True,
                    sinks=True, varlen=True)
        for v in (Variant("fa2", 128, 64, 8, 2, warp_specialize=True),
                  Variant("fa2", 128, 128, 8, 2, programs_per_sm=2)):
            jobs.append(["fwd", "fwd", dataclasses.asdict(v), p.to_dict()])
        for b in (BwdVariant(64, 128, 8, 2), BwdVariant(32, 64, 4, 2, dq_mode="atomic")):
            for kernel in ("dkdv", "dq") if b.dq_mode == "separate" else ("dkdv",):
                jobs.append(["bwd", kernel, dataclasses.asdict(b), p.to_dict()])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, text=True,
                          input="".join(json.dumps(j) + "\n" for j in jobs),
                          capture_output=True, timeout=600)
    results = done.stdout.splitlines()
    assert len(results) == len(jobs), done.stderr[-2000:]
    failed = [(j[0], j[1], j[2], r) for j, r in zip(jobs, results, strict=True) if r != "ok"]
    assert not failed, failed


def test_fa1_takes_the_modifiers() -> None:
    mods, extra = _sinks(MODIFIERS["all"], 2, torch.float32)
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen).requires_grad_()
               for h, n in ((2, 29), (1, 40), (1, 40)))
    fa1 = Variant("fa1", 16, 16, 1, 1)
    _check(lambda q, k, v, s: flashgen.attention(q, k, v, causal=True, sinks=s, variant=fa1,
                                                 return_lse=True, **mods),
           lambda q, k, v, s, dtype: reference.attention(q, k, v, True, None, dtype, sinks=s,
                                                         **mods),
           [q, k, v, *extra])


def test_a_plain_problem_dict_is_unchanged_by_the_modifiers() -> None:
    """Rows, claims and baselines are matched by the problem's JSON: a plain problem's must
    be what it was before the modifiers existed; a modified one round-trips."""
    p = Problem(1, 2, 1, 64, 64, 16, "fp32", True)
    assert p.to_dict() == {"batch": 1, "heads_q": 2, "heads_kv": 1, "seq_q": 64, "seq_k": 64,
                           "head_dim": 16, "dtype": "fp32", "causal": True}
    q = p.with_(window=True, varlen=True)
    assert q.to_dict()["window"] and Problem.from_dict(q.to_dict()) == q


def test_explain_names_the_modifiers() -> None:
    q = torch.randn(1, 2, 8, 16)
    choice = flashgen.explain(q, q, q, causal=True, window=(2, -1), softcap=5.0)
    assert choice.variant.loop_order in ("fa1", "fa2") and not choice.variant.use_tma
    assert choice.backward is not None and choice.backward.variant.fa3 == "none"


def test_explain_answers_for_a_packed_call() -> None:
    """`explain` took no packing arguments, so what `attention_varlen` runs could not be
    asked; given them it answers for the packed call, checked as the call checks them."""
    q, k, v = _packed(LENGTHS, LENGTHS, 2, 1, 16, torch.float32)
    cu = torch.tensor([0, 5, 22, 23], dtype=torch.int32)
    choice = flashgen.explain(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              max_seqlen_q=17, max_seqlen_k=17)
    assert choice.variant.loop_order in ("fa1", "fa2") and choice.backward is not None
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flashgen.explain(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3,
                         max_seqlen_k=17)


@pytest.mark.parametrize("seed", [0, 2])
def test_fp32_softcap_passes_the_gate_near_zero_scores(seed: int) -> None:
    """fp32 kernels take `_cap_tanh`'s polynomial near 0: the exp form's ~1e-7 cancellation,
    times a cap of 30, put these causal cases past the gate (2.3e-6 and 3.5e-6 against
    bounds of 2.1e-6 and 3.1e-6) before it."""
    from flashgen.tune.check import compare, make_inputs

    q, k, v = make_inputs(1, 2, 2, 96, 96, 64, torch.float32, "cpu", seed=seed)
    out, lse = flashgen.attention(q, k, v, causal=True, softcap=30.0, return_lse=True)
    result = compare(out, q, k, v, True, None, lse, modifiers={"softcap": 30.0})
    assert result.ok and result.error < result.bound / 2, result


def _exp2_poly_coefficients() -> list[float]:
    """C1, C2, C3 of `_exp2_fma`, read from the template the kernels render."""
    from flashgen.kernels.resources import data_dir

    text = (data_dir("templates") / "_fa3_softmax.py.jinja").read_text()
    found = dict(re.findall(r"^_EXP2_C(\d): gl\.constexpr = gl\.constexpr\(([-0-9.e]+)\)",
                            text, re.M))
    return [float(found[str(i)]) for i in range(1, len(found) + 1)]


def _exp2_fma_emulated(x: torch.Tensor, coeffs: list[float]) -> torch.Tensor:
    """`_exp2_fma`'s fp32 steps on the CPU: clamp, floor as the round-down add of 1.5 x 2^23
    leaves it, Horner by FMAs (each an fp64 product and sum rounded once to fp32: a product
    of fp32 values is exact in fp64), then n << 23 added to the polynomial's bits."""
    x = x.float().clamp(min=-127.0)
    magic = 12582912.0
    r = torch.floor(x.double() + magic).float()
    f = x - (r - magic)
    p = torch.full_like(f, coeffs[-1])
    for c in [*coeffs[-2::-1], 1.0]:
        p = (p.double() * f.double() + c).float()
    return (p.view(torch.int32) + (r.view(torch.int32) << 23)).view(torch.float32)


def test_fa3_softcap_exp2_polynomial_is_within_1e4_of_exp2() -> None:
    """The capped fa3 kernels' FMA-pipe exp2 (half of each score tile's columns): relative
    error at most 1e-4 from -126 to 0 (P is rounded to bf16 after it, 2^-9), exactly 1 at 0
    (a row's max), exactly 0 for a masked score (-inf) and under 2^-126 below -126."""
    coeffs = _exp2_poly_coefficients()
    assert len(coeffs) == 3
    x = torch.cat([torch.linspace(-126.0, 0.0, 2_000_001),
                   -torch.logspace(-30, 0, 20001), torch.arange(-126.0, 0.5, 0.5)])
    got = _exp2_fma_emulated(x, coeffs).double()
    rel = (got / torch.exp2(x.double()) - 1.0).abs().max().item()
    assert rel <= 1e-4, rel
    assert rel >= 5e-5  # a degree-3 fit cannot do much better: the comparison is live
    special = _exp2_fma_emulated(torch.tensor([float("-inf"), -1000.0, 0.0, -127.0]), coeffs)
    assert special.tolist() == [0.0, 0.0, 1.0, 0.0]
    tail = _exp2_fma_emulated(torch.linspace(-127.0, -126.0, 1001), coeffs)
    assert (tail >= 0).all() and (tail <= 2.0**-126).all()


def _mufu_reports(variant: Variant, problem: Problem,
                  split: bool = True) -> tuple[dict, dict]:
    """`gluon_compile`'s reports of the capped kernel with the folded cap (and the exp2
    split, off by default but kept for A/Bs, where `split`) and as it rendered before both
    (both context flags off)."""
    from flashgen.tune.gluon_compile import report_in_subprocess

    return (report_in_subprocess(variant, problem, overrides={"mufu_split": split}),
            report_in_subprocess(variant, problem, overrides={"mufu_split": False,
                                                              "cap_fold": False}))


def test_fa3_softcap_folds_the_cap_into_one_multiply() -> None:
    """The capped fa3 kernel as it renders (the folded cap, exp2 all on MUFU): one FMUL a
    score instead of three, MUFU work as before, no spills."""
    problem = Problem(2, 16, 16, 4096, 4096, 128, "bf16", True, softcap=True)
    new, old = _mufu_reports(Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True),
                             problem, split=False)
    ops_new, ops_old = new["opcodes"], old["opcodes"]
    tanh = ops_old["MUFU.TANH"]
    assert ops_new["MUFU.TANH"] == tanh and ops_new["MUFU.EX2"] == ops_old["MUFU.EX2"]
    assert ops_old["FMUL"] - ops_new["FMUL"] >= 2 * tanh - tanh // 8, (ops_old, ops_new)
    assert any("0 bytes spill stores" in line for line in new["ptxas"]), new["ptxas"]


@pytest.mark.parametrize(("variant", "d", "causal", "sinks"), [
    (Variant("fa3", 128, 128, 4, 2), 128, True, False),
    (Variant("fa3", 128, 128, 8, 2), 64, False, False),
    (Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True), 128, True, True),
    (Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True), 64, False, False)],
    ids=str)
def test_fa3_softcap_moves_half_the_exp2_off_mufu(variant: Variant, d: int, causal: bool,
                                                  sinks: bool) -> None:
    """Capped fa3 kernels (16-bit) with the exp2 split (an A/B option, off by default: it
    lost on an H100) take half of each score tile's exp2 on the FMA pipes: the
    machine code's MUFU.EX2 drop by half of the score tiles' (the rows' rescale factors keep
    theirs), MUFU.TANH stay, the folded cap leaves one FMUL a score instead of three, and
    the split and join of the column pairs stay in registers (no shuffle, shared-memory
    access or byte permute added) without spills."""
    problem = Problem(2, 16, 16, 4096, 4096, d, "bf16", causal, softcap=True, sinks=sinks)
    new, old = _mufu_reports(variant, problem)
    ops_new, ops_old = new["opcodes"], old["opcodes"]
    tanh = ops_old["MUFU.TANH"]  # one a score of every softmax in the code
    assert ops_new["MUFU.TANH"] == tanh
    assert ops_old["MUFU.EX2"] - ops_new["MUFU.EX2"] == tanh // 2, (ops_old, ops_new)
    assert ops_old["FMUL"] - ops_new["FMUL"] >= 2 * tanh - tanh // 8, (ops_old, ops_new)
    for kind in ("SHFL.BFLY", "LDS", "STS", "BAR.SYNC.DEFER_BLOCKING"):
        assert ops_new.get(kind, 0) == ops_old.get(kind, 0), kind
    assert new["byte_permutes"] == old["byte_permutes"] == 0
    assert new["exp_under_pv"] == old["exp_under_pv"]
    assert any("0 bytes spill stores" in line for line in new["ptxas"]), new["ptxas"]


def test_fa3_softcap_structure_is_16_bit_and_capped_only() -> None:
    """The folded cap is rendered into 16-bit capped kernels only, and the exp2 split only
    when asked for (an A/B override); with both flags off the capped kernel is the one
    before them, and plain kernels never differ."""
    from flashgen.kernels.render import _templates, render_context, render_with

    v = Variant("fa3", 128, 128, 4, 2)
    capped = Problem(1, 2, 2, 256, 256, 128, "bf16", True, softcap=True)
    for problem in (capped, capped.with_(dtype="fp16")):
        context = render_context(v, problem)
        assert not context["mufu_split"] and context["cap_fold"]
        source = render(v, problem)
        assert "def _exp2_halves(" not in source and "def _tanh_approx(" in source
        split = render_with(_templates(), v, problem, {"mufu_split": True})
        assert "def _exp2_halves(" in split
    for problem in (capped.with_(softcap=False), capped.with_(dtype="fp32")):
        context = render_context(v, problem)
        assert not context["mufu_split"] and not context["cap_fold"]
    before = render_with(_templates(), v, capped, {"mufu_split": False, "cap_fold": False})
    assert "def _exp2_halves(" not in before and "SOFTCAP * _cap_tanh(" in before


def test_the_reference_takes_a_packing_without_queries() -> None:
    """Every sequence without queries: (0, Hq, Dv) and (Hq, 0), as the kernels return (the
    oracle raised on its empty list of pieces); keys without queries change nothing."""
    none = torch.zeros(3, dtype=torch.int32)
    keys = torch.tensor([0, 4, 9], dtype=torch.int32)
    for ck, k in ((none, torch.randn(0, 2, 16)), (keys, torch.randn(9, 2, 16))):
        out, lse = reference.attention_varlen(torch.randn(0, 4, 16), k, torch.randn(len(k), 2, 8),
                                              none, ck, dtype=torch.float64)
        assert out.shape == (0, 4, 8) and out.dtype == torch.float64
        assert lse.shape == (4, 0) and lse.dtype == torch.float64
