"""Compile an fa3 (Gluon) forward kernel for a Hopper target on any machine, GPU or not.

Gluon kernels cannot run in the Triton interpreter, so this is how CPU tests and developers
see what the compiler made of the template: the PTX's Hopper instructions, shared memory,
and ptxas's register and spill report. Run it in a process without TRITON_INTERPRET (the
interpreter swaps Triton's library functions for Python ones that Gluon cannot compile):

    python -m flashgen.tune.gluon_compile '{"loop_order": "fa3", ...}' 2,16,16,4096,4096,128 \
        --dtype bf16 --causal
    python -m flashgen.tune.gluon_compile '{"fa3": "both", ...}' 2,16,16,4096,4096,128 --bwd dkdv
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.problem import MODIFIERS, Problem
from flashgen.kernels.variant import Variant


def compile_gluon(fn: Any, args: list[Any], constexprs: dict[str, Any], num_warps: int,
                  capability: int = 90) -> Any:
    """Triton's compiled kernel of Gluon function `fn` for sm_`capability`a, no GPU needed:
    the signature comes from example arguments (descriptors over small CPU tensors are all
    Triton's specialisation reads: dtype, block shape, shared layout)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = [n for n in fn.arg_names if n not in constexprs]
    signature = {name: mangle_type(a) for name, a in zip(names, args, strict=True)}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    constants = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    target = GPUTarget("cuda", capability, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": num_warps})
    return triton.compile(GluonASTSource(fn, signature, constants, {}), target=target,
                          options=options.__dict__)


def example_args(head_dim: int, dtype: torch.dtype, rows: int, block_n: int) -> list[Any]:
    """fa3's arguments over small CPU tensors: q, k, v, o descriptors, then LSE and scalars."""
    from flashgen.runtime.forward import gluon_descriptor

    t = torch.empty(2, 4, 256, head_dim, dtype=dtype)
    return [gluon_descriptor(t, rows), gluon_descriptor(t, block_n),
            gluon_descriptor(t, block_n), gluon_descriptor(t, rows),
            torch.empty(4, dtype=torch.float32), 1024, 256, 0.125, 250, 250, 4, 1]


def example_fp8_args(head_dim: int, rows: int, block_n: int) -> list[Any]:
    """fa3's fp8 arguments: e4m3 q, k descriptors, v's over (B, H, D, N) memory moving
    (D, block_n) tiles, a bf16 o, LSE and scalars, then the descales and their strides."""
    from flashgen.runtime.forward import gluon_descriptor

    t = torch.empty(2, 4, 256, head_dim, dtype=torch.float8_e4m3fn)
    vt = torch.empty(2, 4, head_dim, 256, dtype=torch.float8_e4m3fn)
    out = torch.empty(2, 4, 256, head_dim, dtype=torch.bfloat16)
    descale = torch.empty(2, 4, 2, dtype=torch.float32)
    return [gluon_descriptor(t, rows), gluon_descriptor(t, block_n),
            gluon_descriptor(vt, head_dim, block_n), gluon_descriptor(out, rows),
            torch.empty(4, dtype=torch.float32), 1024, 256, 0.125, 250, 250, 4, 1,
            descale, descale, descale, *descale.stride(), *descale.stride(),
            *descale.stride()]


def example_modifier_args(problem: Problem) -> list[Any]:
    """The modifiers' runtime arguments, in the kernels' order: WIN_LEFT and WIN_RIGHT,
    SOFTCAP, SINKS (the types are what the compiler specialises on)."""
    return ([300, 0] if problem.window else []) + ([20.0] if problem.softcap else []) + (
        [torch.empty(4, dtype=torch.float32)] if problem.sinks else [])


def example_varlen_args(head_dim: int, dtype: torch.dtype, rows: int, block_n: int,
                        modifiers: list[Any] | None = None) -> list[Any]:
    """fa3's packed-sequence arguments: descriptors over (1, H, total, D) views of packed
    (total, H, D) tensors, LSE and scalars, CU_Q and CU_K (then the other modifiers'), then
    O and its row and head strides."""
    from flashgen.runtime.forward import gluon_descriptor

    t = torch.empty(512, 4, head_dim, dtype=dtype)
    view = t.unsqueeze(0).transpose(1, 2)
    cu = torch.zeros(3, dtype=torch.int32)
    return [gluon_descriptor(view, rows), gluon_descriptor(view, block_n),
            gluon_descriptor(view, block_n), gluon_descriptor(view, rows),
            torch.empty(4, dtype=torch.float32), 0, 512, 0.125, 256, 256, 4, 1, cu, cu,
            *(modifiers or []), t, t.stride(0), t.stride(1)]


def compile_fa3(variant: Variant, problem: Problem, capability: int = 90,
                overrides: dict[str, Any] | None = None) -> Any:
    """Triton's compiled kernel for fa3 `variant` on `problem` (see `compile_gluon`);
    `overrides` replace entries of the render context (`render_with`)."""
    from flashgen.kernels.render import _load_module, _templates, render_with, source_hash
    from flashgen.runtime.forward import k_groups_descriptor, k_row_groups, o_pointer

    if variant.loop_order != "fa3":
        raise ValueError(f"{variant} is not an fa3 variant")
    # The tiles' width: a padded head dim (96 -> 128) differs only in the descriptors' global
    # shape, a runtime value, so the example tensors take the tiles' width.
    d = problem.padded_head_dim
    if problem.dtype == "fp8":
        args = example_fp8_args(d, variant.fa3_rows, variant.block_n)
    elif problem.varlen:
        args = example_varlen_args(d, problem.torch_dtype, variant.fa3_rows, variant.block_n,
                                   example_modifier_args(problem))
    else:
        args = example_args(d, problem.torch_dtype, variant.fa3_rows,
                            variant.block_n) + example_modifier_args(problem)
    if variant.programs_per_sm:
        # After the common arguments (GROUP is the 12th) the persistent kernel takes what it
        # enumerates its units from: B * H_Q, or packed, the tile schedule's length and table.
        args[12:12] = [8, torch.zeros(8, 3, dtype=torch.int32)] if problem.varlen else [8]
    source = render_with(_templates(), variant, problem, overrides)
    kernel = _load_module(source_hash(source), source).attn_fwd
    if k_row_groups(kernel):  # K as 16-row groups, then their batch and head strides
        args[1], group_b, group_h = k_groups_descriptor(args[1].base, variant.block_n, d)
        args += [group_b, group_h]
    if o_pointer(kernel):  # O as a pointer and its (B, H, N) strides
        out = args[3].base
        args += [out, *out.stride()[:3]]
    return compile_gluon(kernel, args, {}, variant.num_warps, capability)


def compile_fa3_bwd(kernel: str, variant: BwdVariant, problem: Problem,
                    capability: int = 90) -> Any:
    """Triton's compiled Gluon backward kernel `kernel` ("dkdv" or "dq") of `variant`."""
    from flashgen.kernels.bwd_render import load_bwd_kernel
    from flashgen.runtime.backward import dq_reduce_args, fa3_tile_rows
    from flashgen.runtime.forward import gluon_descriptor

    if not variant.gluon(kernel):
        raise ValueError(f"the {kernel} kernel of {variant} is not a Gluon one")
    tiles = fa3_tile_rows(kernel, variant)
    cols = problem.padded_head_dim  # a head dim below it is padded by TMA
    rows = torch.empty(4, dtype=torch.float32)
    # Sinks add nothing to the backward kernels (the launcher computes their gradient).
    mods = example_modifier_args(problem.with_(sinks=False))
    if problem.varlen:
        # Descriptors over (1, H, total, D) views of packed (total, H, D) tensors; LSE and
        # delta (H_Q, total_q); CU_Q, CU_K, the modifiers, then the gradients' pointers
        # and their row and head strides (dK and dV, or dQ).
        t = torch.empty(512, 4, problem.head_dim, dtype=problem.torch_dtype)
        view = t.unsqueeze(0).transpose(1, 2)
        cu = torch.zeros(3, dtype=torch.int32)
        outs = [t, t, *t.stride()[:2], *t.stride()[:2]] if kernel == "dkdv" else [
            t, *t.stride()[:2]]
        args = [*(gluon_descriptor(view, r, cols) for r in tiles), rows, rows, 0, 512, 0, 512,
                0.125, 256, 256, 4, 1, cu, cu, *mods, *outs]
    else:
        t = torch.empty(2, 4, 256, problem.head_dim, dtype=problem.torch_dtype)
        args = [*(gluon_descriptor(t, r, cols) for r in tiles), rows, rows, 1024, 256, 1024, 256,
                0.125, 250, 250, 4, 1, *mods]
    if kernel == "dkdv":  # the atomic mode's fp32 dQ buffer, as the launcher describes it
        acc = torch.empty(1 if problem.varlen else 2, 4, 256, problem.head_dim)
        args += dq_reduce_args(variant, acc if variant.dq_mode == "atomic" else None)
    elif variant.fused_delta:  # O and its (B, H, N, D) strides (packed: batch stride 0)
        args += [t, 0, *t.stride()[1::-1], t.stride(2)] if problem.varlen else [t, *t.stride()]
    return compile_gluon(load_bwd_kernel(kernel, variant, problem), args, {}, 4, capability)


def _nvidia_tool(name: str) -> str:
    """Path of a CUDA binary (ptxas, cuobjdump) that Triton's wheel ships: no toolkit needed."""
    import triton

    return str(Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / name)


def ptxas_report(ptx: str) -> list[str]:
    """ptxas's register and spill lines for `ptx` (run again with -v on sm_90a)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        verbose = subprocess.run(
            [_nvidia_tool("ptxas"), "-arch=sm_90a", "-v", str(src),
             "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True).stderr
    return [line.strip() for line in verbose.splitlines()
            if "registers" in line or "spill" in line]


def spill_store_bytes(ptxas: list[str]) -> int:
    """The largest spill-store count (bytes a thread) in `ptxas_report`'s lines; 0 where
    none is reported."""
    return max((int(n) for line in ptxas for n in re.findall(r"(\d+) bytes spill stores", line)),
               default=0)


def sass(cubin: bytes) -> str:
    """The machine code of `cubin`, disassembled by the cuobjdump that Triton ships."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([_nvidia_tool("cuobjdump"), "-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout


def exp_under_pv(machine_code: str) -> list[bool]:
    """For each wait on a Q K^T product that leaves products in flight (the P V one, or
    split_d's two), whether an exponential (MUFU.EX2) follows before the wait for everything.

    The PTX always orders the softmax before the second wait; ptxas may still move that wait
    ahead of it (docs/fa3-hopper.md, "The softmax held under P V"), which only the machine
    code shows.
    """
    found: list[bool] = []
    waiting = False  # between a one-in-flight wait and the next wait for everything
    for line in machine_code.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line or "WARPGROUP.DEPBAR.LE gsb0, 0x2" in line:
            found.append(False)
            waiting = True
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            waiting = False
        elif waiting and "MUFU.EX2" in line:
            found[-1] = True
    return found


_SASS_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def opcodes(machine_code: str) -> dict[str, int]:
    """How many instructions of each opcode (with its modifiers, e.g. MUFU.EX2, FFMA.FTZ)
    the machine code holds: static counts over every partition's code."""
    found = Counter(m.group(1) for m in map(_SASS_OPCODE.match, machine_code.splitlines())
                    if m)
    return dict(sorted(found.items()))


def report(variant: Variant | BwdVariant, problem: Problem,
           bwd: str | None = None,
           overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the compiled kernel holds: Hopper instructions in its PTX, shared memory,
    ptxas's registers and spills (ptxas run again on the PTX with -v), and in the machine
    code whether its softmax runs under the P V product and how many byte permutes it has.
    With `bwd` ("dkdv" or "dq"), that backward kernel of BwdVariant `variant`; forward
    `overrides` replace entries of the render context (`render_with`)."""
    if bwd is not None:
        assert isinstance(variant, BwdVariant)
        kernel = compile_fa3_bwd(bwd, variant, problem)
    else:
        assert isinstance(variant, Variant)
        kernel = compile_fa3(variant, problem, overrides=overrides)
    ptx: str = kernel.asm["ptx"]
    machine_code = sass(kernel.asm["cubin"])
    return {
        "shared": kernel.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        # Instruction shapes (m64nNk16 ...): how wide each product is.
        "wgmma_shapes": dict(Counter(
            re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
        "wgmma_e4m3": ptx.count(".e4m3.e4m3"),  # fp8 products (8-bit operands both)
        "tma": ptx.count("cp.async.bulk.tensor"),
        "setmaxnreg": ptx.count("setmaxnreg"),
        "wait_one": ptx.count("wgmma.wait_group.sync.aligned 1"),
        # Any wait that leaves products in flight (split_d's kernels wait with two).
        "wait_partial": len(re.findall(r"wgmma\.wait_group\.sync\.aligned [1-9]", ptx)),
        "ptxas": ptxas_report(ptx),
        "exp_under_pv": exp_under_pv(machine_code),
        # Byte permutes: none in these kernels, but 192 when a branch took P, the P V
        # product's operand, and ptxas then repacked P before every P V product of the loop
        # (2-7% slower on the H100, docs/fa3-hopper.md "Half-width diagonal step").
        "byte_permutes": sum(" PRMT " in line for line in machine_code.splitlines()),
        # Special-function ops (MUFU.EX2, MUFU.TANH) against FMA-pipe work: what the capped
        # kernels' exp2 split trades (_fa3_softmax.py.jinja).
        "opcodes": opcodes(machine_code),
    }


def report_in_subprocess(variant: Variant | BwdVariant, problem: Problem,
                         bwd: str | None = None,
                         overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """`report` in a fresh process without TRITON_INTERPRET (see the module docstring)."""
    extra = ((["--causal"] if problem.causal else [])
             + [f"--{name}" for name in problem.modifiers] + (["--bwd", bwd] if bwd else [])
             + (["--context", json.dumps(overrides)] if overrides else []))
    return run_report("flashgen.tune.gluon_compile", variant.to_json(), problem, extra)


def run_report(module: str, variant_json: str, problem: Problem,
               extra: list[str]) -> dict[str, Any]:
    """Run compile-report `module` (`variant_json`, the problem's shape, its dtype, `extra`)
    in a fresh process without TRITON_INTERPRET; its last stdout line is the JSON report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = problem
    shape = ",".join(map(str, (p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim)))
    cmd = [sys.executable, "-m", module, variant_json, shape, "--dtype", p.dtype, *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"compile failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", help="the variant as JSON (Variant.to_json)")
    ap.add_argument("shape", help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp8"])
    ap.add_argument("--causal", action="store_true")
    for name in MODIFIERS:
        ap.add_argument(f"--{name}", action="store_true", help=f"with {name}")
    ap.add_argument("--bwd", choices=["dkdv", "dq"],
                    help="a backward kernel of a BwdVariant (given as JSON) instead")
    ap.add_argument("--context", default="{}",
                    help='forward render-context entries to override, as JSON, e.g. '
                         '\'{"mufu_split": false}\' (the capped kernel with exp2 all on MUFU)')
    args = ap.parse_args()
    problem = Problem.parse(args.shape, args.dtype, args.causal)
    problem = problem.with_(**{name: getattr(args, name) for name in MODIFIERS})
    variant = (BwdVariant if args.bwd else Variant).from_json(args.variant)
    print(json.dumps(report(variant, problem, args.bwd, json.loads(args.context) or None)))


if __name__ == "__main__":
    main()
