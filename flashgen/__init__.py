"""flashgen: generated, autotuned Triton flash-attention kernels."""

from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.fwd_space import default_variant, search_space, why_invalid
from flashgen.kernels.hardware import DeviceInfo, device_info
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import kernel_hash, render
from flashgen.kernels.variant import Variant
from flashgen.runtime.api import attention, explain
from flashgen.runtime.sdpa import scaled_dot_product_attention
from flashgen.runtime.table import Choice
from flashgen.serve import Dispatcher

__all__ = [
    "BwdVariant",
    "Choice",
    "DeviceInfo",
    "Dispatcher",
    "Problem",
    "Variant",
    "attention",
    "default_variant",
    "device_info",
    "explain",
    "kernel_hash",
    "render",
    "scaled_dot_product_attention",
    "search_space",
    "why_invalid",
]
__version__ = "0.1.0"
