"""Time the working tree's forward templates against other sets of them, in one process.

A template change is judged by how the same variant runs before and after it. Two separate
runs cannot tell: on an H100 the same cell moved by up to 0.15x cuDNN between benches
minutes apart (NOTES.md, 2026-11-24). Here every version of each variant's kernel runs on the
same inputs, interleaved round by round with SDPA's cuDNN backend, and each round's ratio to
cuDNN is kept; the table gives their medians. Every kernel is first checked against the
float64 reference on the timed problem itself, so a persistent kernel is checked with its
full grid.

Each other set is a folder of template files that replace the working tree's by name (the
device machine has no git history, so take them out here and carry the folder):

    mkdir -p .ab/v2 && git show 71fdbb1:templates/attn_fwd_fa3_persistent.py.jinja \\
        > .ab/v2/attn_fwd_fa3_persistent.py.jinja
    python3 scripts/ab_templates.py --alt v2=.ab/v2 --match p1 --lens 512,1024 --csv ab.csv
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from sweep_fa3 import POINTS, finish

from flashgen.bench.competitors import COMPETITORS
from flashgen.kernels.fwd_space import why_invalid
from flashgen.kernels.presets import TOKENS_PER_BATCH
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import _load_module, _templates, render, render_with, source_hash
from flashgen.kernels.variant import Variant
from flashgen.runtime.forward import Launcher, default_scale
from flashgen.serve import prepare_forward
from flashgen.tune.check import compare, make_inputs
from flashgen.tune.timing import time_cuda


def launchers(variant: Variant, problem: Problem,
              alternates: dict[str, dict[str, str]]) -> dict[str, Launcher]:
    """The variant's kernel from the working tree ("current") and from each alternate set
    of templates whose kernel for it differs."""
    runs = {"current": prepare_forward(variant, problem)}
    seen = {source_hash(render(variant, problem))}
    for name, templates in alternates.items():
        source = render_with(templates, variant, problem)
        digest = source_hash(source)
        if digest not in seen:
            seen.add(digest)
            kernel = _load_module(digest, source).attn_fwd
            runs[name] = prepare_forward(variant, problem, kernel=kernel)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alt", action="append", required=True, metavar="NAME=DIR",
                    help="a folder of template files that replace the working tree's by name "
                         "(repeatable)")
    ap.add_argument("--lens", default="512,1024,2048")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--causal", default="no,yes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--match", default="p1",
                    help="comma-separated substrings of the sweep_fa3 points to compare")
    ap.add_argument("--csv", default="")
    a = ap.parse_args()
    alternates = {}
    for alt in a.alt:
        name, _, folder = alt.partition("=")
        alternates[name] = {**_templates(),
                            **{f.name: f.read_text() for f in Path(folder).glob("*.jinja")}}
    wanted = [m for m in a.match.split(",") if m]
    points = [p for p in POINTS if any(m in str(p) for m in wanted)]
    cells = [Problem(TOKENS_PER_BATCH // n, 2048 // d, 2048 // d, n, n, d, dtype, causal)
             for d in (int(x) for x in a.dims.split(","))
             for n in (int(x) for x in a.lens.split(","))
             for dtype in a.dtypes.split(",")
             for causal in (c == "yes" for c in a.causal.split(","))]
    inputs = {p: make_inputs(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim,
                             p.torch_dtype, "cuda", seed=p.seq_q + p.head_dim) for p in cells}
    jobs = [(p, v) for p in cells for v in points if why_invalid(v, p) is None]

    def warm(job: tuple[Problem, Variant]) -> dict[str, Launcher]:
        # Compiles on worker threads (Triton releases the GIL in LLVM and ptxas); a new
        # thread binds the device's context before TMA descriptors are made.
        torch.cuda.set_device(0)
        problem, variant = job
        runs = launchers(variant, problem, alternates)
        for run in runs.values():
            run(*inputs[problem], default_scale(problem.head_dim))
        return runs

    t0 = time.time()
    with ThreadPoolExecutor(max_workers=14) as pool:
        prepared = dict(zip(jobs, pool.map(warm, jobs), strict=True))
    torch.cuda.synchronize()
    kernels = sum(map(len, prepared.values()))
    print(f"compiled {kernels} kernels in {time.time() - t0:.0f} s", flush=True)
    rows = []
    for (problem, variant), runs in prepared.items():
        q, k, v = inputs[problem]
        scale = default_scale(problem.head_dim)

        cudnn = functools.partial(COMPETITORS["sdpa-cudnn"].prepare(problem, q.device).fn,
                                  q, k, v)

        checks = {}
        for name, run in runs.items():
            out, lse = run(q, k, v, scale)
            checks[name] = compare(out, q, k, v, problem.causal, None, lse)
        ratios: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(a.rounds):
            base = time_cuda(cudnn, q.device).median_ms
            for name, run in runs.items():
                if checks[name].ok:
                    ms = time_cuda(lambda r=run, x=(q, k, v, scale): r(*x), q.device).median_ms
                    ratios[name].append(base / ms)
        cells_text = []
        for name in runs:
            r = ratios[name]
            med = statistics.median(r) if r else 0.0
            cells_text.append(f"{name} {med:.3f} ({min(r):.2f}-{max(r):.2f})" if r
                              else f"{name} WRONG {checks[name].reason[:80]}")
            rows.append({"problem": str(problem), "variant": str(variant), "template": name,
                         "ok": checks[name].ok, "error": checks[name].error,
                         "bound": checks[name].bound, "ratio_cudnn_median": round(med, 4),
                         "ratios": " ".join(f"{x:.3f}" for x in r)})
        print(f"{problem} {variant}: " + "  ".join(cells_text), flush=True)
    finish(a.csv, rows)


if __name__ == "__main__":
    main()
