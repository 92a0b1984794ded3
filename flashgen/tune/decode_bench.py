"""The decode family's inputs, correctness gate and candidate bench (`DecodeKernelBench`).

Inputs: a seeded KV cache of a `DecodeProblem`'s kind, contiguous ((B, Nmax, Hkv, D) memory
viewed as (B, Hkv, Nmax, D), as transformers keeps it) or paged (a shuffled block table over
more pages than the batch uses, so a kernel that ignores the table reads the wrong keys).
Gate: the float64 reference (`tune.reference`, through `tune.check.compare`) run on each
sequence's valid cache alone; the call passes where every sequence does.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.problem import DecodeProblem
from flashgen.serve import run_decode
from flashgen.tune.baseline import Baseline, sdpa_baseline
from flashgen.tune.check import CheckResult, compare
from flashgen.tune.fwd_bench import Measurement, checked_and_timed, describe_failure
from flashgen.tune.timing import Timing, time_cpu, time_cuda


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
                    scale: float | None = None, lse: torch.Tensor | None = None,
                    modifiers: dict[str, Any] | None = None) -> CheckResult:
    """`check.compare` of each sequence against the reference on its valid cache (with the
    call's `modifiers`: window, softcap, sinks); the first failure, else the worst error
    (with its bound)."""
    worst: CheckResult | None = None
    for b in range(cache.q.shape[0]):
        k, v = cache.valid(b)
        got = compare(out[b:b + 1], cache.q[b:b + 1], k, v, causal, scale,
                      None if lse is None else lse[b:b + 1], modifiers=modifiers)
        if not got.ok:
            return CheckResult(False, got.error, got.bound, f"sequence {b}: {got.reason}")
        if worst is None or got.error > worst.error:
            worst = got
    assert worst is not None
    return worst


def decode_gate(problem: DecodeProblem) -> DecodeProblem:
    """The problem a decode candidate is checked on: at most 2 sequences of at most 2 K/V
    heads and 1024 + (Nk mod 256) keys, so the last key tile and the split boundaries fall
    as in the real problem; ragged (see `DecodeKernelBench.measure`)."""
    keys = problem.seq_k if problem.seq_k <= 1280 else 1024 + problem.seq_k % 256
    hkv = min(problem.heads_kv, 2)
    return replace(problem, batch=min(problem.batch, 2), heads_kv=hkv,
                   heads_q=hkv * problem.group, seq_k=keys)


class DecodeKernelBench:
    """Decode variants of one `DecodeProblem` (the tuner's `Bench` for mode "decode").

    The timed cache holds Nk keys in every sequence. Each candidate's gate runs on fresh
    inputs seeded from the variant, with a ragged batch (the second sequence shorter, not a
    multiple of a tile), against the float64 reference on each sequence's valid cache.
    Throughput is the forward's FLOPs per second, as for the other modes, so the database's
    columns mean one thing; `flashgen bench --mode decode` reports GB/s.
    """

    def __init__(self, problem: DecodeProblem, device: torch.device | str, *, seed: int = 0,
                 compile_workers: int | None = None) -> None:
        self.problem = problem
        self.device = torch.device(device)
        self.seed = seed
        self.gate = decode_gate(problem)
        self.on_gpu = self.device.type == "cuda"
        self._cache: KVCache | None = None

    @property
    def cache(self) -> KVCache:
        if self._cache is None:
            self._cache = make_kvcache(self.problem, self.device, self.seed)
        return self._cache

    def _run(self, c: KVCache, variant: DecodeVariant,
             problem: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
        return run_decode(c.q, c.k, c.v, c.seqlens, c.block_table, variant, problem)

    def compile(self, variants: Sequence[DecodeVariant]) -> dict[DecodeVariant, str]:
        """Launch each variant once on the timing inputs (Triton compiles at first launch);
        serially: decode kernels are small and few."""
        if not self.on_gpu:
            return {}
        failures: dict[DecodeVariant, str] = {}
        for v in variants:
            try:
                self._run(self.cache, v, self.problem)
            except Exception as exc:
                failures[v] = describe_failure(exc)
        torch.cuda.synchronize(self.device)
        return failures

    def measure(self, variant: DecodeVariant) -> Measurement:
        g = self.gate
        seed = (self.seed * 1_000_003 + zlib.crc32(variant.to_json().encode())) % 2**31
        lengths = [g.seq_k, max(g.seq_q, g.seq_k * 2 // 3 + 1)][:g.batch]
        small = make_kvcache(g, self.device, seed, seqlens=lengths, capacity=g.seq_k)
        try:
            out, lse = self._run(small, variant, g)
        except Exception as exc:
            return Measurement.failed(describe_failure(exc))
        check = compare_kvcache(out, small, g.causal, lse=lse)
        c = self.cache

        def time() -> Timing:
            run = lambda: self._run(c, variant, self.problem)
            return time_cuda(run, self.device) if self.on_gpu else time_cpu(run)

        return checked_and_timed(check, time, self.problem.flops())

    def baseline(self) -> Baseline | None:
        """SDPA's fastest backend on the same keys as one contiguous cache; one query needs
        no mask (SDPA's own causal flag aligns top-left, so longer chunks get none here)."""
        if self.problem.causal and self.problem.seq_q > 1:
            return None
        c = self.cache
        k = c.k if c.block_table is None else torch.cat([c.valid(b)[0] for b in
                                                         range(self.problem.batch)])
        v = c.v if c.block_table is None else torch.cat([c.valid(b)[1] for b in
                                                         range(self.problem.batch)])
        timer = (lambda fn: time_cuda(fn, self.device)) if self.on_gpu else time_cpu
        return sdpa_baseline(c.q, k, v, False, timer)
