"""Kernel launches that pay Triton's argument binding once per call signature.

`kernel[grid](*args)` through Triton's JIT specialises every argument on every call (about
25 us of host time a launch for kernels of ~30 arguments on an H100 host), which bounds
short calls such as a decode step. `bind(kernel)[grid](*args)` launches the same way the
first time, keeps the compiled kernel under a key of everything Triton specialises on, and
afterwards hands the arguments straight to the compiled kernel's launcher.

The key is at least as fine as Triton's specialisation: ints by their bits above 31, their
residue mod 16 and whether they are 1 (Triton: 32- or 64-bit, divisible by 16, 1 a
constant), bools apart from ints, tensors by dtype and 16-byte alignment, floats by type
(Triton never specialises a runtime float), TMA descriptors (Triton's and Gluon's host
ones) by dtype, tile, shared layout and padding, keyword arguments (constexprs and launch
options) by value, and the current device. So a cache that grows a key a step (a dynamic KV
cache) keeps hitting. An argument of any other type makes the call go through the JIT every
time, as does the Triton interpreter, whose launches return no compiled kernel.

A hit calls the compiled kernel's C launcher itself where nothing needs the compiled
kernel's per-call runner (no launch hooks registered, no scratch memory): the runner looks
up the device and stream, makes a closure and launch metadata, and sizes scratch on every
launch, a few microseconds a launch on an H100 host.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from triton import knobs

_Tensor = torch.Tensor

#: An argument type the key does not know: the launch is not cached.
_UNKNOWN = object()

#: Compiled kernels kept per `Bound` before it starts again (a guard: a launch site sees a
#: handful of signatures).
MAX_SIGNATURES = 256


def int_spec(value: int) -> int:
    """An int's part of the key, finer than what Triton specialises it on (its type by range,
    a 1 as a constant, divisibility by 16): the bits above 31 (0 or -1 for every 32-bit
    value), the residue mod 16, and whether it is 1, packed in one int."""
    return ((value >> 31) << 5) + ((value & 15) << 1) + (value == 1)


class Spec:
    """What Triton specialises a host TMA descriptor on (its type, dtype, tile, shared layout
    and padding), interned by `descriptor_spec`: equal specs are one object, which the key
    hashes by identity (a Gluon layout hashes in Python, ~0.5 us a launch per descriptor)."""

    __slots__ = ("value",)

    def __init__(self, value: tuple) -> None:
        self.value = value


#: Interned `Spec`s by value.
_SPECS: dict[tuple, Spec] = {}
#: The attribute a descriptor may carry its `Spec` in (`forward`'s descriptors do); others are
#: keyed field by field.
SPEC_ATTR = "_flashgen_spec"


def descriptor_spec(kind: type, dtype: torch.dtype, block: tuple[int, ...], layout: Any,
                    padding: str) -> Spec:
    """The one `Spec` of these values; a descriptor that carries it under `SPEC_ATTR` must
    have exactly them (its type, base dtype, block shape, layout and padding)."""
    value = (kind, dtype, block, layout, padding)
    spec = _SPECS.get(value)
    if spec is None:  # setdefault: two threads interning one value get one Spec
        spec = _SPECS.setdefault(value, Spec(value))
    return spec


def _spec(value: Any) -> Any:
    """The key's part for an argument `_key` does not handle itself (tensors, descriptors
    and plain ints it does)."""
    if type(value) is bool:  # apart from the ints 0 and 1, which Triton types otherwise
        return "true" if value else "false"
    if isinstance(value, int):
        return int_spec(value)
    if value is None:
        return None
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, float):
        return float
    return _UNKNOWN


class Bound:
    """A Triton JIT kernel whose launches skip the JIT's binding once a call signature has
    been seen (see the module's docstring)."""

    __slots__ = ("compiled", "defaults", "fn", "names", "positional")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = list(inspect.signature(fn.fn).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        # Arguments before the first constexpr: a constexpr passed by position would be keyed
        # by its pattern, not its value, so such launches are not cached.
        constexpr = [i for i, p in enumerate(getattr(fn, "params", []))
                     if getattr(p, "is_constexpr", False)]
        self.positional = constexpr[0] if constexpr else len(params)
        #: key -> (compiled kernel, its direct launch or None, the parameters after the
        #: positional arguments)
        self.compiled: dict[tuple, tuple[Any, tuple | None, tuple]] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        key = _key(args, kwargs) if len(args) <= self.positional else None
        hit = self.compiled.get(key) if key is not None else None
        if hit is not None:
            compiled, direct, rest = hit
            if direct is not None and hooks_idle():
                run, function, metadata, cooperative, pdl = direct
                g = (*grid, 1, 1)
                run(g[0], g[1], g[2], _stream(key[0]), function, cooperative, pdl, None, None,
                    metadata, None, None, None, *args, *rest)
            else:
                compiled[(*grid, 1, 1)[:3]](*args, *rest)
            return
        compiled = self.fn[grid](*args, **kwargs)
        if key is not None and hasattr(compiled, "packed_metadata") and all(
                n in kwargs or n in self.defaults for n in self.names[len(args):]):
            if len(self.compiled) >= MAX_SIGNATURES:
                self.compiled.clear()
            # The parameters after the positional ones (constexprs): the key holds the number
            # of positional arguments and the keyword ones by value, so a hit's are these.
            rest = tuple(kwargs[n] if n in kwargs else self.defaults[n]
                         for n in self.names[len(args):])
            self.compiled[key] = (compiled, _direct(compiled), rest)

    def direct(self, args: tuple, kwargs: dict[str, Any]) -> Callable[..., Any] | None:
        """The C launch of the kernel compiled for these arguments' signature, as a function
        of (gridX, gridY, gridZ, stream, *args) with the constexprs bound, or None where
        none is cached or it needs the runner (see `_direct`). For a caller whose own key
        already fixes the signature: its later launches skip this key. Pointers may then go
        as ints (the C launcher takes them so, and skips its pointer query); the caller
        checks `hooks_idle()` before each launch."""
        key = _key(args, kwargs) if len(args) <= self.positional else None
        hit = self.compiled.get(key) if key is not None else None
        if hit is None or hit[1] is None:
            return None
        (run, function, metadata, cooperative, pdl), rest = hit[1], hit[2]

        def go(g0: int, g1: int, g2: int, stream: int, *args: Any) -> None:
            run(g0, g1, g2, stream, function, cooperative, pdl, None, None, metadata, None,
                None, None, *args, *rest)

        return go


def _key(args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """The launch's key, the current device first (see the module's docstring), or None: an
    unknown type, or no GPU tensor (the JIT's path). One pass over the arguments: this runs
    on every launch (up to ~50 arguments), so the common types come first and names are
    local."""
    parts: list[Any] = []
    append = parts.append
    tensors = False
    for a in args:
        kind = type(a)
        if kind is int:  # most arguments: `int_spec` inline
            append(((a >> 31) << 5) + ((a & 15) << 1) + (a == 1))
        elif kind is _Tensor or isinstance(a, _Tensor):
            if not a.is_cuda:
                return None  # a CPU tensor is the interpreter's: nothing to cache
            append((a.dtype, a.data_ptr() % 16 == 0))
            tensors = True
        elif kind is float:  # Triton never specialises a runtime float
            append(float)
        elif kind.__name__ == "TensorDescriptor":  # Triton's or Gluon's host descriptor
            base = a.base
            if not base.is_cuda:
                return None
            # What Triton specialises a descriptor on: dtype, tile and shared layout (its
            # base's alignment, shape and strides go to the launcher as values).
            spec = a.__dict__.get(SPEC_ATTR)
            append(spec if spec is not None else (
                kind, base.dtype, tuple(a.block_shape), getattr(a, "layout", None),
                a.padding))
            tensors = True
        else:
            spec = _spec(a)
            if spec is _UNKNOWN:
                return None
            append(spec)
    if not tensors:
        return None
    # Keyword arguments are constexprs and launch options: by value (floats included).
    named = tuple(kwargs.items())
    try:
        hash(named)
    except TypeError:
        return None
    device, debug, mode = launch_context()
    return (device, tuple(parts), named, debug, mode)


def launch_context() -> tuple[int, Any, Any]:
    """What a launch's compiled kernel depends on besides its arguments: the current device
    and, as in Triton's own key, its debug and instrumentation modes (a profiler such as
    proton sets the latter, and its kernels then need profile scratch)."""
    return (torch.cuda.current_device(), knobs.runtime.debug,
            knobs.compilation.instrumentation_mode)


def _direct(compiled: Any) -> tuple | None:
    """(C launcher, function, packed metadata, cooperative, pdl) of a compiled kernel that
    needs no scratch memory, else None (its runner sizes scratch per launch). Read from
    Triton's launcher (3.6); another layout leaves the runner in charge. A launcher that
    takes TMA descriptors encodes them through `descriptor_launch`'s cache."""
    try:
        launcher = compiled.run  # loads the kernel on first use
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        return (descriptor_launch(launcher.launch) or launcher.launch, compiled.function,
                compiled.packed_metadata, launcher.launch_cooperative_grid,
                launcher.launch_pdl)
    except AttributeError:
        return None


#: Encoded TMA descriptor arguments by everything their encoding reads (the base address,
#: shape, strides, padding and the kernel's descriptor metadata); cleared when full.
_ENCODED: dict[tuple, tuple] = {}
ENCODED_KEPT = 4096


def descriptor_launch(launch: Callable[..., Any]) -> Callable[..., Any] | None:
    """The same launch as `launch`, Triton's wrapper (`inner`, 3.6) around the C launcher of
    a kernel with TMA descriptor arguments, with each descriptor's encoding cached; None
    where `launch` is not that wrapper or a descriptor has no metadata.

    The wrapper encodes every descriptor on every launch (`make_tensordesc_arg`: a
    cuTensorMapEncodeTiled call and Python around it, a few microseconds each, nine a
    backward). The encoding is a pure function of the key kept here, so an address the
    caching allocator hands out again with the same shape and strides reuses it."""
    code = getattr(launch, "__code__", None)
    if code is None or code.co_name != "inner" or not launch.__closure__:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__),
                     strict=True))
    try:
        raw, indices, metas = (cells["launcher"], cells["tensordesc_indices"],
                               cells["tensordesc_meta"])
        from triton.backends.nvidia import driver

        base, encode = driver._BASE_ARGS_FORMAT_LEN, driver.make_tensordesc_arg
        # The wrapper gives the k-th descriptor (in argument order) the k-th metadata.
        plan = tuple((base + i, meta, (meta["swizzle"], meta["elem_size"], meta["elem_type"],
                                       tuple(meta["block_size"]), meta["fp4_padded"]))
                     for i, meta in zip(sorted(indices), metas, strict=True))
    except (KeyError, TypeError, ValueError, AttributeError, ImportError):
        return None

    def run(*args: Any) -> Any:
        final: list[Any] = []
        start = 0
        for at, meta, spec in plan:
            d = args[at]
            final += args[start:at]
            key = (d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding, spec)
            encoded = _ENCODED.get(key)
            if encoded is None:
                encoded = tuple(encode(d, meta))
                if len(_ENCODED) >= ENCODED_KEPT:
                    _ENCODED.clear()
                _ENCODED[key] = encoded
            final += encoded
            start = at + 1
        final += args[start:]
        return raw(*final)

    return run


def hooks_idle() -> bool:
    """No launch hook registered (a profiler such as proton adds them): the direct launch
    passes none."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    # Asked on every launch: spelt out, no generator.
    return ((enter is None or not getattr(enter, "calls", True))
            and (leave is None or not getattr(leave, "calls", True)))


def _stream(device: int) -> int:
    """The current CUDA stream of `device`, as Triton's runner asks for it."""
    return torch._C._cuda_getCurrentRawStream(device)


def bind(kernel: Any) -> Any:
    """`kernel` (a Triton JIT function) as a `Bound` launcher; anything else (an exported
    package's loaded cubin, the interpreter's function) as it is."""
    if hasattr(kernel, "fn") and hasattr(kernel, "run") and not isinstance(kernel, Bound):
        try:
            return Bound(kernel)
        except (TypeError, ValueError):
            return kernel
    return kernel
