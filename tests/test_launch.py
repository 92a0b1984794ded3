"""`runtime.launch.bind`: the JIT's binding paid once per call signature. A fake JIT function
and CUDA-looking tensors stand in for the GPU, so the CPU checks which launches go through
the JIT and which straight to the compiled kernel."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flashgen.runtime import launch


class CudaLooking(torch.Tensor):
    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def cuda_looking(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(CudaLooking, t)


class Compiled:
    packed_metadata = ()

    def __init__(self, log: list) -> None:
        self.log = log

    def __getitem__(self, grid: tuple) -> Any:
        return lambda *args: self.log.append(("direct", grid, args))


class FakeJit:
    def __init__(self) -> None:
        self.log: list = []

        def kernel(x, n, scale, flag, BLOCK, EXTRA=7):
            pass

        self.fn = kernel

    def run(self) -> None:  # a JIT function has one
        pass

    def __getitem__(self, grid: tuple) -> Any:
        def go(*args: Any, **kwargs: Any) -> Compiled:
            self.log.append(("jit", grid, args, kwargs))
            return Compiled(self.log)
        return go


@pytest.fixture(autouse=True)
def one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)


def test_second_launch_goes_straight_to_the_compiled_kernel() -> None:
    jit = FakeJit()
    bound = launch.bind(jit)
    x = cuda_looking(torch.zeros(64))
    bound[(4, 2)](x, 16, 0.5, True, BLOCK=32, num_warps=4)
    bound[(4, 2)](x, 16, 0.25, True, BLOCK=32, num_warps=4)  # a float changes nothing
    assert [e[0] for e in jit.log] == ["jit", "direct"]
    # The direct launch gets every parameter in order (the default of EXTRA included) and
    # a three-dimensional grid; options such as num_warps stay with the compiled kernel.
    assert jit.log[1][1] == (4, 2, 1) and jit.log[1][2][1:] == (16, 0.25, True, 32, 7)


def test_ints_of_one_kind_share_the_compiled_kernel() -> None:
    """A stride or length that changes within 32 bits and its residue mod 16 reuses the
    kernel (a dynamic KV cache grows a key a step: at most 16 signatures, then hits)."""
    jit = FakeJit()
    bound = launch.bind(jit)
    x = cuda_looking(torch.zeros(64))
    for n in (32, 48, 4096, 33, 49):
        bound[(1,)](x, n, 1.0, True, BLOCK=32)
    assert [e[0] for e in jit.log] == ["jit", "direct", "direct", "jit", "direct"]


@pytest.mark.parametrize("change", ["int", "int64", "one", "bool", "alignment", "constexpr",
                                    "option"])
def test_what_triton_specialises_on_goes_through_the_jit(change: str) -> None:
    jit = FakeJit()
    bound = launch.bind(jit)
    base = torch.zeros(64)
    x = cuda_looking(base)
    args: dict[str, Any] = {"x": x, "n": 16, "flag": True}
    kw: dict[str, Any] = {"BLOCK": 32, "num_warps": 4}
    bound[(1,)](args["x"], args["n"], 1.0, args["flag"], **kw)
    if change == "int":
        args["n"] = 17  # no longer divisible by 16
    elif change == "int64":
        args["n"] = 2**35  # past 32 bits
    elif change == "one":
        args["n"] = 1  # Triton makes a 1 a constant
    elif change == "bool":
        args["flag"] = 1  # an int 1 is not the bool True to Triton
    elif change == "alignment":
        args["x"] = cuda_looking(base[1:])  # 4 bytes past a 16-byte boundary
    elif change == "constexpr":
        kw["BLOCK"] = 64
    else:
        kw["num_warps"] = 8
    bound[(1,)](args["x"], args["n"], 1.0, args["flag"], **kw)
    assert [e[0] for e in jit.log] == ["jit", "jit"]


def test_cpu_tensors_and_unknown_arguments_are_never_cached() -> None:
    """The interpreter's CPU tensors, and an argument of a type the key does not know, take
    the JIT every time."""
    jit = FakeJit()
    bound = launch.bind(jit)
    for _ in range(2):
        bound[(1,)](torch.zeros(4), 1, 1.0, True, BLOCK=16)
        bound[(1,)](cuda_looking(torch.zeros(4)), object(), 1.0, True, BLOCK=16)
    assert [e[0] for e in jit.log] == ["jit"] * 4


def test_bind_leaves_other_launchers_alone() -> None:
    def loaded_cubin(*args: Any) -> None:  # no JIT function
        pass

    assert launch.bind(loaded_cubin) is loaded_cubin
    bound = launch.bind(FakeJit())
    assert launch.bind(bound) is bound


class Launcher:
    """Triton 3.6's C launcher as the direct launch calls it."""

    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self, log: list, scratch: int = 0) -> None:
        self.log = log
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0

    def launch(self, *args: Any) -> None:
        self.log.append(("c", args))


