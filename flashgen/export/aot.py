"""`flashgen export --format aot`: forward kernels compiled ahead of time for C/C++ serving.

Each winning fa2 forward variant (and the default variants of the exported kinds, so a C
dispatcher always has a kernel that fits) is compiled with `triton.compile` for its tuned
GPU's target, which needs no GPU: the PTX assembler ships in the triton wheel. Written:

    NAME/manifest.json        every kernel, the dispatch table, the launch ABI
    NAME/kernels/<id>.cubin   the binary; its entry symbol is the manifest's kernel_name
    NAME/kernels/<id>.json    that kernel's manifest entry
    NAME/kernels/<id>.py      the Triton source it was compiled from
    NAME/NAME.h               C: argument struct, kernel list, cuLaunchKernel wrapper
    NAME/cuda_loader.py       ctypes loader for Python hosts (stdlib only)

The signature is fixed and documented rather than specialised per call as Triton's JIT does:
pointers 16-byte aligned; the head-dim strides compiled in as 1 (the last dim must be
contiguous); the other Q/K/V/O strides divisible by 16 when the head dim is (so loads
vectorise); every other integer a plain i32, so any length works. fa1 winners need scratch
buffers and are recorded as skipped; a use_tma or fa3 winner is compiled as its pointer twin (the
ABI passes pointers, not CUtensorMaps), and its dispatch row says so (`as_tuned`, `why_not`);
backward kernels are not exported ahead of time.

fp8 kernels (the fa2 pointer kernel's `fp8` structure) take a longer argument list, the
"fwd_fp8" ABI (`ABI["fp8"]`): e4m3 Q, K, V with V keys-inner (stride_vn compiled in as 1,
`fp8.quantize`'s layout), the fp32 descales and their strides after GROUP, and O in the
output dtype, which is part of the kernel's identity: one cubin per exported out dtype
(`fp8_out`, bf16 unless asked). GPUs below sm89 have no fp8 tensor cores: their fp8 rows are
skipped.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashgen.export.rows import (
    AnyVariant,
    Family,
    GpuWinners,
    NoDefault,
    Selection,
    default_grid,
    tile_needs,
)
from flashgen.export.target import check_name, check_target
from flashgen.kernels.hardware import CPU_INTERPRETER
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import render
from flashgen.kernels.variant import Variant
from flashgen.store.keys import Versions
from flashgen.store.table import tuned_buckets
from flashgen.version import __version__

#: Bumped when a manifest or header field changes meaning or layout (2: argument lists per
#: kernel ABI, out_dtype, the kernel struct's new fields).
MANIFEST_VERSION = 2
LOADER = Path(__file__).with_name("cuda_loader.py")
WORKER = Path(__file__).with_name("cubin_worker.py")
POINTER_ALIGN = 16
#: Head-dim strides, compiled in as 1: contiguous rows let every load vectorise.
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od")
#: fp8's: V is keys-inner (`fp8.quantize`'s layout), so its key stride is the unit one.
FP8_UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vn", "stride_od")
#: fp8 V strides that are multiples of 16 in any keys-inner layout: key rows padded to 16.
FP8_V_DIVISIBLE = ("stride_vb", "stride_vh", "stride_vd")
TENSORS = ("Q", "K", "V", "O")
#: The fp8 descales: fp32, read one scalar at a time, so only fp32's own alignment is asked.
DESCALES = ("DQ", "DK", "DV")
DESCALE_ALIGN = 4
#: Output dtypes an fp8 kernel may be compiled for (`fp8_out`); the first is the default.
FP8_OUT = ("bf16", "fp16")
#: Triton's name of e4m3 (torch.float8_e4m3fn).
FP8_TRITON = "fp8e4nv"
C_TYPES = {"i32": "int32_t", "i64": "int64_t", "fp32": "float"}

ABI: dict[str, Any] = {
    "call": "cuLaunchKernel(function, grid_x, grid_y, grid_z, block_x, 1, 1, shared_bytes, "
            "stream, kernelParams, NULL)",
    "kernel_params": "kernelParams[i] points at the value of arguments[i], in order, followed "
                     "by one pointer per trailing_arguments entry",
    "types": {"*fp16": "CUdeviceptr (8 bytes)", "*bf16": "CUdeviceptr (8 bytes)",
              "*fp32": "CUdeviceptr (8 bytes)", f"*{FP8_TRITON}": "CUdeviceptr (8 bytes)",
              "i32": "int32_t", "fp32": "float (4 bytes)"},
    "argument_lists": "each kernel's `abi` names its argument list: `fwd` (16-bit and fp32 "
                      "kernels) or `fwd_fp8`; manifest `argument_lists` gives the names of "
                      "each in order, every kernel's `arguments` its names, types and promises",
    "trailing_arguments": [
        {"name": "global_scratch", "type": "CUdeviceptr",
         "value": "0 when global_scratch_bytes is 0, else a buffer of grid_x * grid_y * grid_z "
                  "* num_ctas * global_scratch_bytes bytes aligned to global_scratch_align"},
        {"name": "profile_scratch", "type": "CUdeviceptr",
         "value": "0 when profile_scratch_bytes is 0 (as above otherwise)"},
    ],
    "dynamic_shared_memory": "when shared_bytes > 49152, call cuFuncSetAttribute(function, "
                             "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes) "
                             "once after cuModuleGetFunction",
    "block": "(32 * num_warps, 1, 1)",
    "requires": [
        f"Q, K, V, O and LSE device pointers are {POINTER_ALIGN}-byte aligned",
        "the last (head-dim) stride of Q, K, V and O is 1; those strides are not passed",
        "arguments listed with divisible_by 16 are multiples of 16",
        "strides are in elements; every stride and length is below 2**31",
        "O is shaped like Q; LSE is (B, H_Q, N_Q) fp32 and receives the natural-log "
        "log-sum-exp; strides of the batch, head and row dims are free (e.g. (B, N, H, D) "
        "memory viewed as (B, H, N, D))",
    ],
    "grid_variables": {"B": "batch size", "N_Q": "query length", "H_Q": "query heads"},
    "fp8": {
        "kernels": "dtype fp8, abi fwd_fp8: the fa2 pointer kernel (fa3 and use_tma winners "
                   "as their pointer twin); forward only",
        "inputs": f"Q, K, V float8_e4m3fn (*{FP8_TRITON}); value = fp8 value * descale",
        "output": "O of the kernel's out_dtype (bf16 unless exported with more, see "
                  "fp8_out_dtypes); LSE fp32 as above",
        "v_layout": "V keys-inner: (B, H_KV, N_K, D) indexed through its strides with "
                    "stride_vn compiled in as 1 (not passed), i.e. (B, H_KV, D, N_pad) memory "
                    "whose key rows are padded to a multiple of 16 (flashgen.fp8.quantize's "
                    "default layout); stride_vb, stride_vh and stride_vd are multiples of 16",
        "descales": "DQ, DK, DV: fp32, 4-byte aligned, element [b, h, n // 128] at "
                    "b * stride_d?b + h * stride_d?h + (n // 128) * stride_d?n (elements), "
                    "h being the tensor's own head (H_KV for DK and DV); a per-tensor descale "
                    "is one float with its three strides 0. They follow GROUP, after the "
                    "common arguments",
    },
}

DISPATCH_RULE = (
    "For (gpu, dtype, out_dtype, causal, head_dim, gqa) and lengths Nq, Nk (out_dtype: the "
    "output's dtype, the input dtype except for fp8): pow2(n) = the next power of two >= n; "
    "bucket(n) = 3 * pow2(n) / 4 where pow2(n) >= 4 and n <= 3 * pow2(n) / 4, else pow2(n) "
    "(the ladder 1, 2, 3, 4, 6, 8, 12, 16, 24, ...). Among `dispatch` rows of that kind whose "
    "need = [q, k] satisfies max(16, pow2(Nq)) >= q and max(16, pow2(Nk)) >= k, take the "
    "smallest |log2(seq_q_bucket / bucket(Nq))| + |log2(seq_k_bucket / bucket(Nk))| (ties: "
    "the larger seq_q_bucket). If none fits, take the `defaults` row of (gpu, dtype, "
    "out_dtype, causal, head_dim) with seq_q_bucket = clamp(pow2(Nq), 16, 256) and "
    "seq_k_bucket = clamp(pow2(Nk), 16, 256)."
)


@dataclass
class AotReport:
    path: Path
    gpus: list[str]
    kernels: int
    skipped: list[dict[str, Any]] = field(default_factory=list)


def signature(arg_names: list[str], dtype: str, head_dim: int, out_dtype: str | None = None,
              ) -> tuple[dict[str, str], dict[str, int], list[str]]:
    """(Triton signature, constexprs, names of arguments promised divisible by 16; pointers
    other than the descales are promised 16-byte aligned by the caller)."""
    fp8 = dtype == "fp8"
    units = FP8_UNIT_STRIDES if fp8 else UNIT_STRIDES
    sig: dict[str, str] = {}
    constexprs: dict[str, int] = {}
    divisible: list[str] = []
    for name in arg_names:
        if name == "O":
            sig[name] = f"*{out_dtype or (FP8_OUT[0] if fp8 else dtype)}"
        elif name in TENSORS:
            sig[name] = f"*{FP8_TRITON}" if fp8 else f"*{dtype}"
        elif name == "LSE" or name in DESCALES:
            sig[name] = "*fp32"
        elif name in units:
            sig[name], constexprs[name] = "constexpr", 1
        elif name == "sm_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            # Row, head and batch strides of a tensor with D % 16 == 0 are multiples of D in
            # every layout flashgen serves, so the promise costs nothing and buys vector loads.
            if name.startswith("stride_") and name[7] in "qkvo" and (
                    head_dim % 16 == 0 or (fp8 and name in FP8_V_DIVISIBLE)):
                divisible.append(name)
    return sig, constexprs, divisible


def constexprs_of(source: str) -> dict[str, Any]:
    """The `NAME: tl.constexpr = value` lines of the kernel body: what this binary fixed."""
    found: dict[str, Any] = {}
    for name, value in re.findall(r"^\s+([A-Z_]+): tl\.constexpr = (.+?)\s*$", source, re.M):
        found[name] = json.loads(value.replace("True", "true").replace("False", "false"))
    return found


def arg_names(source: str, function: str = "attn_fwd") -> list[str]:
    """The parameters of `function` in a rendered source, read without importing it."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return [a.arg for a in node.args.args]
    raise ValueError(f"no function {function} in the rendered source")


