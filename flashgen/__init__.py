"""flashgen: generated, autotuned Triton flash-attention kernels."""

from flashgen.api import attention
from flashgen.hardware import DeviceInfo, device_info
from flashgen.problem import Problem
from flashgen.render import render, template_hash
from flashgen.space import default_variant, search_space, why_invalid
from flashgen.variant import Variant

__all__ = [
    "DeviceInfo",
    "Problem",
    "Variant",
    "attention",
    "default_variant",
    "device_info",
    "render",
    "search_space",
    "template_hash",
    "why_invalid",
]
__version__ = "0.1.0"
