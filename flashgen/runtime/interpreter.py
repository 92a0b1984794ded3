"""Where Triton's CPU interpreter differs from the GPU, and how calls on it are kept honest.

The interpreter (TRITON_INTERPRET=1) runs the same kernels on CPU tensors. Two of its
failures reach users rather than flashgen's tests: it rounds fp32 to e4m3 wrongly where the
rounding carries into the exponent, and it cannot run kernels at all when triton was
imported before the variable was set (its standard library was then built for the GPU).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: The largest finite e4m3 value: the GPU's conversion (cvt.rn.satfinite) clamps to it.
E4M3_MAX = 448.0


def on_interpreter() -> bool:
    """Whether kernels run on Triton's CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_interpreter_ready() -> None:
    """A ValueError naming the cause where TRITON_INTERPRET=1 was set after triton was
    imported: Triton's own helpers were then built for the GPU, and every kernel fails deep
    in the interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel").
    Anything may have imported triton first (torch.compile's modules, transformers)."""
    standard = sys.modules.get("triton.language.standard")
    helper = getattr(standard, "zeros_like", None)
    if helper is not None and type(helper).__name__ == "JITFunction":
        raise ValueError(
            "TRITON_INTERPRET=1 was set after triton had been imported (perhaps by torch, "
            "transformers or another library), so Triton's CPU interpreter cannot run: set it "
            "before anything imports triton (in the shell, or first thing in the script)")


def _exact_e4m3(original: object) -> object:
    """Triton's fp32 -> fp8 conversion with the fp32 -> e4m3 case done as the GPU does it
    (round to nearest even, clamped to +-448); other conversions as before."""
    import triton.language as tl

    def convert(data: object, src: object, dst: object, rounding: object) -> object:
        if src == tl.float32 and dst == tl.float8e4nv:  # data: the interpreter's numpy array
            values = torch.as_tensor(data, dtype=torch.float32)
            values = values.clamp(-E4M3_MAX, E4M3_MAX)  # NaN stays NaN
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(data, src, dst, rounding)  # type: ignore[operator]

    return convert


@contextmanager
def exact_e4m3() -> Iterator[None]:
    """While open, the interpreter rounds fp32 to e4m3 as the GPU does.

    Triton 3.6's interpreter mishandles a rounding that carries into the exponent: 0.4872
    becomes 0.46875 instead of 0.5, 0.01535 becomes 0.01367 instead of 0.015625. An fp8
    kernel's P (rounded to e4m3 for its P V product) was then wrong in about 4% of entries,
    output rows off by up to 14%. A Triton without that function is left as it is."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        yield
        return
    interpreter._convert_float = _exact_e4m3(original)
    try:
        yield
    finally:
        interpreter._convert_float = original