@dataclass
class _Job:
    kid: str
    variant: Variant
    problem: Problem
    gpu: GpuWinners
    source: str
    out_dtype: str
    serves: list[dict[str, Any]] = field(default_factory=list)


#: Seconds between two looks at how many jobs the workers have finished.
POLL_S = 0.5

#: `on_progress(done, total)`: compiled kernels so far, of all.
Progress = Callable[[int, int], None]


def run_workers(jobs: list[dict[str, Any]], workdir: Path, workers: int,
                on_progress: Progress | None = None) -> None:
    """Compile `jobs` (see `cubin_worker`) in up to `workers` fresh processes, telling
    `on_progress` of each job done (its metadata file written), 0 of them first: an export
    compiles for minutes. Each worker's output goes to a file in `workdir`, read when it
    fails (pipes read one worker after another could fill and stall the rest). If this
    process is stopped (Ctrl-C), its workers are stopped with it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    batches = [jobs[i::workers] for i in range(min(workers, len(jobs)))]
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    pending = [Path(job["metadata"]) for job in jobs]
    done = 0
    if on_progress is not None:
        on_progress(done, len(jobs))
    try:
        for i, batch in enumerate(batches):
            path, log = workdir / f"jobs{i}.json", workdir / f"worker{i}.log"
            path.write_text(json.dumps(batch))
            with log.open("wb") as out:
                procs.append((subprocess.Popen([sys.executable, str(WORKER), str(path)],
                                               env=env, stdout=out, stderr=subprocess.STDOUT),
                              log))
        while True:
            running = any(proc.poll() is None for proc, _ in procs)
            pending = [m for m in pending if not m.exists()]
            if on_progress is not None and len(jobs) - len(pending) != done:
                done = len(jobs) - len(pending)
                on_progress(done, len(jobs))
            if not running:
                break
            time.sleep(POLL_S)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, log in procs:
        if proc.returncode:
            output = log.read_text(errors="replace")
            raise RuntimeError(f"the AOT compile worker failed:\n{output[-4000:]}")


class _Compiler:
    """Collects each distinct (source, launch options, target) once, then compiles them all
    into `root/kernels`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.jobs: dict[str, _Job] = {}

    def kernel(self, variant: Variant, problem: Problem, gpu: GpuWinners,
               out_dtype: str | None = None) -> _Job:
        """The job of `variant` for `problem` on `gpu`; fp8 takes its `out_dtype` (O's
        pointer type is compiled in, so each out dtype is its own cubin)."""
        source = render(variant, problem)
        major, minor = gpu.device.capability
        out = out_dtype or problem.dtype
        # The out dtype joins the digest for fp8 only: other kernels keep their ids.
        tail = f"\0{out}" if problem.dtype == "fp8" else ""
        digest = hashlib.sha256(
            f"{source}\0{variant.num_warps}\0{variant.num_stages}{tail}".encode()
        ).hexdigest()[:12]
        kid = f"attn_fwd_{digest}_sm{major}{minor}"
        if kid not in self.jobs:
            self.jobs[kid] = _Job(kid, variant, problem, gpu, source, out)
        return self.jobs[kid]

    def compile(self, workers: int,
                on_progress: Progress | None = None) -> dict[str, dict[str, Any]]:
        """Compile every job: kernel id -> its manifest entry, or {"error": ...}."""
        specs = []
        for kid, job in self.jobs.items():
            base = self.root / "kernels" / kid
            base.with_suffix(".py").write_text(job.source, encoding="utf-8")
            sig, constexprs, divisible = signature(arg_names(job.source), job.problem.dtype,
                                                   job.problem.head_dim, job.out_dtype)
            specs.append({
                "source": str(base.with_suffix(".py")), "function": "attn_fwd",
                "signature": sig, "constexprs": constexprs,
                "divisible": [n for n, t in sig.items()
                              if t.startswith("*") and n not in DESCALES] + divisible,
                "capability": list(job.gpu.device.capability),
                "num_warps": job.variant.num_warps, "num_stages": job.variant.num_stages,
                "cubin": str(base.with_suffix(".cubin")),
                "metadata": str(base.with_suffix(".meta.json")),
            })
        with tempfile.TemporaryDirectory() as jobs_dir:
            run_workers(specs, Path(jobs_dir), workers, on_progress)
        entries = {}
        for spec, (kid, job) in zip(specs, self.jobs.items(), strict=True):
            meta_path = Path(spec["metadata"])
            meta = json.loads(meta_path.read_text())
            meta_path.unlink()
            entries[kid] = meta if "error" in meta else _entry(job, meta, spec)
        return entries


