"""The forward and backward search spaces behind one interface, looked up by tuning mode.

The tuner, the database and dispatch treat both passes alike: a frozen variant dataclass, the
list of valid points, the named-rule check and the hand-picked default. This table is the one
place that says which functions those are for each mode in `tuning_key.MODES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from flashgen.kernels.bwd_render import bwd_kernel_hash
from flashgen.kernels.bwd_space import (
    bwd_portfolio,
    bwd_search_space,
    default_bwd_variant,
    why_invalid_bwd,
)
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.decode_render import decode_kernel_hash
from flashgen.kernels.decode_space import (
    decode_portfolio,
    decode_search_space,
    default_decode_variant,
    why_invalid_decode,
)
from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.fwd_space import (
    default_variant,
    portfolio,
    search_space,
    why_invalid,
)
from flashgen.kernels.hardware import DeviceInfo
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import kernel_hash
from flashgen.kernels.variant import Variant

#: A point of either space.
AnyVariant = Variant | BwdVariant | DecodeVariant
V = TypeVar("V", Variant, BwdVariant, DecodeVariant)


@dataclass(frozen=True)
class ModeSpace(Generic[V]):
    """What tuning and dispatch need to know about one mode's variants."""

    mode: str
    variant_type: type[V]
    points: Callable[[Problem, DeviceInfo], list[V]]
    why_invalid: Callable[[V, Problem, DeviceInfo], str | None]
    default: Callable[[Problem, DeviceInfo], V]
    #: Points known to do well on this device kind, measured before the sampler's.
    portfolio: Callable[[Problem, DeviceInfo], list[V]]
    #: The code part of a stored row's key: the hash of the kernels a variant launches.
    kernel_hash: Callable[[V, Problem], str]
    #: Whether a variant gives bitwise-equal results run to run (`tune --deterministic`).
    deterministic: Callable[[V], bool]

    def from_json(self, text: str) -> V:
        return self.variant_type.from_json(text)


def _fwd_deterministic(variant: Variant) -> bool:
    """Every forward variant: each program owns its output rows and adds nothing atomically."""
    return True


def _bwd_deterministic(variant: BwdVariant) -> bool:
    return variant.deterministic


SPACES: dict[str, ModeSpace] = {
    "fwd": ModeSpace("fwd", Variant, search_space, why_invalid, default_variant, portfolio,
                     kernel_hash, _fwd_deterministic),
    "bwd": ModeSpace("bwd", BwdVariant, bwd_search_space, why_invalid_bwd, default_bwd_variant,
                     bwd_portfolio, bwd_kernel_hash, _bwd_deterministic),
    # Decode problems are `DecodeProblem`s (a page size besides a Problem's fields).
    "decode": ModeSpace("decode", DecodeVariant, decode_search_space, why_invalid_decode,
                        default_decode_variant, decode_portfolio, decode_kernel_hash,
                        _fwd_deterministic),
}


def space_of(mode: str) -> ModeSpace:
    """The search space of `mode` ("fwd", "bwd" or "decode"); anything else is a ValueError."""
    try:
        return SPACES[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; use one of {tuple(SPACES)}") from None
