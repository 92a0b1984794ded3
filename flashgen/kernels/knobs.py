"""The dict/JSON round trip that every variant dataclass (forward and backward) shares."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any, ClassVar, TypeVar

K = TypeVar("K", bound="Knobs")


class Knobs:
    """Mixin for frozen dataclasses of kernel knobs: plain dicts and JSON in and out.

    Unknown keys are an error, so a typo in a stored or hand-written variant never silently
    tunes or runs something else; missing keys take the field defaults, so rows stored before
    a knob existed still load.
    """

    #: How error messages name this kind of variant.
    kind = "variant"
    #: Former knob names and their new ones, so a hand-written variant that uses one is told
    #: what it is called now (stored rows are rewritten by migration m009_knob_names).
    renamed: ClassVar[dict[str, str]] = {}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls: type[K], data: dict[str, Any]) -> K:
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - known
        old = sorted(unknown & set(cls.renamed))
        if old:
            raise ValueError(f"{cls.kind} parameter {old[0]!r} is now called "
                             f"{cls.renamed[old[0]]!r}")
        if unknown:
            raise ValueError(
                f"unknown {cls.kind} parameters {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def from_json(cls: type[K], text: str) -> K:
        return cls.from_dict(json.loads(text))
