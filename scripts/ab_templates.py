"""Time the working tree's forward templates against other sets of them, in one process.

A template change is judged by how the same variant runs before and after it. Two separate
runs cannot tell: on an H100 the same cell moved by up to 0.15x cuDNN between benches
minutes apart (docs/timing.md, 2026-11-24). Here every version of each variant's kernel runs on the
same inputs, interleaved round by round with SDPA's cuDNN backend, and each round's ratio to
cuDNN is kept; the table gives their medians. Every kernel is first checked against the
float64 reference on the timed problem itself, so a persistent kernel is checked with its
full grid.

Each other set is a folder of template files that replace the working tree's by name (the
device machine has no git history, so take them out here and carry the folder):

    mkdir -p .ab/v2 && git show 71fdbb1:templates/attn_fwd_fa3_persistent.py.jinja \\
        > .ab/v2/attn_fwd_fa3_persistent.py.jinja
    python3 scripts/ab_templates.py --alt v2=.ab/v2 --match p1 --lens 512,1024 --csv ab.csv

A folder's templates render with the working tree's context and its fragments (the
`_*.jinja` files it lacks); copy the fragments of the same revision too where they have
changed since (a template from before the folded cap calls the `_cap_tanh` that today's
`_fa3_softmax.py.jinja` only defines with `cap_fold` off).

An alternate may instead be the working tree's templates rendered with render-context
entries overridden (`NAME=@JSON`), which times a structure choice both ways from one tree.
`--dtypes fp8` times fp8 kernels on quantized inputs (block descales), checked by the fp8
gate, with cuDNN in bf16 as the yardstick. `--softcap C` times capped kernels: the cap is
a runtime argument and the check uses it; cuDNN, which has no cap, stays the yardstick,
and the variant's plain kernel runs beside them as "plain". The capped fa3 kernel before
the folded cap, with the fold alone (the working tree's) and with the exp2 split too (B4
runs the reference out of memory on an 80 GB GPU):

    python3 scripts/ab_templates.py --softcap 30 --batch 2 --lens 8192 --dims 128 \\
        --dtypes bf16 --causal yes,no --match "m128 n128 w4 s2 p1 pp" \\
        --alt 'before=@{"mufu_split": false, "cap_fold": false}' \\
        --alt 'split=@{"mufu_split": true}' --csv ab-softcap.csv
"""

from __future__ import annotations

import argparse
import functools
import json
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
from flashgen.runtime.modifiers import Mods
from flashgen.serve import prepare_forward
from flashgen.tune.check import compare, compare_fp8, make_inputs
from flashgen.tune.modified import make_fp8_inputs
from flashgen.tune.timing import time_cuda

Alternate = tuple[dict[str, str], dict[str, object]]  # templates, render-context overrides
PLAIN = "plain"  # with --softcap: the working tree's kernel of the variant without the cap


def template_set(folder: str) -> dict[str, str]:
    """The working tree's templates with those of `folder` in place of theirs, by name."""
    return {**_templates(), **{f.name: f.read_text() for f in Path(folder).glob("*.jinja")}}


