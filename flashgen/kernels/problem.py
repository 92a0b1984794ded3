"""What an attention call asks for, independent of how a kernel computes it.

A `Problem` is the key that variants are searched, checked and cached for. It is built from
tensors by `Problem.from_tensors` and from the CLI's `--shape` strings by `Problem.parse`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

#: dtypes the kernels accept, by the short names the CLI and the database use. fp8 is e4m3
#: Q, K, V with fp32 descales (`flashgen.fp8.quantize`), a forward of the fa2 family only.
DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
#: Rows of q, k or v that share one fp8 descale: `runtime.quantize.QUANT_BLOCK`, repeated
#: because kernels and runtime import nothing of each other (a test keeps them equal).
FP8_BLOCK = 128
#: fp8 tensor-core products reduce over at least 32 elements (Triton refuses K < 32 for 8-bit
#: dots), so an fp8 head dim tiles with at least 32 columns (`runtime.forward.FP8_MIN_D`).
FP8_MIN_D = 32
MAX_HEAD_DIM = 256
#: The structure flags beyond causal, in field order.
MODIFIERS: tuple[str, ...] = ("window", "softcap", "sinks", "varlen")
#: Each modifier's letter in a tuning key's `modifiers` field (varlen adds its mix bucket).
MODIFIER_LETTERS: dict[str, str] = {"window": "w", "softcap": "k", "sinks": "s", "varlen": "v"}


def _clamped_sum(first: int, last: int, cap: int) -> int:
    """Sum of min(max(t, 0), cap) for t from `first` to `last`: the closed form that lets
    `visible_pairs` count a 32k-row sequence without a loop over its rows."""

    def upto(x: int) -> int:  # the sum for t from 0 to x
        if x <= 0:
            return 0
        return x * (x + 1) // 2 if x <= cap else cap * (cap + 1) // 2 + (x - cap) * cap

    return upto(last) - upto(first - 1) if last >= first else 0


def visible_pairs(lens_q: Sequence[int], lens_k: Sequence[int], causal: bool = False,
                  window: tuple[int, int] | None = None) -> int:
    """(query, key) pairs a mask keeps, summed over sequences: the work FLOP counts are of,
    so a windowed or packed problem's TFLOP/s compare with a dense one's at equal work.

    Each sequence aligns bottom-right, as `tune.reference.visible`: query i stands at
    i' = i + nk - nq; causal keeps j <= i', window (left, right) keeps
    i' - left <= j <= i' + right, a negative side meaning unbounded. Closed form per
    sequence (query i keeps the keys below its upper bound less those below its lower one).
    """
    left, right = window if window is not None else (-1, -1)
    total = 0
    for nq, nk in zip(lens_q, lens_k, strict=True):
        far = nq + nk  # past every key: an unbounded side
        up = right if right >= 0 else far
        if causal:
            up = min(up, 0)
        back = left if left >= 0 else far
        first = nk - nq  # query 0's position i'
        last = first + nq - 1
        # Keys j <= i' + up, less the keys j < i' - back (up, back >= 0: never more).
        total += (_clamped_sum(first + up + 1, last + up + 1, nk)
                  - _clamped_sum(first - back, last - back, nk))
    return total


def mix_bucket(batch: int, longest: int, tokens: int) -> int:
    """The length mix of `batch` packed sequences of `tokens` in all, the longest `longest`:
    the power of two nearest max / mean length (1: all alike; 4: the longest is about four
    times the mean). `runtime.table.mix_bucket` is the same rule."""
    ratio = longest * batch / max(1, tokens)
    return 1 << max(0, round(math.log2(max(1.0, ratio))))


@dataclass(frozen=True)
class Problem:
    """Shape, dtype and masking of one call: q is B x Hq x Nq x D, k and v B x Hkv x Nk x D."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str = "fp16"
    causal: bool = False
    # Modifiers and layout, each a structure choice of the kernels (their sizes and values are
    # runtime arguments): a sliding window, a logit softcap, per-head sinks, packed
    # variable-length sequences (then batch counts sequences, seq_q / seq_k are the longest).
    window: bool = False
    softcap: bool = False
    sinks: bool = False
    varlen: bool = False
    # The length mix of a varlen problem (`mix_bucket`: max / mean length as a power of two;
    # 0: not given, read as 1), part of its tuning key.
    mix: int = 0

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"query heads ({self.heads_q}) must be a multiple of key/value heads "
                f"({self.heads_kv}) for GQA/MQA"
            )
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head dim {self.head_dim} is over the supported {MAX_HEAD_DIM}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; use one of {sorted(DTYPES)}")
        for name in MODIFIERS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        m = self.mix
        if not isinstance(m, int) or isinstance(m, bool) or m < 0 or m & (m - 1):
            raise ValueError(f"mix must be 0 or a power of two, got {m!r}")
        if m and not self.varlen:
            raise ValueError(f"mix ({m}) is for varlen problems only")

    @property
    def modifiers(self) -> tuple[str, ...]:
        """The modifiers and layout this problem asks for, by name (empty for plain attention)."""
        return tuple(name for name in MODIFIERS if getattr(self, name))

    @property
    def packed_tokens(self) -> int:
        """Query tokens of all sequences that the mix implies (a bench draws lengths
        summing to it): batch x seq_q / mix, at least the longest plus one per other."""
        full = self.batch * self.seq_q
        return max(self.seq_q + self.batch - 1, min(full, round(full / max(1, self.mix))))

    @property
    def modifier_key(self) -> str:
        """The modifiers as a tuning key's `modifiers` field: a letter each (window w,
        softcap k, sinks s, varlen v with its mix bucket, e.g. "wv4"); "" for plain."""
        key = "".join(MODIFIER_LETTERS[name] for name in self.modifiers)
        if self.varlen:
            key += str(self.mix or 1)
        return key

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.heads_q // self.heads_kv

    @property
    def padded_head_dim(self) -> int:
        """Head dim rounded up to the power of two (at least 16, 32 for fp8) that the kernels
        tile with."""
        return max(FP8_MIN_D if self.dtype == "fp8" else 16, 1 << (self.head_dim - 1).bit_length())

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def pairs(self, lens: tuple[Sequence[int], Sequence[int]] | None = None,
              window: tuple[int, int] | None = None) -> int:
        """(query, key) pairs the mask keeps per head (`visible_pairs`): batch sequences of
        Nq x Nk, or the packed `lens` (of q, of k), narrowed by causal and `window`."""
        lens_q, lens_k = lens or ([self.seq_q] * self.batch, [self.seq_k] * self.batch)
        return visible_pairs(lens_q, lens_k, self.causal, window)

    def flops(self, lens: tuple[Sequence[int], Sequence[int]] | None = None,
              window: tuple[int, int] | None = None) -> float:
        """Forward FLOPs of the two matmuls over the pairs the mask keeps (`pairs`), so
        TFLOP/s measure work really done; without `lens` and `window` the batch's dense
        (causal: bottom-right visible) pairs."""
        return 4.0 * self.pairs(lens, window) * self.heads_q * self.head_dim

    def with_(self, **changes: Any) -> Problem:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields, leaving out modifiers not asked for: a plain problem's dict (and the
        `problem_json` rows, claims and baselines are matched by) is what it was before
        the modifiers existed."""
        data = asdict(self)
        for name in (*MODIFIERS, "mix"):
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Problem:
        """The problem `to_dict` gave `data`: a `DecodeProblem` where it names a page size."""
        if cls is Problem and "page_size" in data:
            return DecodeProblem(**data)
        return cls(**data)

    @classmethod
    def parse(cls, shape: str, dtype: str = "fp16", causal: bool = False) -> Problem:
        """Parse the CLI's `B,Hq,Hkv,Nq,Nk,D` form."""
        parts = [p.strip() for p in shape.split(",")]
        # A signed integer parses, so that "-32" meets the same named range check as "0".
        if len(parts) != 6 or not all(p.lstrip("+-").isdigit() for p in parts):
            raise ValueError(f"shape {shape!r} is not of the form B,Hq,Hkv,Nq,Nk,D")
        b, hq, hkv, nq, nk, d = (int(p) for p in parts)
        return cls(b, hq, hkv, nq, nk, d, dtype, causal)

    @classmethod
    def from_tensors(
        cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
    ) -> Problem:
        """Build the problem for q, k, v of shape (B, H, N, D); `validate` checks them first."""
        b, hq, nq, d = q.shape
        _, hkv, nk, _ = k.shape
        return cls(b, hq, hkv, nq, nk, d, DTYPE_NAMES[q.dtype], bool(causal))

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"B{self.batch} Hq{self.heads_q} Hkv{self.heads_kv} Nq{self.seq_q} Nk{self.seq_k} "
            f"D{self.head_dim} {self.dtype} {mask}"
        ) + "".join(f" {name}" for name in self.modifiers) + (
            f"{self.mix}" if self.mix else "")