def manifest_arguments(sig: dict[str, str], divisible: list[str]) -> list[dict[str, Any]]:
    """The manifest's argument rows of a kernel: its non-constexpr signature, in order, with
    the promises (pointer alignment, divisibility) the cubin was compiled under."""
    rows = []
    for n, t in sig.items():
        if t == "constexpr":
            continue
        row: dict[str, Any] = {"name": n, "type": t}
        if t.startswith("*"):
            row["align"] = DESCALE_ALIGN if n in DESCALES else POINTER_ALIGN
        elif n in divisible:
            row["divisible_by"] = 16
        rows.append(row)
    return rows


def _entry(job: _Job, md: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    major, minor = job.gpu.device.capability
    v = job.variant
    return {
        "id": job.kid, "kernel_name": md["name"],
        "cubin": f"kernels/{job.kid}.cubin", "source": f"kernels/{job.kid}.py",
        "gpu": job.gpu.device.name, "capability": f"{major}.{minor}", "arch": f"sm{major}{minor}",
        "dtype": job.problem.dtype, "out_dtype": job.out_dtype, "causal": job.problem.causal,
        "head_dim": job.problem.head_dim, "variant": v.to_dict(),
        "abi": abi_of(job.problem.dtype),
        "constexprs": {**constexprs_of(job.source), **spec["constexprs"]},
        "arguments": manifest_arguments(spec["signature"], spec["divisible"]),
        # A persistent variant's programs stride over Q tiles by the grid's width, so the
        # full grid (one tile each) is correct for it too; C callers need no SM count.
        "grid": [f"cdiv(N_Q, {v.block_m})", "B * H_Q", "1"],
        "grid_rule": "(cdiv(N_Q, BLOCK_M), B * H_Q, 1)",
        "block": [md["threads"], 1, 1],
        "num_warps": md["threads"] // 32, "num_stages": v.num_stages,
        "num_ctas": md["num_ctas"],
        "shared_bytes": md["shared"],
        "global_scratch_bytes": md["global_scratch_size"],
        "global_scratch_align": md["global_scratch_align"],
        "profile_scratch_bytes": md["profile_scratch_size"],
        "profile_scratch_align": md["profile_scratch_align"],
        "launch_cooperative_grid": md["launch_cooperative_grid"],
        "launch_pdl": md["launch_pdl"],
        "need": list(tile_needs("fwd", v, job.problem)),
        "triton_version": md["triton_version"],
        "serves": job.serves,
    }


def abi_of(dtype: str) -> str:
    """The argument list a kernel of `dtype` takes: fp8's adds the descales."""
    return "fwd_fp8" if dtype == "fp8" else "fwd"


def _out_dtypes(dtype: str, fp8_out: Sequence[str]) -> Sequence[str]:
    """The output dtypes a kernel of `dtype` is compiled for: its own, or fp8's chosen ones."""
    return fp8_out if dtype == "fp8" else (dtype,)


def _bucket_row(gpu: GpuWinners, **fields: Any) -> dict[str, Any]:
    return {"gpu": gpu.device.name, "capability": "{}.{}".format(*gpu.device.capability),
            **fields}


def _why_twin(tuned: Variant, twin: Variant) -> str:
    """Why an AOT row runs another kernel than the tuned one: the reason for the manifest."""
    what = ("a Gluon (fa3) kernel that reads TMA tensor descriptors" if tuned.loop_order == "fa3"
            else "a Triton kernel that reads TMA tensor descriptors (use_tma)")
    return (f"the winner {tuned} is {what}; the C ABI passes plain pointers, not CUtensorMaps, "
            f"so its pointer twin {twin} (same function, plain loads) is compiled instead; "
            "the Python export runs the winner itself")


#: Why a GPU below sm89 gets no fp8 kernels (a tuning key there would be a foreign row).
NO_FP8 = "no fp8 tensor cores below compute capability 8.9"


def _plan_gpu(comp: _Compiler, gpu: GpuWinners, families: list[Family],
              manifest: dict[str, Any], fp8_out: Sequence[str] = FP8_OUT[:1]) -> None:
    """Queue `gpu`'s winners and defaults; fill the dispatch and defaults tables."""
    fp8_ok = gpu.device.capability >= (8, 9)
    for row in gpu.fwd:
        w, k = row.winner, row.winner.key
        variant: AnyVariant = w.variant
        # The buckets dispatch takes for the row (a file not yet migrated to m014's ladder
        # serves as a migrated one would).
        nq, nk = tuned_buckets(w.problem)
        bucket = {"dtype": k.dtype, "causal": k.causal, "head_dim": k.head_dim, "gqa": k.gqa,
                  "seq_q_bucket": nq, "seq_k_bucket": nk}
        if k.modifiers:
            manifest["skipped"].append(_bucket_row(
                gpu, **bucket, modifiers=k.modifiers, variant=variant.to_dict(),
                reason="tuned with modifiers (window, softcap, sinks) or packed sequences, "
                       "which the AOT format does not compile"))
            continue
        if k.dtype == "fp8" and not fp8_ok:
            manifest["skipped"].append(_bucket_row(gpu, **bucket, variant=variant.to_dict(),
                                                   reason=NO_FP8))
            continue
        if not isinstance(variant, Variant) or variant.loop_order == "fa1":
            manifest["skipped"].append(_bucket_row(
                gpu, **bucket, variant=variant.to_dict(),
                reason="fa1 needs scratch buffers; not compiled ahead of time (the defaults "
                       "serve this bucket)"))
            continue
        note: dict[str, Any] = {"tuned_variant": variant.to_dict(), "as_tuned": True}
        if variant.needs_tma:
            # The ABI passes pointers, not CUtensorMaps: the pointer twin (fa2 tiles for an fa3
            # winner) computes the same. The row says so, and why.
            twin = variant.pointer_twin()
            note.update(as_tuned=False, why_not=_why_twin(variant, twin))
            variant = twin
        for out in _out_dtypes(k.dtype, fp8_out):
            job = comp.kernel(variant, w.problem, gpu, out)
            job.serves.append({**bucket, "out_dtype": out})
            manifest["dispatch"].append(_bucket_row(
                gpu, **bucket, out_dtype=out, kernel=job.kid,
                need=list(tile_needs("fwd", variant, w.problem)),
                tuned_triton_version=gpu.triton_version, source=row.source(),
                kernel_hash=w.kernel_hash, **note))
    for family in families:
        if family[0] == "fp8" and not fp8_ok:
            manifest["skipped"].append(_bucket_row(
                gpu, dtype="fp8", causal=family[1], head_dim=family[2],
                reason=f"defaults: {NO_FP8}"))
            continue
        try:
            grid = default_grid("fwd", family, gpu.device)
        except NoDefault as exc:
            manifest["skipped"].append(_bucket_row(
                gpu, dtype=family[0], causal=family[1], head_dim=family[2],
                reason=f"defaults: {exc}"))
            continue
        for nq, nk, variant, problem in grid:
            assert isinstance(variant, Variant)
            for out in _out_dtypes(family[0], fp8_out):
                job = comp.kernel(variant.pointer_twin() if variant.needs_tma else variant,
                                  problem, gpu, out)
                manifest["defaults"].append(_bucket_row(
                    gpu, dtype=family[0], out_dtype=out, causal=family[1], head_dim=family[2],
                    seq_q_bucket=nq, seq_k_bucket=nk, kernel=job.kid))


def _drop_failed(manifest: dict[str, Any], entries: dict[str, dict[str, Any]]) -> None:
    """A tuned kernel that fails to compile is skipped with the compiler's message; a default
    that fails is a flashgen bug, so it stops the export."""
    failed = {kid: e["error"] for kid, e in entries.items() if "error" in e}
    for row in manifest["defaults"]:
        if row["kernel"] in failed:
            raise RuntimeError(f"default kernel {row['kernel']} failed: {failed[row['kernel']]}")
    kept = []
    for row in manifest["dispatch"]:
        if row["kernel"] in failed:
            manifest["skipped"].append({**row, "reason": failed[row["kernel"]]})
        else:
            kept.append(row)
    manifest["dispatch"] = kept
    manifest["kernels"] = [e for e in entries.values() if "error" not in e]
    lists: dict[str, list[str]] = {}
    for e in manifest["kernels"]:
        names = [a["name"] for a in e["arguments"]]
        if lists.setdefault(e["abi"], names) != names:  # the header's one struct per list
            raise RuntimeError(f"kernel {e['id']} breaks the {e['abi']} argument list")
    manifest["argument_lists"] = lists


def write_aot(selection: Selection, out: Path, name: str, force: bool = False,
              workers: int | None = None, fp8_out: Sequence[str] = FP8_OUT[:1],
              on_progress: Progress | None = None) -> AotReport:
    """Compile and write the AOT export `name` under `out` (see the module docstring);
    `fp8_out`: the output dtypes each fp8 kernel is compiled for; `on_progress` is told of
    the kernels compiled (`run_workers`)."""
    check_name(name, "export name")
    if not fp8_out or any(d not in FP8_OUT for d in fp8_out):
        raise ValueError(f"fp8 output dtypes must be some of {', '.join(FP8_OUT)}, got "
                         f"{', '.join(fp8_out) or 'none'}")
    fp8_out = tuple(dict.fromkeys(fp8_out))
    target = out / name
    check_target(target, force)
    gpus = [g for g in selection.gpus if g.device.name != CPU_INTERPRETER]
    skipped = [{"gpu": CPU_INTERPRETER, "reason": "the CPU interpreter has no GPU target"}
               for g in selection.gpus if g.device.name == CPU_INTERPRETER]
    if not gpus:
        raise ValueError("no GPU winners to compile (only the CPU interpreter was tuned)")
    workers = workers or min(8, os.cpu_count() or 1)
    manifest: dict[str, Any] = {
        "format": "flashgen-aot", "version": MANIFEST_VERSION,
        "flashgen_version": __version__, "triton_version": Versions.current().triton,
        "abi": ABI, "dispatch_rule": DISPATCH_RULE, "fp8_out_dtypes": list(fp8_out),
        "gpus": {g.device.name: {"capability": "{}.{}".format(*g.device.capability),
                                 "device_key": g.device_key,
                                 "tuned_triton_version": g.triton_version} for g in gpus},
        "kernels": [], "argument_lists": {}, "dispatch": [], "defaults": [],
        "skipped": skipped,
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        (tmp / "kernels").mkdir()
        comp = _Compiler(tmp)
        # The compiled GPUs' kinds only, and those asked for (`--kinds`).
        families = Selection(gpus, extra_families=selection.extra_families).families()
        for gpu in gpus:
            _plan_gpu(comp, gpu, families, manifest, fp8_out)
        _drop_failed(manifest, comp.compile(workers, on_progress))
        for entry in manifest["kernels"]:
            (tmp / "kernels" / f"{entry['id']}.json").write_text(json.dumps(entry, indent=1) + "\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        (tmp / f"{name}.h").write_text(c_header(name, manifest))
        shutil.copyfile(LOADER, tmp / "cuda_loader.py")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return AotReport(target, [g.device.name for g in gpus], len(manifest["kernels"]),
                     manifest["skipped"])


#: The header's comment on each argument list's struct.
ABI_NOTES = {
    "fwd": "Strides are in elements; the head-dim strides are compiled in as 1 and are not "
           "passed.",
    "fwd_fp8": "fp8 (e4m3) Q, K, V; O in the kernel's out_dtype. Strides are in elements; "
               "stride_qd, stride_kd, stride_od and V's key stride stride_vn are compiled in "
               "as 1 and not passed (V keys-inner, key rows padded to 16: fp8.quantize's "
               "layout). DQ, DK, DV: fp32 descales [b, h, n / 128] by their strides; a "
               "per-tensor descale is one float with strides 0 (manifest.json abi.fp8).",
}


def _c_abi(name: str, abi: str, arguments: list[dict[str, Any]]) -> str:
    """The argument struct and launch wrapper of one argument list (`abi`)."""
    fields = "\n".join(
        f"  {'CUdeviceptr' if a['type'].startswith('*') else C_TYPES[a['type']]} {a['name']};"
        for a in arguments)
    params = ", ".join(f"(void *)&a->{a['name']}" for a in arguments)
    return f"""\
/* Arguments of the kernels whose abi is "{abi}", in kernelParams order.
 * {ABI_NOTES[abi]} */
typedef struct {{
{fields}
}} {name}_{abi}_args;

/* Launch `k` (an "{abi}" kernel; its CUfunction `f`, loaded from k->cubin, with the dynamic
 * shared memory attribute set when k->shared_bytes > 49152) on `batch` x H_Q x N_Q queries.
 * `global_scratch`: 0 when k->global_scratch_bytes is 0, else device memory of
 * grid_x * grid_y * k->global_scratch_bytes bytes (grid as computed here; one CTA each). */
static inline CUresult {name}_launch_{abi}(CUfunction f, const {name}_kernel *k,
                                         const {name}_{abi}_args *a, int batch,
                                         CUdeviceptr global_scratch, CUstream stream) {{
  CUdeviceptr profile_scratch = 0;
  void *params[] = {{{params},
                    &global_scratch, &profile_scratch}};
  return cuLaunchKernel(f, (unsigned)((a->N_Q + k->block_m - 1) / k->block_m),
                        (unsigned)(batch * a->H_Q), 1, (unsigned)(32 * k->num_warps), 1, 1,
                        (unsigned)k->shared_bytes, stream, params, NULL);
}}
"""


def c_header(name: str, manifest: dict[str, Any]) -> str:
    """A C header: an argument struct and cuLaunchKernel wrapper per argument list (16-bit
    and fp8 kernels take different ones), and the kernel list."""
    kernels = manifest["kernels"]
    arguments = {}
    for k in kernels:  # one argument list per abi (`_drop_failed` checked the names agree)
        arguments.setdefault(k["abi"], k["arguments"])
    abis = "\n".join(_c_abi(name, abi, args) for abi, args in sorted(arguments.items()))
    rows = "\n".join(
        f'  {{"{k["id"]}", "{k["cubin"]}", "{k["kernel_name"]}", "{k["gpu"]}", '
        f'"{k["dtype"]}", "{k["out_dtype"]}", "{k["abi"]}", {int(k["causal"])}, '
        f'{k["head_dim"]}, {k["variant"]["block_m"]}, {k["num_warps"]}, {k["shared_bytes"]}, '
        f'{k["global_scratch_bytes"]}}},'
        for k in kernels)
    guard = f"{name.upper()}_H"
    return f"""\
/* {name}.h: flash-attention forward kernels compiled ahead of time by flashgen
 * {manifest["flashgen_version"]} with Triton {manifest["triton_version"]}. Which kernel serves
 * which problem: manifest.json ("dispatch", "defaults", "dispatch_rule"); the launch contract
 * and the promises the arguments must keep: manifest.json "abi". A kernel's `abi` names its
 * argument struct and launcher: {name}_<abi>_args, {name}_launch_<abi>. */
#ifndef {guard}
#define {guard}

#include <cuda.h>
#include <stdint.h>

typedef struct {{
  const char *id, *cubin, *kernel_name, *gpu, *dtype, *out_dtype, *abi;
  int causal, head_dim, block_m, num_warps, shared_bytes, global_scratch_bytes;
}} {name}_kernel;

static const {name}_kernel {name}_kernels[] = {{
{rows}
}};
#define {name.upper()}_NUM_KERNELS {len(kernels)}

{abis}
#endif /* {guard} */
"""
