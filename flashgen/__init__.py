"""flashgen: generated, autotuned Triton flash-attention kernels.

The public names are imported on first use (PEP 562), not with the package: `flashgen
--help` and `--version` run `flashgen.cli`, which lives in this package, and importing torch
and triton for them took seconds. Code that imports `flashgen.runtime` modules directly
imports `flashgen.serve` too (or any public name first): that is what plugs flashgen's
dispatcher into the runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flashgen.version import __version__ as __version__

#: Each public name and the module that defines it.
_PUBLIC: dict[str, str] = {
    "BwdVariant": "flashgen.kernels.bwd_variant",
    "Choice": "flashgen.runtime.table",
    "DecodeVariant": "flashgen.kernels.decode_variant",
    "DeviceInfo": "flashgen.kernels.hardware",
    "Dispatcher": "flashgen.serve",
    "Problem": "flashgen.kernels.problem",
    "Variant": "flashgen.kernels.variant",
    "attention": "flashgen.runtime.api",
    "attention_varlen": "flashgen.runtime.api",
    "attention_with_kvcache": "flashgen.runtime.api",
    "default_variant": "flashgen.kernels.fwd_space",
    "device_info": "flashgen.kernels.hardware",
    "explain": "flashgen.runtime.api",
    "reload": "flashgen.serve",
    "render": "flashgen.kernels.render",
    "scaled_dot_product_attention": "flashgen.runtime.sdpa",
    "kernel_hash": "flashgen.kernels.render",
    "search_space": "flashgen.kernels.fwd_space",
    "why_invalid": "flashgen.kernels.fwd_space",
}
#: Public submodules, imported on first use like the names (`flashgen.fp8.quantize`).
_SUBMODULES = frozenset({"fp8"})

__all__ = [
    "BwdVariant",
    "Choice",
    "DecodeVariant",
    "DeviceInfo",
    "Dispatcher",
    "Problem",
    "Variant",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "default_variant",
    "device_info",
    "explain",
    "fp8",
    "kernel_hash",
    "reload",
    "render",
    "scaled_dot_product_attention",
    "search_space",
    "why_invalid",
]

if TYPE_CHECKING:
    from flashgen import fp8 as fp8
    from flashgen.kernels.bwd_variant import BwdVariant
    from flashgen.kernels.decode_variant import DecodeVariant
    from flashgen.kernels.fwd_space import default_variant, search_space, why_invalid
    from flashgen.kernels.hardware import DeviceInfo, device_info
    from flashgen.kernels.problem import Problem
    from flashgen.kernels.render import kernel_hash, render
    from flashgen.kernels.variant import Variant
    from flashgen.runtime.api import attention, attention_varlen, attention_with_kvcache, explain
    from flashgen.runtime.sdpa import scaled_dot_product_attention
    from flashgen.runtime.table import Choice
    from flashgen.serve import Dispatcher, reload


def __getattr__(name: str) -> Any:
    """Import the module behind public name `name` on its first use, and keep the name.
    `flashgen.serve` comes first whatever the name: importing it makes flashgen's dispatcher
    the one behind `attention` and its torch.library op."""
    if name in _SUBMODULES:
        value = importlib.import_module(f"flashgen.{name}")
        globals()[name] = value
        return value
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'flashgen' has no attribute {name!r}")
    importlib.import_module("flashgen.serve")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBMODULES})