@dataclass(frozen=True)
class DecodeProblem(Problem):
    """A call of the decode family: q (B, Hq, Nq, D) against a KV cache of `seq_k` keys per
    sequence (the tuner fills every sequence to seq_k; a call's key is its cache capacity).

    page_size: 0 for contiguous caches (B, Hkv, Nmax, D); else the keys per page of a paged
    cache (num_pages, page_size, Hkv, D), a power of two.
    leftpad: each sequence's keys start at its own offset of a contiguous cache (left-padded
    batches, `cache_leftpad`): kernel structure, like the modifiers; tuned rows are plain.
    """

    page_size: int = 0
    leftpad: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        p = self.page_size
        if not isinstance(p, int) or p < 0 or (p and p & (p - 1)):
            raise ValueError(f"page_size must be 0 (contiguous) or a power of two, got {p!r}")
        if self.leftpad and p:
            raise ValueError("leftpad is for contiguous caches (page_size 0)")

    def to_dict(self) -> dict[str, Any]:
        """As `Problem.to_dict`: without leftpad unless asked for (rows stay as they were)."""
        data = super().to_dict()
        if not data["leftpad"]:
            del data["leftpad"]
        return data

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V a call reads: every valid key of every sequence, once per K/V
        head (the decode kernels' GQA packing reads each K/V head once)."""
        elem = {"fp32": 4, "fp8": 1}.get(self.dtype, 2)
        return 2 * self.batch * self.heads_kv * self.seq_k * self.head_dim * elem

    @classmethod
    def parse(cls, shape: str, dtype: str = "fp16", causal: bool = True,
              page_size: int = 0) -> DecodeProblem:
        """The CLI's `B,Hq,Hkv,Nq,Nk,D` form, with a page size (0: contiguous)."""
        base = Problem.parse(shape, dtype, causal)
        return cls(*dataclasses.astuple(base), page_size=page_size)

    def __str__(self) -> str:
        cache = f"paged{self.page_size}" if self.page_size else "contiguous"
        return f"{super().__str__()} decode {cache}"
