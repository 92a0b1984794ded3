"""Load and launch a `flashgen export --format aot` cubin through the CUDA driver API.

Standard library only (ctypes and libcuda.so.1): no Triton and no torch, so it shows exactly
what a C/C++ host does with the manifest, and Python hosts can use it as is. flashgen copies
this file into every AOT export as `cuda_loader.py`.

    kernel = Kernel.load(export_dir, kernel_id)
    kernel.launch(kernel.grid(B=b, N_Q=nq, H_Q=hq), {"Q": q_ptr, ..., "GROUP": g}, stream)

Arguments go by the names of the kernel's manifest `arguments`, whatever its argument list
(`abi`): an fp8 kernel ("fwd_fp8") also takes DQ, DK, DV (descale pointers) and their
strides, and no stride_vn (V keys-inner, compiled in as 1).

`launch` checks the promises the binary was compiled under (aligned pointers, arguments
divisible by 16, compiled-in values, 32-bit integers) and raises ValueError on a broken one
instead of computing garbage.
"""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES in cuda.h.
_MAX_DYNAMIC_SHARED = 8
#: Static shared memory a kernel may use without opting in.
_DEFAULT_SHARED = 49152
_INT_TYPES = {"i32": (ctypes.c_int32, 31), "i64": (ctypes.c_int64, 63)}


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and CUDA's error string."""


_lib: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
        _lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _lib.cuModuleGetFunction.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p]
        _lib.cuModuleLoadData.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        _lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        _lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        _lib.cuModuleUnload.argtypes = [ctypes.c_void_p]
        _lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        _lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        _lib.cuLaunchKernel.argtypes = [
            ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
        ]
        _check(_lib.cuInit(0), "cuInit")
    return _lib


