"""Compile an fa3 (Gluon) forward kernel for a Hopper target on any machine, GPU or not.

Gluon kernels cannot run in the Triton interpreter, so this is how CPU tests and developers
see what the compiler made of the template: the PTX's Hopper instructions, shared memory,
and ptxas's register and spill report. Run it in a process without TRITON_INTERPRET (the
interpreter swaps Triton's library functions for Python ones that Gluon cannot compile):

    python -m flashgen.gluon_compile '{"loop_order": "fa3", ...}' 2,16,16,4096,4096,128 \
        --dtype bf16 --causal
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from flashgen.problem import Problem
from flashgen.variant import Variant


def compile_fa3(variant: Variant, problem: Problem, capability: int = 90) -> Any:
    """Triton's compiled kernel for `variant` on `problem` (sm_`capability`a), no GPU needed:
    the signature comes from descriptors over small CPU tensors, which is all Triton's
    specialisation reads from them (dtype, block shape, shared layout)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from flashgen.forward import _gluon_descriptor
    from flashgen.render import load_kernel

    if variant.loop_order != "fa3":
        raise ValueError(f"{variant} is not an fa3 variant")
    t = torch.empty(2, 4, 256, problem.head_dim, dtype=problem.torch_dtype)
    rows = 16 * variant.num_warps
    args = [_gluon_descriptor(t, rows), _gluon_descriptor(t, variant.block_n),
            _gluon_descriptor(t, variant.block_n), _gluon_descriptor(t, rows),
            torch.empty(4, dtype=torch.float32), 1024, 256, 0.125, 250, 250, 4, 1]
    fn = load_kernel(variant, problem)
    signature = {name: mangle_type(a) for name, a in zip(fn.arg_names, args, strict=True)}
    target = GPUTarget("cuda", capability, 32)
    options = triton.compiler.make_backend(target).parse_options(
        {"num_warps": variant.num_warps})
    return triton.compile(GluonASTSource(fn, signature, {}, {}), target=target,
                          options=options.__dict__)


def report(variant: Variant, problem: Problem) -> dict[str, Any]:
    """What the compiled kernel holds: Hopper instructions in its PTX, shared memory, and
    ptxas's registers and spills (ptxas run again on the PTX with -v)."""
    import triton

    kernel = compile_fa3(variant, problem)
    ptx: str = kernel.asm["ptx"]
    ptxas = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        verbose = subprocess.run(
            [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True).stderr
    return {
        "shared": kernel.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma": ptx.count("cp.async.bulk.tensor"),
        "setmaxnreg": ptx.count("setmaxnreg"),
        "wait_one": ptx.count("wgmma.wait_group.sync.aligned 1"),
        "ptxas": [line.strip() for line in verbose.splitlines()
                  if "registers" in line or "spill" in line],
    }


def report_in_subprocess(variant: Variant, problem: Problem) -> dict[str, Any]:
    """`report` in a fresh process without TRITON_INTERPRET (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shape = ",".join(str(x) for x in (problem.batch, problem.heads_q, problem.heads_kv,
                                      problem.seq_q, problem.seq_k, problem.head_dim))
    cmd = [sys.executable, "-m", "flashgen.gluon_compile", variant.to_json(), shape,
           "--dtype", problem.dtype] + (["--causal"] if problem.causal else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"compile failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", help="the variant as JSON (Variant.to_json)")
    ap.add_argument("shape", help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    problem = Problem.parse(args.shape, args.dtype, args.causal)
    print(json.dumps(report(Variant.from_json(args.variant), problem)))


if __name__ == "__main__":
    main()
