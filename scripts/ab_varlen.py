"""Time the persistent fa3 kernel on packed sequences both ways of a render switch, in one
process, beside a dense batch of equal FLOPs.

The packing is `benchmarks/varlen_modifiers.py`'s (16 sequences of seeded random lengths
summing to 16k tokens). For each variant, the working tree's kernel ("current") and the one
rendered with the given render-context overrides run on the same inputs, round by round
with flashgen's dense call on B16 sequences of the packing's root-mean-square length; each
kernel's output is first checked against each sequence's dense flashgen output.

    python3 scripts/ab_varlen.py --alt 'regs=@{"o_staged_varlen": false}' --timer wall
    python3 scripts/ab_varlen.py --alt 'registers=@{"o_staged_one_tile": false}'  (one-tile)

A variant whose kernel an alternate leaves unchanged is timed once ("current").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

import flashgen
from flashgen.kernels.problem import Problem, mix_bucket
from flashgen.kernels.render import _load_module, _templates, render_with, source_hash
from flashgen.kernels.variant import Variant
from flashgen.runtime.forward import default_scale
from flashgen.runtime.modifiers import Mods, Varlen
from flashgen.serve import prepare_forward
from flashgen.tune.timing import time_cuda

# The packing and pair counts of the benchmark this A/B mirrors, from the benchmark itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from varlen_modifiers import causal_pairs, lengths

POINTS = [Variant("fa3", 192, 64, 4, 2, programs_per_sm=1, pingpong=True),
          Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True),
          Variant("fa3", 128, 128, 4, 2, programs_per_sm=1),
          # one-tile: what a packed call runs from a persistent plain winner's tiles
          Variant("fa3", 128, 128, 4, 2), Variant("fa3", 128, 128, 4, 3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alt", action="append", required=True, metavar="NAME=@JSON")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timer", default="wall", choices=["wall", "gpu"])
    a = ap.parse_args()
    dev = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    lens = lengths(16384, 16, seed=0)
    offsets = (0, *itertools.accumulate(lens))
    cu = torch.tensor(offsets, dtype=torch.int32, device=dev)
    mods = Mods(varlen=Varlen(cu, cu, max(lens), max(lens), offsets, offsets))
    rms = round(math.sqrt(sum(n * n for n in lens) / len(lens)))
    q, k, v = (torch.randn(16384, a.heads, a.dim, device=dev, dtype=dtype) for _ in range(3))
    print(f"lengths {lens}; dense yardstick B16 N{rms}", flush=True)
    for causal in (True, False):
        problem = Problem(len(lens), a.heads, a.heads, max(lens), max(lens), a.dim, a.dtype,
                          causal, varlen=True, mix=mix_bucket(len(lens), max(lens), 16384))
        pairs = sum(causal_pairs(n, n) if causal else n * n for n in lens)
        dense_in = [torch.randn(16, a.heads, rms, a.dim, device=dev, dtype=dtype)
                    for _ in range(3)]
        dense_pairs = 16 * (causal_pairs(rms, rms) if causal else rms * rms)
        want = torch.cat([flashgen.attention(
            q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
            v[s:e].transpose(0, 1)[None], causal=causal)[0].transpose(0, 1)
            for s, e in itertools.pairwise(offsets)])
        for variant in POINTS:
            if flashgen.why_invalid(variant, problem):
                continue
            runs = {"current": prepare_forward(variant, problem)}
            seen = {source_hash(render_with(_templates(), variant, problem, {}))}
            for alt in a.alt:
                name, _, spec = alt.partition("=")
                source = render_with(_templates(), variant, problem, json.loads(spec[1:]))
                if source_hash(source) in seen:
                    continue
                seen.add(source_hash(source))
                kernel = _load_module(source_hash(source), source).attn_fwd
                runs[name] = prepare_forward(variant, problem, kernel=kernel)
            scale = default_scale(a.dim)
            diffs = {n: (r(q, k, v, scale, mods)[0] - want).abs().max().item()
                     for n, r in runs.items()}
            ratios: dict[str, list[float]] = {n: [] for n in runs}
            for _ in range(a.rounds):
                dense_ms = time_cuda(lambda d=dense_in, c=causal: flashgen.attention(*d, causal=c),
                                     dev, timer=a.timer).median_ms
                for n, r in runs.items():
                    ms = time_cuda(lambda r=r, s=scale: r(q, k, v, s, mods), dev,
                                   timer=a.timer).median_ms
                    # packed TFLOP/s over dense TFLOP/s: equal FLOPs makes it a time ratio.
                    ratios[n].append((pairs / ms) / (dense_pairs / dense_ms))
            cells = "  ".join(f"{n} {statistics.median(r):.3f} (diff {diffs[n]:.3g})"
                              for n, r in ratios.items())
            print(f"causal={causal} {variant}: x dense {cells}", flush=True)


if __name__ == "__main__":
    main()
