"""`flashgen bench --window` and `--varlen`: problems with a causal sliding window, or whose
tokens are packed into sequences of seeded random lengths.

A `Layout` turns each problem of a run into its windowed or packed form: `--varlen S` packs
the problem's B x N tokens into S sequences (lengths drawn with the run's seed, summing to
B x N), `--window W` lets each query see itself and the W keys before it. FLOPs count the
(query, key) pairs really visible, so TFLOP/s compare with dense problems at equal work.
Only competitors with such masks take part: flashgen (`attention` with `window=`,
`attention_varlen`) and FlexAttention (a sliding-window and/or document block mask); SDPA's
backends have neither and are reported n/a. Checks use the float64 reference with the
window or per sequence, bound as in `tune.check` (ERROR_FACTOR x the same-dtype eager
error plus a rounding step).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from flashgen.kernels.problem import Problem
from flashgen.runtime.api import attention, attention_varlen
from flashgen.tune import reference
from flashgen.tune.check import ERROR_FACTOR, CheckResult

#: competitors that run layouts
LAYOUT_COMPETITORS = ("flashgen", "flex")


@dataclass(frozen=True)
class Layout:
    """What every problem of a run becomes: `window` keys back (causal sliding window),
    `sequences` packed sequences; None: not asked for."""

    window: int | None = None
    sequences: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 0:
            raise ValueError(f"--window must be >= 0, got {self.window}")
        if self.sequences is not None and self.sequences < 1:
            raise ValueError(f"--varlen must be >= 1, got {self.sequences}")

    def __bool__(self) -> bool:
        return self.window is not None or self.sequences is not None

    def apply(self, p: Problem) -> Problem:
        """`p` marked with what the layout adds (a window is causal by definition)."""
        causal = p.causal or self.window is not None
        if self.sequences is not None and p.seq_q != p.seq_k:
            raise ValueError(f"--varlen packs self-attention: {p} has Nq != Nk")
        if self.sequences is not None and self.sequences > p.batch * p.seq_q:
            raise ValueError(f"--varlen {self.sequences}: {p} has only {p.batch * p.seq_q} "
                             "tokens (B x N) to cut into sequences")
        return p.with_(causal=causal, window=self.window is not None,
                       varlen=self.sequences is not None)

    def problems(self, problems: Iterable[Problem]) -> list[Problem]:
        """Each problem's laid-out form, once, in order: a window makes every problem causal,
        so the causal and the full problem of `--causal both` become one, to be run once."""
        return list(dict.fromkeys(self.apply(p) for p in problems))

    def lengths(self, p: Problem, seed: int) -> list[int]:
        """The packed sequences' lengths: B x N tokens cut at seeded random points."""
        total = p.batch * p.seq_q
        count = min(self.sequences or 1, total)
        gen = torch.Generator().manual_seed(seed)
        cuts = sorted((torch.randperm(total - 1, generator=gen)[: count - 1] + 1).tolist())
        return [b - a for a, b in itertools.pairwise([0, *cuts, total])]

    def _lens(self, p: Problem, seed: int) -> tuple[list[int], list[int]] | None:
        """The packed lengths of q and of k (self-attention: the same); None unpacked."""
        if not self.sequences:
            return None
        lens = self.lengths(p, seed)
        return lens, lens

    def pairs(self, p: Problem, seed: int) -> int:
        """(query, key) pairs the layout's mask keeps, summed over sequences, per head."""
        return p.pairs(self._lens(p, seed), self.window_arg())

    def flops(self, p: Problem, seed: int) -> float:
        """Forward FLOPs of the two matmuls over the visible pairs (`Problem.flops`, as the
        tuner counts them)."""
        return p.flops(self._lens(p, seed), self.window_arg())

    def window_arg(self) -> tuple[int, int] | None:
        return None if self.window is None else (self.window, 0)

    def extra(self, p: Problem, device: torch.device, seed: int) -> dict[str, Any]:
        """What the layout's calls take beyond q, k, v (the packed offsets)."""
        if not self.sequences:
            return {}
        lens = self.lengths(p, seed)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        return {"cu": cu, "longest": max(lens)}


def packed(t: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) -> (B x N, H, D): the packed layout of the same values."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).contiguous()


