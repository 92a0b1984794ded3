"""Compile the decode kernels for a Hopper target on any machine, GPU or not.

The interpreter runs the decode kernels' Python, not Triton's compiler: a type the compiler
refuses, a shared-memory overflow or register spills show only in a real compile. This
compiles both kernels for sm_90a from their signatures alone (no tensors, no GPU) and reports
shared memory and ptxas's register and spill lines. Run it without TRITON_INTERPRET:

    python -m flashgen.tune.decode_compile '{"block_m": 16, "block_n": 64, ...}' \
        1,32,8,1,8192,128 --dtype bf16 --page-size 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from flashgen.kernels.decode_render import decode_roles, load_decode_kernel
from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.problem import DecodeProblem
from flashgen.runtime.kvcache import merge_width
from flashgen.tune.gluon_compile import ptxas_report, run_report


def compile_triton(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                   num_warps: int, num_stages: int, capability: int = 90) -> Any:
    """Triton's compiled kernel of JIT function `fn` for sm_`capability`, from its argument
    types alone: `signature`'s, `constexprs`' values, and i32 for every other argument (the
    decode kernels' strides, lengths and counts). Specialised as a launch on contiguous
    16-byte aligned tensors is: unit last strides are constants (Triton specialises an
    integer 1), pointers and other strides divisible by 16. Without that the loads have no
    known contiguity and the pipeliner makes no asynchronous copies at all."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    unit = {n: 1 for n in fn.arg_names if n.startswith("stride_") and n.endswith("d")}
    constexprs = unit | constexprs
    full = {name: "constexpr" if name in constexprs else signature.get(name, "i32")
            for name in fn.arg_names}
    constants = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if full[name].startswith("*") or (name.startswith("stride_")
                                                  and name not in constexprs)}
    target = GPUTarget("cuda", capability, 32)
    options = triton.compiler.make_backend(target).parse_options(
        {"num_warps": num_warps, "num_stages": num_stages})
    return triton.compile(ASTSource(fn, full, constants, aligned), target=target,
                          options=options.__dict__)


def compile_decode(variant: DecodeVariant, problem: DecodeProblem,
                   splits: int = 64, narrow: bool = True) -> dict[str, Any]:
    """The decode kernels of `variant` (`decode_roles`) compiled for sm_90a as the launcher
    calls them (no block table on a contiguous cache); the combine for `splits`; a hoisted
    variant with int32 offsets (`narrow`, caches under 2^31 elements) or int64 ones."""
    element = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}[problem.dtype]
    split_sig = {"Q": f"*{element}", "K": f"*{element}", "V": f"*{element}",
                 "SEQLENS": "*i32", "BLOCK_TABLE": "*i32", "O": "*fp32", "LSE": "*fp32",
                 "sm_scale": "fp32"}
    combine_sig = {"OP": "*fp32", "LP": "*fp32", "O": f"*{element}", "LSE": "*fp32"}
    # Modifiers' arguments where the kernels take them (window sides stay i32).
    if problem.softcap:
        split_sig["SOFTCAP"] = "fp32"
    if problem.sinks:
        split_sig["SINKS"] = combine_sig["SINKS"] = "*fp32"
    if problem.leftpad:
        split_sig["LEFTPAD"] = "*i32"
    if variant.fused_combine:  # the arrival counters and the final output
        split_sig |= {"COUNTS": "*i32", "OUT": f"*{element}", "OUT_LSE": "*fp32"}
    width = 1 << (splits - 1).bit_length()
    kernels = {
        "decode": compile_triton(load_decode_kernel("decode", variant, problem), split_sig,
                                 {"PAGE_SIZE": max(1, problem.page_size)}
                                 | ({} if problem.paged else {"BLOCK_TABLE": None})
                                 | ({"MERGE": merge_width(problem.padded_head_dim,
                                                          variant.num_warps)}
                                    if variant.fused_combine else {})
                                 | ({"NARROW": narrow} if variant.hoisted else {}),
                                 variant.num_warps, variant.num_stages),
    }
    if "decode_combine" in decode_roles(variant):
        kernels["decode_combine"] = compile_triton(
            load_decode_kernel("decode_combine", variant, problem), combine_sig,
            {"SPLITS": width}, 8, 1)
    return kernels


def report(variant: DecodeVariant, problem: DecodeProblem) -> dict[str, Any]:
    """Per kernel: shared memory, ptxas's register and spill lines, and the asynchronous
    copies the pipeliner made (0: the K/V loads are not run ahead)."""
    return {role: {"shared": k.metadata.shared, "ptxas": ptxas_report(k.asm["ptx"]),
                   "async_copies": k.asm["ttgir"].count("async_copy_global_to_local")}
            for role, k in compile_decode(variant, problem).items()}


def report_in_subprocess(variant: DecodeVariant, problem: DecodeProblem) -> dict[str, Any]:
    """`report` in a fresh process without TRITON_INTERPRET (see the module docstring)."""
    extra = (["--page-size", str(problem.page_size)] + ([] if problem.causal else ["--full"])
             + (["--leftpad"] if problem.leftpad else []))
    return run_report("flashgen.tune.decode_compile", variant.to_json(), problem, extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", help="the variant as JSON (DecodeVariant.to_json)")
    ap.add_argument("shape", help="B,Hq,Hkv,Nq,Nk,D")
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--page-size", type=int, default=0, help="0: a contiguous cache")
    ap.add_argument("--full", action="store_true", help="no causal mask")
    ap.add_argument("--leftpad", action="store_true", help="per-sequence left padding")
    args = ap.parse_args()
    problem = DecodeProblem.parse(args.shape, args.dtype, not args.full, args.page_size)
    if args.leftpad:
        problem = dataclasses.replace(problem, leftpad=True)
    print(json.dumps(report(DecodeVariant.from_json(args.variant), problem)))


if __name__ == "__main__":
    main()
