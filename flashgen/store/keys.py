"""The tuning key: everything a stored tuning result depends on.

A timing is only worth reusing on the same GPU model, with the same compiler (Triton) and the
same framework (torch), for a problem of the same kind, and only while the kernel it timed is
the one flashgen renders: that part is not in the key but in each row (its `kernel_hash`, see
`flashgen.store.current`), so a template edit retires exactly the rows whose kernel it changed.
"The same kind" is bucketed: dtype, causal, head dim and GQA ratio exactly, sequence lengths
by a ladder of powers of two and 1.5x between them (`seq_bucket`), so a handful of tuned lengths
covers every length a model sees, and an odd length (ViT's 257) is not keyed with one twice
its size, whose tiles may waste a third of its work.
Batch and head count are left out on purpose: they only change how many programs a launch has,
and the winners are served to every batch size.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import asdict, dataclass, fields
from typing import Any

from flashgen.kernels.hardware import DeviceInfo
from flashgen.kernels.problem import DecodeProblem, Problem

#: The passes tuned separately: the forward kernel, the backward kernels (a `BwdVariant`) and
#: the decode family (a `DecodeVariant` on a `DecodeProblem`).
MODES: tuple[str, ...] = ("fwd", "bwd", "decode")
#: Key fields only decode keys use; other modes' ids leave them out, so they are what they
#: were before decode existed.
DECODE_ONLY: tuple[str, ...] = ("page_size", "bh_bucket")
#: Key fields that ids and columns leave out where empty: plain problems' keys are what they
#: were before modified problems were tuned.
OMIT_EMPTY: tuple[str, ...] = ("modifiers",)


def pow2_bucket(n: int) -> int:
    """The next power of two of `n` (n itself if it is one): the batch x Hkv bucket of decode
    keys, and the lengths tile rules and default grids are given for."""
    if n < 1:
        raise ValueError(f"sequence length must be positive, got {n}")
    return 1 << (n - 1).bit_length()


def seq_bucket(n: int) -> int:
    """The sequence-length bucket of `n`: the smallest step of the ladder 1, 2, 3, 4, 6, 8,
    12, 16, 24, ... (powers of two and three quarters of each from 4 on) at or above `n`.
    Steps of 1.5x at most, where powers of two alone make steps of 2x."""
    top = pow2_bucket(n)
    three_quarters = top // 4 * 3
    return three_quarters if top >= 4 and n <= three_quarters else top


@functools.cache
def package_version(name: str) -> str:
    # Read from the installed metadata so the key is known without importing triton: the CLI
    # must not import it before it has chosen between the GPU and the interpreter.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Versions:
    """The software half of the key: a change in any of these makes old timings stale."""

    triton: str
    torch: str

    @classmethod
    def current(cls) -> Versions:
        """The running versions."""
        return cls(package_version("triton"), package_version("torch"))


@dataclass(frozen=True)
class TuningKey:
    """One row of the tuning table's key; `id` is its canonical string form."""

    mode: str
    device_key: str  # DeviceInfo.key: name, compute capability and SM count
    gpu_name: str
    capability: str  # "9.0"
    sm_count: int
    triton_version: str
    torch_version: str
    dtype: str
    causal: bool
    head_dim: int
    gqa: int  # query heads per key/value head
    seq_q_bucket: int
    seq_k_bucket: int
    # Decode keys: the cache's page size (0: contiguous) and the bucket of batch x Hkv (the
    # programs a split launches besides its splits: a winner at B 1 is not one at B 128).
    page_size: int = 0
    bh_bucket: int = 0
    # Modified and packed problems: `Problem.modifier_key` ("w", "k", "s", "v4", "wv2"...),
    # "" for plain attention.
    modifiers: str = ""

    @classmethod
    def for_problem(
        cls, problem: Problem, device: DeviceInfo, mode: str = "fwd",
        versions: Versions | None = None,
    ) -> TuningKey:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {MODES}")
        versions = versions or Versions.current()
        major, minor = device.capability
        return cls(
            mode=mode,
            device_key=device.key,
            gpu_name=device.name,
            capability=f"{major}.{minor}",
            sm_count=device.sm_count,
            triton_version=versions.triton,
            torch_version=versions.torch,
            dtype=problem.dtype,
            causal=problem.causal,
            head_dim=problem.head_dim,
            gqa=problem.group,
            seq_q_bucket=seq_bucket(problem.seq_q),
            seq_k_bucket=seq_bucket(problem.seq_k),
            **({"page_size": problem.page_size,
                "bh_bucket": pow2_bucket(problem.batch * problem.heads_kv)}
               if mode == "decode" and isinstance(problem, DecodeProblem) else {}),
            modifiers="" if mode == "decode" else problem.modifier_key,
        )

    def _kept(self, name: str, value: Any) -> bool:
        """Whether field `name` is part of this key's id and columns."""
        if name in DECODE_ONLY:
            return self.mode == "decode"
        return name not in OMIT_EMPTY or bool(value)

    @property
    def id(self) -> str:
        """Every field joined in a fixed order: equal keys give equal ids, and nothing else."""
        return "|".join(str(int(v) if isinstance(v, bool) else v)
                        for name, v in asdict(self).items() if self._kept(name, v))

    def to_columns(self) -> dict[str, Any]:
        """The key as database columns (booleans as 0/1, as SQLite stores them). Other modes
        leave the decode-only columns to their default, 0, and plain keys the modifiers to
        theirs, "", as files before them lacked them."""
        row = {k: v for k, v in asdict(self).items() if self._kept(k, v)}
        row["causal"] = int(self.causal)
        return row

    @classmethod
    def from_columns(cls, row: dict[str, Any]) -> TuningKey:
        values = {f.name: row[f.name] for f in fields(cls)
                  if f.name not in DECODE_ONLY + OMIT_EMPTY}
        values |= {name: row.get(name) or 0 for name in DECODE_ONLY}
        values |= {name: row.get(name) or "" for name in OMIT_EMPTY}
        values["causal"] = bool(values["causal"])
        return cls(**values)


#: The key's column names, in the order `id` joins them.
KEY_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(TuningKey))
