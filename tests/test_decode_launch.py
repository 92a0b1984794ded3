"""The decode family's fast launch (`kvcache.prepare_decode`): from a call layout's third
call on, both kernels go straight to Triton's C launcher with the addresses as ints. The
decode kernels are rendered for real (their signatures); fake compiled kernels log the C
launcher's arguments and CUDA-looking tensors stand in for the GPU, so the CPU checks that
a fast launch passes exactly what the general launch passed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_launch import cuda_looking

from flashgen import DecodeVariant
from flashgen.kernels.problem import DecodeProblem
from flashgen.runtime import kvcache, launch
from flashgen.serve import Dispatcher
from flashgen.tune.decode_bench import make_kvcache

STREAM = 77


class Launcher:
    """Triton 3.6's C launcher as a direct launch calls it: the call is logged."""

    launch_cooperative_grid = False
    launch_pdl = False
    global_scratch_size = 0
    profile_scratch_size = 0

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def launch(self, *args: Any) -> None:
        self.log.append((self.name, args))


class Compiled:
    function = 1234
    packed_metadata = (4, 1, 0)

    def __init__(self, log: list, name: str) -> None:
        self.run = Launcher(log, name)
        self.log = log

    def __getitem__(self, grid: tuple) -> Any:  # Triton's runner
        return lambda *args: self.log.append(("runner", args))


class Rendered:
    """A rendered kernel's signature, launched as the JIT would be (logged)."""

    def __init__(self, real: Any, log: list, name: str) -> None:
        self.fn, self.log, self.name = real.fn, log, name

    def run(self) -> None:  # a JIT function has one
        pass

    def __getitem__(self, grid: tuple) -> Any:
        def go(*args: Any, **kwargs: Any) -> Compiled:
            self.log.append(("jit", args))
            return Compiled(self.log, self.name)
        return go


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list:
    """Logged launches; scratch and counters CUDA-looking, one buffer each, as on a stream."""
    log: list = []
    names = iter(["split", "combine"])
    monkeypatch.setattr(kvcache, "bind",
                        lambda k: launch.Bound(Rendered(k, log, next(names))))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: STREAM,
                        raising=False)
    scratch = cuda_looking(torch.zeros(1 << 16))
    counters = cuda_looking(torch.zeros(1 << 10, dtype=torch.int32))
    monkeypatch.setattr(kvcache, "split_scratch", lambda n, device: scratch)
    monkeypatch.setattr(kvcache, "split_counters", lambda n, device: counters)
    return log


def _plan(problem: DecodeProblem, variant: DecodeVariant) -> Any:
    d = Dispatcher()
    p = problem
    shape = kvcache.DecodeShape(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim,
                                p.dtype, p.causal, p.page_size)
    return d._decode_prepared(shape, torch.device("cpu"), variant)


def _inputs(problem: DecodeProblem, seed: int = 0) -> tuple:
    c = make_kvcache(problem, "cpu", seed)
    table = None if c.block_table is None else cuda_looking(c.block_table)
    return cuda_looking(c.q), cuda_looking(c.k), cuda_looking(c.v), cuda_looking(c.seqlens), \
        table


def _c_calls(log: list, start: int) -> list:
    return [e for e in log[start:] if e[0] not in ("jit", "runner")]


@pytest.mark.parametrize("case", ["split", "fused", "paged", "one-split"])
def test_a_layouts_third_call_launches_what_the_general_launch_did(
        fake_gpu: list, case: str) -> None:
    """Call 1 compiles, call 2 launches through `launch.Bound` and records, call 3 is the fast
    launch: the same C-launcher arguments position by position, each tensor's address as an
    int (the new output's at the output's places), the inputs' own addresses, the scratch's
    offsets; and a call on other inputs of the layout passes their addresses."""
    log = fake_gpu
    page = 16 if case == "paged" else 0
    p = DecodeProblem(2, 4, 2, 1, 64, 16, "fp32", True, page_size=page)
    v = DecodeVariant(16, 16, 1 if case == "one-split" else 3, 1, 1,
                      fused_combine=case == "fused")
    run = _plan(p, v).launch
    inputs = _inputs(p)
    run(*inputs, 0.25, None, None, False)
    assert [e[0] for e in log] == ["jit"] * (1 if case in ("fused", "one-split") else 2)
    at = len(log)
    out2, _ = run(*inputs, 0.25, None, None, False)
    general = _c_calls(log, at)
    at = len(log)
    out3, lse3 = run(*inputs, 0.25, None, None, False)
    fast = _c_calls(log, at)
    _same_launches(general, fast, out2, out3)
    assert lse3.shape == (2, 4, 1)
    others = _inputs(p, seed=1)
    at = len(log)
    run(*others, 0.5, None, None, False)
    split = _c_calls(log, at)[0][1]
    ptrs = [t.data_ptr() if t is not None else None for t in others]
    assert list(split[13:18]) == ptrs and 0.5 in split


