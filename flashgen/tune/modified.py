"""Representative inputs of modified and packed problems, for the tuner's benches.

A tuning key records which modifiers a problem has (`Problem.modifier_key`), not their values,
which are runtime arguments of one compiled kernel. So the benches time one representative
value each: a window of a quarter of Nk (left only; (left, 0) under causal), a softcap of
30.0, random fp32 sinks, and for packed problems lengths drawn to the key's mix (the longest
is seq_q; they sum to `Problem.packed_tokens`). The gate checks the kernel against
`reference.py` called with the same values.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from flashgen.kernels.problem import Problem
from flashgen.runtime.modifiers import Fp8, Mods, Varlen
from flashgen.runtime.quantize import QUANT_BLOCK, Quantized, quantize
from flashgen.tune.check import make_inputs

#: The softcap benches time (Gemma 2's attention cap is 50, its final logits' 30).
BENCH_SOFTCAP = 30.0


def window_of(problem: Problem) -> tuple[int, int]:
    """The representative window: a quarter of Nk to the left; the right side unbounded,
    or 0 (the diagonal) under causal."""
    left = max(1, problem.seq_k // 4)
    return (left, 0) if problem.causal else (left, -1)


def draw_lengths(batch: int, longest: int, total: int, gen: torch.Generator) -> list[int]:
    """`batch` lengths of at most `longest`, one of them `longest`, summing to `total`
    (between longest + batch - 1 and batch x longest), in a seeded random order."""
    if not longest + batch - 1 <= total <= batch * longest:
        raise ValueError(f"{batch} sequences of at most {longest} cannot hold {total} tokens")
    rest, extra = batch - 1, total - longest - (batch - 1)
    add = [0] * rest
    if rest:
        weights = torch.rand(rest, generator=gen) + 0.05
        add = [min(longest - 1, int(w)) for w in (weights / weights.sum() * extra).tolist()]
        left = extra - sum(add)
        for i in itertools.cycle(range(rest)):
            if left <= 0:
                break
            take = min(longest - 1 - add[i], left)
            add[i] += take
            left -= take
    lengths = [longest] + [1 + a for a in add]
    order = torch.randperm(batch, generator=gen).tolist()
    return [lengths[i] for i in order]


@dataclass(frozen=True)
class ModifiedInputs:
    """q, k, v of a problem ((B, H, N, D), or packed (total, H, D)), the `Mods` its kernels
    launch with (None for plain problems), and what the reference takes for the same call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mods: Mods | None = None
    reference: dict[str, Any] = field(default_factory=dict)  # window, softcap, sinks
    cu: tuple[list[int], list[int]] | None = None  # the packed offsets, for the reference
    quantized: Quantized | None = None  # fp8: what the fp8 gate (`check.compare_fp8`) takes

    def flops(self, problem: Problem) -> float:
        """Forward FLOPs of `problem` called on these inputs: only the pairs their window and
        packed lengths leave visible, so the tuner's TFLOP/s match `flashgen bench`'s."""
        lens = None
        if self.cu is not None:
            cu_q, cu_k = self.cu
            lens = ([b - a for a, b in itertools.pairwise(cu_q)],
                    [b - a for a, b in itertools.pairwise(cu_k)])
        return problem.flops(lens, self.reference.get("window"))


def make_fp8_inputs(problem: Problem, device: torch.device, seed: int) -> ModifiedInputs:
    """Seeded fp8 inputs of `problem`: normal values whose 128-row blocks differ in magnitude
    (up to 8x), so a kernel that reads the wrong block's descale fails the gate, quantized as
    users should (`fp8.quantize`: block scales, incoherent)."""
    p = problem
    q, k, v = make_inputs(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim,
                          torch.float32, device, seed)
    for t in (q, k, v):
        blocks = -(-t.shape[2] // QUANT_BLOCK)
        gain = 2.0 ** (torch.arange(blocks, device=device) % 4).float()
        t.mul_(gain.repeat_interleave(QUANT_BLOCK)[: t.shape[2]].view(1, 1, -1, 1))
    qz = quantize(q, k, v, seed=seed)
    fp8 = Fp8.of(qz.q, qz.k, (qz.descale_q, qz.descale_k, qz.descale_v), None, QUANT_BLOCK)
    return ModifiedInputs(qz.q, qz.k, qz.v, Mods(fp8=fp8), quantized=qz)


def make_modified_inputs(problem: Problem, device: torch.device,
                         seed: int) -> ModifiedInputs:
    """Seeded inputs of `problem` with its representative modifier values (module doc)."""
    p = problem
    if p.dtype == "fp8":
        if p.modifiers:
            raise ValueError("fp8 problems are tuned without modifiers")
        return make_fp8_inputs(p, device, seed)
    if not p.modifiers:
        return ModifiedInputs(*make_inputs(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k,
                                           p.head_dim, p.torch_dtype, device, seed))
    gen = torch.Generator(device="cpu").manual_seed(seed + 7919)
    ref: dict[str, Any] = {}
    window = window_of(p) if p.window else None
    softcap = BENCH_SOFTCAP if p.softcap else None
    sinks = None
    if p.sinks:
        sinks = torch.randn(p.heads_q, generator=gen).to(device=device, dtype=torch.float32)
    for name, value in (("window", window), ("softcap", softcap), ("sinks", sinks)):
        if value is not None:
            ref[name] = value
    if not p.varlen:
        q, k, v = make_inputs(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim,
                              p.torch_dtype, device, seed)
        return ModifiedInputs(q, k, v, Mods(window, softcap, sinks), ref)
    lens_q = draw_lengths(p.batch, p.seq_q, p.packed_tokens, gen)
    lens_k = ([min(p.seq_k, max(1, round(n * p.seq_k / p.seq_q))) for n in lens_q]
              if p.seq_k != p.seq_q else lens_q)
    cu_q = [0, *itertools.accumulate(lens_q)]
    cu_k = [0, *itertools.accumulate(lens_k)]
    q, k, v = make_inputs(1, p.heads_q, p.heads_kv, cu_q[-1], cu_k[-1], p.head_dim,
                          p.torch_dtype, device, seed)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    as_tensor = lambda cu: torch.tensor(cu, dtype=torch.int32, device=device)
    varlen = Varlen(as_tensor(cu_q), as_tensor(cu_k), max(lens_q), max(lens_k), tuple(cu_q),
                    tuple(cu_k))
    return ModifiedInputs(q, k, v, Mods(window, softcap, sinks, varlen), ref, (cu_q, cu_k))