class CompiledWithLauncher(Compiled):
    function = 1234
    packed_metadata = (4, 1, 0)

    def __init__(self, log: list, scratch: int = 0) -> None:
        super().__init__(log)
        self.run = Launcher(log, scratch)


class FakeJitWithLauncher(FakeJit):
    def __init__(self, scratch: int = 0) -> None:
        super().__init__()
        self.scratch = scratch

    def __getitem__(self, grid: tuple) -> Any:
        def go(*args: Any, **kwargs: Any) -> Compiled:
            self.log.append(("jit", grid, args, kwargs))
            return CompiledWithLauncher(self.log, self.scratch)
        return go


@pytest.mark.parametrize("case", ["direct", "hook", "scratch"])
def test_a_hit_calls_the_c_launcher_where_nothing_needs_the_runner(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit hands the arguments to Triton's C launcher in its order (grid, stream, function,
    cooperative, pdl, no scratch, packed metadata, no launch metadata or hooks, then every
    parameter); a registered launch hook (a profiler) or scratch memory keeps the runner."""
    from triton import knobs

    monkeypatch.setattr(launch, "_stream", lambda device: 77)
    jit = FakeJitWithLauncher(scratch=64 if case == "scratch" else 0)
    bound = launch.bind(jit)
    x = cuda_looking(torch.zeros(64))
    hook = lambda metadata: None
    if case == "hook":
        knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(2):
            bound[(4, 2)](x, 16, 0.5, True, BLOCK=32)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    kinds = [e[0] for e in jit.log]
    if case == "direct":
        assert kinds == ["jit", "c"]
        assert jit.log[1][1] == (4, 2, 1, 77, 1234, False, False, None, None, (4, 1, 0), None,
                                 None, None, x, 16, 0.5, True, 32, 7)
    else:
        assert kinds == ["jit", "direct"]


class TensorDescriptor:
    """Named as Triton's and Gluon's host descriptors are (the key goes by the name)."""

    def __init__(self, base: torch.Tensor, block: list[int], layout: object = None) -> None:
        self.base, self.block_shape, self.layout, self.padding = base, block, layout, "zero"


@pytest.mark.parametrize("change", ["none", "shape", "block", "layout", "dtype"])
def test_descriptors_are_keyed_by_what_triton_specialises(change: str) -> None:
    """A TMA descriptor's dtype, tile and layout pick the compiled kernel; its tensor's shape
    and address are launch values (a longer sequence reuses the kernel)."""
    jit = FakeJit()
    bound = launch.bind(jit)
    base = cuda_looking(torch.zeros(4, 64, dtype=torch.bfloat16))
    bound[(1,)](TensorDescriptor(base, [16, 64], "swizzle128"), 16, 1.0, True, BLOCK=16)
    other = {
        "none": TensorDescriptor(base, [16, 64], "swizzle128"),
        "shape": TensorDescriptor(cuda_looking(torch.zeros(9, 64, dtype=torch.bfloat16)),
                                  [16, 64], "swizzle128"),
        "block": TensorDescriptor(base, [32, 64], "swizzle128"),
        "layout": TensorDescriptor(base, [16, 64], "swizzle64"),
        "dtype": TensorDescriptor(cuda_looking(torch.zeros(4, 64)), [16, 64], "swizzle128"),
    }[change]
    bound[(1,)](other, 16, 1.0, True, BLOCK=16)
    assert [e[0] for e in jit.log] == ["jit", "direct" if change in ("none", "shape") else "jit"]


def test_a_constexpr_passed_by_position_is_not_cached() -> None:
    """A constexpr's value picks the kernel, but by position it would be keyed like any int
    (its pattern): such launches take the JIT; by keyword they are keyed by value."""
    jit = FakeJit()
    jit.params = [type("P", (), {"is_constexpr": name in ("BLOCK", "EXTRA")})()
                  for name in ("x", "n", "scale", "flag", "BLOCK", "EXTRA")]
    bound = launch.bind(jit)
    x = cuda_looking(torch.zeros(64))
    for block in (32, 48, 32):
        bound[(1,)](x, 16, 1.0, True, block)
    assert [e[0] for e in jit.log] == ["jit"] * 3
    for block in (32, 32):
        bound[(1,)](x, 16, 1.0, True, BLOCK=block)
    assert [e[0] for e in jit.log][3:] == ["jit", "direct"]


def test_tritons_debug_and_instrumentation_modes_are_in_the_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton keys its kernels on its debug and instrumentation modes (a profiler sets the
    latter): a kernel cached under one is not launched under the other."""
    from triton import knobs

    jit = FakeJit()
    bound = launch.bind(jit)
    x = cuda_looking(torch.zeros(64))
    bound[(1,)](x, 16, 1.0, True, BLOCK=32)
    monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "fpsan")
    bound[(1,)](x, 16, 1.0, True, BLOCK=32)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    bound[(1,)](x, 16, 1.0, True, BLOCK=32)
    assert [e[0] for e in jit.log] == ["jit", "jit", "jit"]


