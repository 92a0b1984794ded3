"""Compile Triton kernels for a GPU target, one process per batch of jobs: `flashgen.export.aot`'s
worker. Run by path (`python cubin_worker.py JOBS.json`), so it imports triton and nothing of
flashgen or torch.

A separate process because Triton decides at import whether `@triton.jit` makes compilable
functions or interpreter objects (TRITON_INTERPRET=1, as in flashgen's CPU runs and tests),
and its own library functions are made the same way; only a fresh process without the
variable compiles. Several workers also compile in parallel.

Each job: {"source", "function", "signature", "constexprs", "divisible" (argument names),
"capability" [major, minor], "num_warps", "num_stages", "cubin", "metadata"}; the worker
writes the cubin and a JSON of the metadata the launch needs, or {"error": ...} if the
compile failed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any


def compile_job(job: dict[str, Any]) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    path = Path(job["source"])
    spec = importlib.util.spec_from_file_location(f"aot_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, job["function"])
    # Pointer alignment and integer divisibility are both Triton's tt.divisibility(16).
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in job["divisible"]}
    src = triton.compiler.ASTSource(fn, job["signature"], job["constexprs"], attrs)
    major, minor = job["capability"]
    target = GPUTarget("cuda", major * 10 + minor, 32)
    options = triton.compiler.make_backend(target).parse_options(
        {"num_warps": job["num_warps"], "num_stages": job["num_stages"]})
    kernel = triton.compile(src, target=target, options=options.__dict__)
    md = kernel.metadata
    Path(job["cubin"]).write_bytes(kernel.asm["cubin"])
    fields = ("name", "num_warps", "num_ctas", "shared", "global_scratch_size",
              "global_scratch_align", "profile_scratch_size", "profile_scratch_align",
              "launch_cooperative_grid", "launch_pdl")
    meta = {f: getattr(md, f) for f in fields}
    meta["triton_version"] = triton.__version__
    # The block size the binary demands; Triton launches 32 * num_warps threads, and the two
    # must agree (warp specialization may add warps; the PTX says what was built).
    threads = re.search(r"\.reqntid\s+(\d+)", kernel.asm["ptx"])
    meta["threads"] = int(threads[1]) if threads else 32 * md.num_warps
    Path(job["metadata"]).write_text(json.dumps(meta))


def main(argv: list[str]) -> int:
    for job in json.loads(Path(argv[1]).read_text()):
        try:
            compile_job(job)
        except Exception as exc:  # a failed compile is data: the caller records it
            Path(job["metadata"]).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
