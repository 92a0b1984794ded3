"""flashgen: generated, autotuned Triton flash-attention kernels."""

from flashgen.api import attention, explain
from flashgen.bwd_variant import BwdVariant
from flashgen.dispatch import Choice, Dispatcher
from flashgen.hardware import DeviceInfo, device_info
from flashgen.problem import Problem
from flashgen.render import render, template_hash
from flashgen.sdpa import scaled_dot_product_attention
from flashgen.space import default_variant, search_space, why_invalid
from flashgen.variant import Variant

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
    "render",
    "scaled_dot_product_attention",
    "search_space",
    "template_hash",
    "why_invalid",
]
__version__ = "0.1.0"