def test_forward_descriptors_are_keyed_by_their_interned_spec() -> None:
    """The runtime's descriptors carry their key part (`launch.descriptor_spec`, one object
    per dtype, tile, layout and padding): the same kind of descriptor over another tensor or
    length hits, another dtype or tile goes through the JIT."""
    from flashgen.runtime.forward import descriptor

    jit = FakeJit()
    bound = launch.bind(jit)
    a = cuda_looking(torch.zeros(2, 4, 64, 64, dtype=torch.float16))
    longer = cuda_looking(torch.zeros(2, 4, 128, 64, dtype=torch.float16))
    wide = cuda_looking(torch.zeros(2, 4, 64, 64))
    for t, rows in ((a, 16), (longer, 16), (wide, 16), (a, 32), (a, 16), (wide, 16)):
        bound[(1,)](descriptor(t, rows, 64), 16, 1.0, True, BLOCK=16)
    assert [e[0] for e in jit.log] == ["jit", "direct", "jit", "jit", "direct", "direct"]
    spec = getattr(descriptor(a, 16, 64), launch.SPEC_ATTR)
    assert spec is getattr(descriptor(longer, 16, 64), launch.SPEC_ATTR)
    assert spec.value[1:] == (torch.float16, (1, 1, 16, 64), None, "zero")


class Desc:
    """Looks like a host TMA descriptor to Triton's wrapper: base, shape, strides, padding."""

    def __init__(self, ptr: int, shape: list[int], strides: list[int]) -> None:
        self.base = type("Base", (), {"data_ptr": lambda _self, p=ptr: p})()
        self.shape, self.strides, self.padding = shape, strides, "zero"


def test_descriptor_arguments_encode_once_per_address_and_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's wrapper encodes every TMA descriptor on every launch; `descriptor_launch`
    passes the C launcher the very arguments the wrapper would, encoding a descriptor again
    only where its address, shape, strides or the kernel's metadata differ."""
    from triton.backends.nvidia import driver

    encoded: list[int] = []

    def encode(arg: Desc, meta: dict) -> list:
        encoded.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), meta["swizzle"], *arg.shape), *arg.shape,
                *arg.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    calls: list[tuple] = []
    signature = {"a": "*bf16", "d0": "tensordesc<bf16[64, 64]>", "n": "i32",
                 "d1": "tensordesc<bf16[128, 64]>", "s": "fp32"}
    metas = [{"swizzle": 128, "elem_size": 2, "elem_type": 10, "block_size": [64, 64],
              "fp4_padded": False},
             {"swizzle": 64, "elem_size": 2, "elem_type": 10, "block_size": [128, 64],
              "fp4_padded": False}]
    inner = driver.wrap_handle_tensordesc(lambda *a: calls.append(a), signature, metas)
    fast = launch.descriptor_launch(inner)
    assert fast is not None
    base = tuple(range(driver._BASE_ARGS_FORMAT_LEN))

    def both(*kernel_args: Any) -> list[int]:
        """The wrapper's and the cached launch's arguments agree; the addresses the cached
        one encoded."""
        inner(*base, *kernel_args)
        before = len(encoded)
        fast(*base, *kernel_args)
        assert calls[-1] == calls[-2]
        return encoded[before:]

    d0, d1 = Desc(4096, [2, 8, 64], [512, 64, 1]), Desc(8192, [2, 8, 64], [512, 64, 1])
    assert both("ptr", d0, 5, d1, 0.5) == [4096, 8192]
    # Same addresses and layouts, other tensors and values: nothing encoded again.
    assert both("ptr", Desc(4096, [2, 8, 64], [512, 64, 1]), 6, d1, 0.25) == []
    assert both("ptr", Desc(4160, [2, 8, 64], [512, 64, 1]), 5, d1, 0.5) == [4160]
    assert both("ptr", d0, 5, Desc(8192, [2, 9, 64], [576, 64, 1]), 0.5) == [8192]  # shape
    assert both("ptr", d0, 5, Desc(8192, [2, 8, 64], [1024, 64, 1]), 0.5) == [8192]  # strides
    assert launch.descriptor_launch(lambda *a: None) is None  # not Triton's wrapper
    assert launch.descriptor_launch(driver.wrap_handle_tensordesc(
        lambda *a: None, signature, None)) is None  # descriptors without metadata