def _check(result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(result, ctypes.byref(text))
        message = text.value.decode() if text.value else "unknown error"
        raise CudaError(f"{call} failed with CUDA error {result}: {message}")


def _ensure_context(device: int) -> None:
    """Use the current context (torch's, if torch made one), else the device's primary one."""
    lib = _cuda()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _value(expr: str, values: Mapping[str, int]) -> int:
    return int(expr) if expr.isdigit() else int(values[expr])


def grid_dim(expr: str, values: Mapping[str, int]) -> int:
    """Evaluate one manifest grid expression: `N`, `NAME`, `cdiv(A, B)` or `A * B`."""
    if m := re.fullmatch(r"cdiv\((\w+), (\w+)\)", expr):
        a, b = _value(m[1], values), _value(m[2], values)
        return -(-a // b)
    if m := re.fullmatch(r"(\w+) \* (\w+)", expr):
        return _value(m[1], values) * _value(m[2], values)
    return _value(expr, values)


def check_args(entry: Mapping[str, Any], args: Mapping[str, int | float]) -> None:
    """Raise ValueError if `args` break a promise the binary was compiled under."""
    for name, fixed in entry["constexprs"].items():
        if name in args and args[name] != fixed:
            raise ValueError(f"{name} is compiled in as {fixed}, got {args[name]}")
    for a in entry["arguments"]:
        name, kind = a["name"], a["type"]
        if name not in args:
            raise ValueError(f"argument {name} is missing")
        value = args[name]
        if kind.startswith("*") and int(value) % a["align"]:
            raise ValueError(f"{name} pointer {value:#x} is not {a['align']}-byte aligned")
        bits = _INT_TYPES[kind][1] if kind in _INT_TYPES else None
        if bits is not None and not -(2**bits) <= value < 2**bits:
            raise ValueError(f"{name} = {value} does not fit {kind}")
        if "divisible_by" in a and int(value) % a["divisible_by"]:
            raise ValueError(f"{name} = {value} must be a multiple of {a['divisible_by']}")


def pack_args(entry: Mapping[str, Any], args: Mapping[str, int | float]) -> list[Any]:
    """The ctypes values of the manifest `arguments`, in kernelParams order (no scratch):
    pointers (any `*type`, fp8 and the fp32 descales included) as 8-byte addresses."""
    values: list[Any] = []
    for a in entry["arguments"]:
        kind, value = a["type"], args[a["name"]]
        if kind.startswith("*"):
            values.append(ctypes.c_uint64(int(value)))
        elif kind in _INT_TYPES:
            values.append(_INT_TYPES[kind][0](int(value)))
        elif kind == "fp32":
            values.append(ctypes.c_float(float(value)))
        else:
            raise ValueError(f"argument {a['name']} has unsupported type {kind}")
    return values


class Kernel:
    """One loaded cubin of an AOT export, described by its manifest entry."""

    def __init__(self, root: str | Path, entry: Mapping[str, Any], device: int = 0) -> None:
        self.entry = dict(entry)
        self._scratch_ptr, self._scratch_size = 0, 0
        _ensure_context(device)
        lib = _cuda()
        image = (Path(root) / entry["cubin"]).read_bytes()
        self._module = ctypes.c_void_p()
        _check(lib.cuModuleLoadData(ctypes.byref(self._module), image), "cuModuleLoadData")
        self._function = ctypes.c_void_p()
        _check(lib.cuModuleGetFunction(ctypes.byref(self._function), self._module,
                                       entry["kernel_name"].encode()), "cuModuleGetFunction")
        if entry["shared_bytes"] > _DEFAULT_SHARED:
            # Above 48 KiB a kernel must opt in to dynamic shared memory, once per function.
            _check(lib.cuFuncSetAttribute(self._function, _MAX_DYNAMIC_SHARED,
                                          entry["shared_bytes"]), "cuFuncSetAttribute")

    @classmethod
    def load(cls, root: str | Path, kernel_id: str, device: int = 0) -> Kernel:
        entry = json.loads((Path(root) / "kernels" / f"{kernel_id}.json").read_text())
        return cls(root, entry, device)

    def grid(self, **values: int) -> tuple[int, int, int]:
        """The launch grid for runtime sizes (B, N_Q, H_Q, ...), by the manifest's rule."""
        x, y, z = (grid_dim(e, values) for e in self.entry["grid"])
        return x, y, z

    def check(self, args: Mapping[str, int | float]) -> None:
        check_args(self.entry, args)

    def launch(self, grid: tuple[int, int, int], args: Mapping[str, int | float],
               stream: int = 0) -> None:
        """Launch on `stream` (a CUstream handle; 0 is the legacy default stream)."""
        self.check(args)
        e = self.entry
        if e["profile_scratch_bytes"]:
            raise CudaError(f"{e['id']} was compiled with profiling instrumentation")
        values = pack_args(e, args)
        scratch = self._scratch(grid[0] * grid[1] * grid[2] * e["num_ctas"]
                                * e["global_scratch_bytes"])
        values += [ctypes.c_uint64(scratch), ctypes.c_uint64(0)]  # global, profile scratch
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        _check(_cuda().cuLaunchKernel(
            self._function, *grid, *e["block"], e["shared_bytes"], ctypes.c_void_p(stream),
            params, None), "cuLaunchKernel")

    def _scratch(self, size: int) -> int:
        """Device memory for the kernel's global scratch (0 when it needs none), kept and
        grown across launches. cuMemAlloc aligns to 256 bytes, more than Triton asks."""
        if size > self._scratch_size:
            self._free_scratch()
            ptr = ctypes.c_uint64()
            _check(_cuda().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)),
                   "cuMemAlloc")
            self._scratch_ptr, self._scratch_size = ptr.value, size
        return self._scratch_ptr

    def _free_scratch(self) -> None:
        if self._scratch_ptr:
            _check(_cuda().cuMemFree_v2(ctypes.c_uint64(self._scratch_ptr)), "cuMemFree")
            self._scratch_ptr, self._scratch_size = 0, 0

    def unload(self) -> None:
        """Free the scratch memory and unload the module (after its launches finished)."""
        self._free_scratch()
        if self._module.value:
            _check(_cuda().cuModuleUnload(self._module), "cuModuleUnload")
            self._module = ctypes.c_void_p()