def test_new_layouts_and_unaligned_inputs_take_the_general_launch(fake_gpu: list) -> None:
    """A layout seen once launches through `launch.Bound` (tensors passed); a q at an address
    that is not 16-byte aligned never gets a fast launch, however often it comes."""
    log = fake_gpu
    p = DecodeProblem(2, 4, 2, 1, 64, 16, "fp32", True)
    run = _plan(p, DecodeVariant(16, 16, 3, 1, 1)).launch
    q, k, v, lens, _ = _inputs(p)
    for _ in range(3):
        run(q, k, v, lens, None, 0.25, None, None, False)
    wide = cuda_looking(torch.zeros(2 * 4 * 16 + 1))
    shifted = wide[1:].view(2, 4, 1, 16)  # 4 bytes past an aligned address
    assert shifted.data_ptr() % 16
    for _ in range(3):
        at = len(log)
        run(shifted, k, v, lens, None, 0.25, None, None, False)
        assert all(any(isinstance(a, torch.Tensor) for a in args)
                   for _, args in _c_calls(log, at))
    other = cuda_looking(torch.zeros(4, 2, 1, 16)).transpose(0, 1)  # another q layout
    at = len(log)
    run(other, k, v, lens, None, 0.25, None, None, False)
    assert all(any(isinstance(a, torch.Tensor) for a in args) for _, args in _c_calls(log, at))


def _same_launches(general: list, fast: list, out_general: torch.Tensor,
                   out_fast: torch.Tensor) -> None:
    """`fast` passes what `general` did, position by position, addresses as ints."""
    assert [e[0] for e in fast] == [e[0] for e in general] and fast
    for (_, want), (_, got) in zip(general, fast, strict=True):
        assert len(want) == len(got)
        for a, b in zip(want, got, strict=True):
            if isinstance(a, torch.Tensor):
                assert b == (out_fast.data_ptr() if a is out_general else a.data_ptr())
            else:
                assert not isinstance(b, torch.Tensor) and a == b


def test_a_growing_cache_keeps_its_fast_launch(fake_gpu: list,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A contiguous cache a few keys longer each call ((B, N, Hkv, D) memory viewed as
    (B, Hkv, N, D), as a dynamic cache grows) keeps one fast launch while its lengths and
    strides specialise alike (N a multiple of 16 here); the launch passes each call's own
    strides and capacity, as the general launch of the same inputs does. A length of
    another residue is a layout of its own: first seen, it takes the general launch."""
    log = fake_gpu
    p = DecodeProblem(2, 4, 2, 1, 64, 16, "fp32", True)
    run = _plan(p, DecodeVariant(16, 16, 3, 1, 1)).launch
    q, _, _, lens, _ = _inputs(p)

    def cache(n: int) -> torch.Tensor:
        return cuda_looking(torch.randn(2, n, 2, 16)).transpose(1, 2)

    for n in (64, 80):  # seen, then recorded
        run(q, cache(n), cache(n), lens, None, 0.25, None, None, False)
    k, v = cache(96), cache(96)
    at = len(log)
    out_fast, _ = run(q, k, v, lens, None, 0.25, None, None, False)
    fast = _c_calls(log, at)
    assert not any(isinstance(a, torch.Tensor) for _, args in fast for a in args)
    monkeypatch.setattr(kvcache, "hooks_idle", lambda: False)  # the general launch
    at = len(log)
    out_general, _ = run(q, k, v, lens, None, 0.25, None, None, False)
    _same_launches(_c_calls(log, at), fast, out_general, out_fast)
    assert 96 in fast[0][1] and 96 * 2 * 16 in fast[0][1]
    monkeypatch.setattr(kvcache, "hooks_idle", launch.hooks_idle)
    at = len(log)
    run(q, cache(72), cache(72), lens, None, 0.25, None, None, False)
    assert all(any(isinstance(a, torch.Tensor) for a in args) for _, args in _c_calls(log, at))


def test_a_layout_the_runner_must_launch_is_not_recorded_again(
        fake_gpu: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled kernel that needs Triton's runner (global scratch here) has no direct
    launch: its layout is marked for the general launch once, and later calls neither
    launch fast nor look for a direct launch again."""
    monkeypatch.setattr(Launcher, "global_scratch_size", 64)
    asked: list[int] = []
    direct = launch.Bound.direct
    monkeypatch.setattr(launch.Bound, "direct",
                        lambda self, *a: asked.append(1) or direct(self, *a))
    p = DecodeProblem(2, 4, 2, 1, 64, 16, "fp32", True)
    run = _plan(p, DecodeVariant(16, 16, 3, 1, 1)).launch
    inputs = _inputs(p)
    for _ in range(5):
        run(*inputs, 0.25, None, None, False)
    assert len(asked) == 1
    assert {e[0] for e in fake_gpu} == {"jit", "runner"}  # never the C launcher itself