def launchers(variant: Variant, problem: Problem,
              alternates: dict[str, Alternate]) -> dict[str, Launcher]:
    """The variant's kernel from the working tree ("current") and from each alternate (a set
    of templates, render-context overrides) whose kernel for it differs."""
    runs = {"current": prepare_forward(variant, problem)}
    seen = {source_hash(render(variant, problem))}
    for name, (templates, overrides) in alternates.items():
        source = render_with(templates, variant, problem, overrides)
        digest = source_hash(source)
        if digest not in seen:
            seen.add(digest)
            kernel = _load_module(digest, source).attn_fwd
            runs[name] = prepare_forward(variant, problem, kernel=kernel)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alt", action="append", required=True, metavar="NAME=DIR|NAME=@JSON",
                    help="a folder of template files that replace the working tree's by name, "
                         "or @ and a JSON object of render-context entries to override "
                         "(repeatable)")
    ap.add_argument("--softcap", type=float, default=None,
                    help="time capped kernels with this cap (the check uses it too)")
    ap.add_argument("--batch", type=int, default=0,
                    help="batch of every cell (default: fa-bench's 16k tokens per length)")
    ap.add_argument("--lens", default="512,1024,2048")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--causal", default="no,yes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--match", default="p1",
                    help="comma-separated substrings of the sweep_fa3 points to compare")
    ap.add_argument("--csv", default="")
    a = ap.parse_args()
    if "fp8" in a.dtypes.split(",") and a.softcap is not None:
        ap.error("--dtypes fp8 takes no --softcap (the fp8 kernels have no modifiers)")
    alternates: dict[str, Alternate] = {}
    for alt in a.alt:
        name, _, where = alt.partition("=")
        if where.startswith("@"):
            alternates[name] = (_templates(), json.loads(where[1:]))
        else:
            alternates[name] = (template_set(where), {})
    mods = Mods(softcap=a.softcap) if a.softcap is not None else None
    modifiers = {"softcap": a.softcap} if a.softcap is not None else None
    extra = [mods] if mods is not None else []
    wanted = [m for m in a.match.split(",") if m]
    points = [p for p in POINTS if any(m in str(p) for m in wanted)]
    cells = [Problem(a.batch or TOKENS_PER_BATCH // n, 2048 // d, 2048 // d, n, n, d, dtype,
                     causal, softcap=a.softcap is not None)
             for d in (int(x) for x in a.dims.split(","))
             for n in (int(x) for x in a.lens.split(","))
             for dtype in a.dtypes.split(",")
             for causal in (c == "yes" for c in a.causal.split(","))]
    # fp8 cells: quantized inputs with their descales (`make_fp8_inputs`), checked by the fp8
    # gate; cuDNN runs the same problem in bf16.
    fp8 = {p: make_fp8_inputs(p, torch.device("cuda"), p.seq_q + p.head_dim)
           for p in cells if p.dtype == "fp8"}
    inputs = {p: (fp8[p].q, fp8[p].k, fp8[p].v) if p in fp8 else make_inputs(
        p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim, p.torch_dtype, "cuda",
        seed=p.seq_q + p.head_dim) for p in cells}
    extras = {p: [fp8[p].mods] if p in fp8 else extra for p in cells}
    jobs = [(p, v) for p in cells for v in points if why_invalid(v, p) is None]

    def warm(job: tuple[Problem, Variant]) -> dict[str, Launcher]:
        # Compiles on worker threads (Triton releases the GIL in LLVM and ptxas); a new
        # thread binds the device's context before TMA descriptors are made.
        torch.cuda.set_device(0)
        problem, variant = job
        runs = launchers(variant, problem, alternates)
        if mods is not None:
            # The same variant without the cap: the capped kernels' cost is their time over
            # this one's, measured in the same rounds.
            plain = prepare_forward(variant, problem.with_(softcap=False))
            runs[PLAIN] = lambda q, k, v, scale, *_: plain(q, k, v, scale)
        for run in runs.values():
            run(*inputs[problem], default_scale(problem.head_dim), *extras[problem])
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
        extra = extras[problem]

        # cuDNN has no cap nor fp8: such cells keep plain 16-bit attention as the yardstick.
        plain = problem.with_(softcap=False)
        if problem in fp8:
            plain = plain.with_(dtype="bf16")
            base_inputs = tuple(t.to(torch.bfloat16).contiguous() for t in (q, k, v))
        else:
            base_inputs = (q, k, v)
        cudnn = functools.partial(COMPETITORS["sdpa-cudnn"].prepare(plain, q.device).fn,
                                  *base_inputs)

        checks = {}
        for name, run in runs.items():
            out, lse = run(q, k, v, scale, *extra)
            if problem in fp8:
                quantized = fp8[problem].quantized
                assert quantized is not None
                checks[name] = compare_fp8(out, quantized, problem.causal)
            else:
                checks[name] = compare(out, q, k, v, problem.causal, None, lse,
                                       modifiers=None if name == PLAIN else modifiers)
        ratios: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(a.rounds):
            base = time_cuda(cudnn, q.device).median_ms
            for name, run in runs.items():
                if checks[name].ok:
                    ms = time_cuda(lambda r=run, x=(q, k, v, scale, *extra): r(*x),
                                   q.device).median_ms
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