def reference_call(layout: Layout, causal: bool, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, extra: dict[str, Any], dtype: torch.dtype | None,
                   ) -> torch.Tensor:
    if layout.sequences:
        cu = extra["cu"].cpu()
        return reference.attention_varlen(q, k, v, cu, cu, causal, None, dtype,
                                          window=layout.window_arg())[0]
    return reference.attention(q, k, v, causal, None, dtype, window=layout.window_arg())[0]


def check(fn: Callable[..., torch.Tensor], layout: Layout, causal: bool, q: torch.Tensor,
          k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, extra: dict[str, Any],
          grads: bool) -> CheckResult:
    """The output (and with `grads` dq, dk, dv) of `fn` against the float64 reference."""
    leaves = [t.detach().requires_grad_(grads) for t in (q, k, v)]
    with torch.set_grad_enabled(grads):
        out = fn(*leaves, **extra)
        got = [out.detach()]
        if grads:
            got += list(torch.autograd.grad(out, leaves, do))
    results = []
    for work in (torch.float64, None):
        ref = [t.detach().to(work or t.dtype).requires_grad_(grads) for t in (q, k, v)]
        with torch.set_grad_enabled(grads):
            want = reference_call(layout, causal, *ref, extra, work)
            found = [want.detach()]
            if grads:
                found += list(torch.autograd.grad(want, ref, do.to(want.dtype)))
        results.append(found)
    truth, eager = results
    worst = CheckResult(True, 0.0, 0.0)
    for name, g, t, e in zip(("output", "dq", "dk", "dv"), got, truth, eager, strict=False):
        if not torch.isfinite(g).all():
            return CheckResult(False, float("inf"), 0.0, f"{name} has NaN or Inf")
        err = (g.double() - t).abs().max().item()
        bound = (ERROR_FACTOR * (e.double() - t).abs().max().item()
                 + torch.finfo(g.dtype).eps * max(1.0, t.abs().max().item()))
        if err > bound:
            return CheckResult(False, err, bound, f"{name} error {err:.3g} over {bound:.3g}")
        if err / bound >= worst.error / max(worst.bound, 1e-300):
            worst = CheckResult(True, err, bound)
    return worst


def flashgen_fn(problem: Problem, layout: Layout, fwd: Any, bwd: Any,
                ) -> Callable[..., torch.Tensor]:
    """flashgen's call for the layout with pinned variants (see competitors._flashgen)."""
    window = layout.window_arg()

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor | None = None,
            longest: int = 0) -> torch.Tensor:
        if cu is not None:
            return attention_varlen(q, k, v, cu, cu, longest, longest,
                                     causal=problem.causal, window=window,
                                     variant=fwd, bwd_variant=bwd)
        return attention(q, k, v, causal=problem.causal, window=window,
                         variant=fwd, bwd_variant=bwd)

    return run


def flex_fn(problem: Problem, layout: Layout, device: torch.device,
            ) -> Callable[..., torch.Tensor]:
    """Compiled FlexAttention with the layout's block mask (built once per offsets)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict[tuple, object] = {}

    def mask_for(nq: int, nk: int, cu: torch.Tensor | None) -> object:
        key = (nq, nk, None if cu is None else tuple(cu.tolist()))
        if key not in masks:
            doc = None
            if cu is not None:
                lens = cu.diff()
                doc = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
            offset = nk - nq

            def keep(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor,
                     kj: torch.Tensor) -> torch.Tensor:
                at = qi + offset
                ok = kj <= at if problem.causal else kj >= 0
                if layout.window is not None:
                    ok = ok & (at - kj <= layout.window)
                if doc is not None:
                    ok = ok & (doc[qi] == doc[kj])
                return ok

            masks[key] = create_block_mask(keep, None, None, nq, nk, device=device)
        return masks[key]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor | None = None,
            longest: int = 0) -> torch.Tensor:
        if cu is not None:  # one long row; the document mask keeps sequences apart
            q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
        else:
            q4, k4, v4 = q, k, v
        mask = mask_for(q4.shape[-2], k4.shape[-2], cu)
        out = compiled(q4, k4, v4, block_mask=mask, enable_gqa=q4.shape[1] != k4.shape[1])
        return out[0].transpose(0, 1) if cu is not None else out

    return run
