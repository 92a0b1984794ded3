"""The decode family's inputs, correctness gate and candidate bench.

Inputs: a seeded KV cache of a `DecodeProblem`'s kind, contiguous ((B, Nmax, Hkv, D) memory
viewed as (B, Hkv, Nmax, D), as transformers keeps it) or paged (a shuffled block table over
more pages than the batch uses, so a kernel that ignores the table reads the wrong keys).
Gate: the float64 reference (`tune.reference`, through `tune.check.compare`) run on each
sequence's valid cache alone; the call passes where every sequence does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashgen.kernels.problem import DecodeProblem
from flashgen.tune.check import CheckResult, compare


@dataclass(frozen=True)
class KVCache:
    """One decode call's inputs: q, the caches, each sequence's valid length, and the block
    table of a paged cache (None: contiguous)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seqlens: torch.Tensor
    block_table: torch.Tensor | None

    def valid(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `b`'s valid keys and values, (1, Hkv, L, D), gathered from its pages."""
        n = int(self.seqlens[b])
        if self.block_table is None:
            return self.k[b:b + 1, :, :n], self.v[b:b + 1, :, :n]
        page = self.k.shape[1]
        pages = self.block_table[b, :-(-n // page)].long()

        def gather(cache: torch.Tensor) -> torch.Tensor:
            keys = cache[pages].reshape(-1, *cache.shape[2:])[:n]  # (L, Hkv, D)
            return keys.transpose(0, 1).unsqueeze(0)

        return gather(self.k), gather(self.v)


def make_kvcache(problem: DecodeProblem, device: torch.device | str = "cpu", seed: int = 0,
                 seqlens: list[int] | None = None, capacity: int | None = None) -> KVCache:
    """Seeded inputs of `problem`'s kind. Every sequence holds `problem.seq_k` keys unless
    `seqlens` gives each its own; the cache holds `capacity` keys per sequence (default: the
    longest length, rounded up to whole pages)."""
    p, dtype = problem, problem.torch_dtype
    device = torch.device(device)
    # On a GPU the numbers are drawn there: a 128k-key cache of a large batch is tens of GB.
    gen = torch.Generator(device=device).manual_seed(seed)
    shuffle = torch.Generator(device="cpu").manual_seed(seed)
    lengths = seqlens if seqlens is not None else [p.seq_k] * p.batch
    if len(lengths) != p.batch:
        raise ValueError(f"seqlens has {len(lengths)} lengths for batch {p.batch}")
    n_max = capacity or max(lengths)

    def randn(*shape: int) -> torch.Tensor:
        if device.type == "cuda":
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype)
        return torch.randn(*shape, generator=gen).to(dtype=dtype)

    q = randn(p.batch, p.heads_q, p.seq_q, p.head_dim)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if not p.paged:
        k = randn(p.batch, n_max, p.heads_kv, p.head_dim).transpose(1, 2)
        v = randn(p.batch, n_max, p.heads_kv, p.head_dim).transpose(1, 2)
        return KVCache(q, k, v, lens, None)
    per_seq = -(-n_max // p.page_size)
    total = p.batch * per_seq + 3  # spare pages no sequence owns
    order = torch.randperm(total, generator=shuffle)[:p.batch * per_seq]
    table = order.view(p.batch, per_seq).to(device=device, dtype=torch.int32)
    k = randn(total, p.page_size, p.heads_kv, p.head_dim)
    v = randn(total, p.page_size, p.heads_kv, p.head_dim)
    return KVCache(q, k, v, lens, table)


def compare_kvcache(out: torch.Tensor, cache: KVCache, causal: bool,
                    scale: float | None = None, lse: torch.Tensor | None = None) -> CheckResult:
    """`check.compare` of each sequence against the reference on its valid cache; the first
    failure, else the worst error (with its bound)."""
    worst: CheckResult | None = None
    for b in range(cache.q.shape[0]):
        k, v = cache.valid(b)
        got = compare(out[b:b + 1], cache.q[b:b + 1], k, v, causal, scale,
                      None if lse is None else lse[b:b + 1])
        if not got.ok:
            return CheckResult(False, got.error, got.bound, f"sequence {b}: {got.reason}")
        if worst is None or got.error > worst.error:
            worst = got
    assert worst is not None
    return worst
