"""Kernel launches that pay Triton's argument binding once per call signature.

`kernel[grid](*args)` through Triton's JIT specialises every argument on every call (about
25 us of host time a launch for kernels of ~30 arguments on an H100 host), which bounds
short calls such as a decode step. `bind(kernel)[grid](*args)` launches the same way the
first time, keeps the compiled kernel under a key of everything Triton specialises on, and
afterwards hands the arguments straight to the compiled kernel's launcher.

The key is finer than Triton's specialisation: every int, bool and None argument by value,
every tensor by dtype and 16-byte alignment, floats by type (Triton never specialises them),
the keyword arguments (constexprs and launch options) by value, and the current device. An
argument of any other type (a TMA descriptor) makes the call go through the JIT every time,
as does the Triton interpreter, whose launches return no compiled kernel.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

#: An argument type the key does not know: the launch is not cached.
_UNKNOWN = object()


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # A CPU tensor is the interpreter's: nothing to cache (and no CUDA to ask).
        return (value.dtype, value.data_ptr() % 16 == 0) if value.is_cuda else _UNKNOWN
    if type(value) is bool:  # apart from the ints 0 and 1, which Triton types otherwise
        return "true" if value else "false"
    if value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return float
    return _UNKNOWN


class Bound:
    """A Triton JIT kernel whose launches skip the JIT's binding once a call signature has
    been seen (see the module's docstring)."""

    __slots__ = ("compiled", "defaults", "fn", "names")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = list(inspect.signature(fn.fn).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self.compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        key = self._key(args, kwargs)
        hit = self.compiled.get(key) if key is not None else None
        if hit is not None:
            rest = [kwargs[n] if n in kwargs else self.defaults[n]
                    for n in self.names[len(args):]]
            hit[(*grid, 1, 1)[:3]](*args, *rest)
            return
        compiled = self.fn[grid](*args, **kwargs)
        if key is not None and hasattr(compiled, "packed_metadata") and all(
                n in kwargs or n in self.defaults for n in self.names[len(args):]):
            self.compiled[key] = compiled

    @staticmethod
    def _key(args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        # Inline for the ints (most arguments are strides): this runs on every launch.
        parts = [a if type(a) is int else _spec(a) for a in args]
        if _UNKNOWN in parts or not any(type(p) is tuple for p in parts):
            return None  # an unknown type, or no (GPU) tensor: the JIT's path
        named = tuple([(name, _spec(value)) for name, value in kwargs.items()])
        if any(s is _UNKNOWN for _, s in named):
            return None
        return (torch.cuda.current_device(), tuple(parts), named)


def bind(kernel: Any) -> Any:
    """`kernel` (a Triton JIT function) as a `Bound` launcher; anything else (an exported
    package's loaded cubin, the interpreter's function) as it is."""
    if hasattr(kernel, "fn") and hasattr(kernel, "run") and not isinstance(kernel, Bound):
        try:
            return Bound(kernel)
        except (TypeError, ValueError):
            return kernel
    return kernel
