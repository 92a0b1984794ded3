"""`flashgen export`: the Python package runs with only torch and triton; the AOT cubins,
manifest and header are produced without a GPU; on a GPU both run and match the reference."""

from __future__ import annotations

import ast
import ctypes
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import flashgen
from flashgen.cli import app
from flashgen.export.package import runtime_files
from flashgen.export.rows import (
    FWD_KEY_LENGTHS,
    GENERIC,
    LENGTHS,
    select_winners,
    tile_needs,
)
from flashgen.kernels.bwd_render import render_bwd
from flashgen.kernels.bwd_space import bwd_pointer_twin, default_bwd_variant, why_invalid_bwd
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.fwd_space import why_invalid
from flashgen.kernels.hardware import INTERPRETER, DeviceInfo
from flashgen.kernels.problem import DTYPES
from flashgen.store.db import TuningDB
from flashgen.store.keys import TuningKey
from flashgen.tune.check import compare, make_inputs
from flashgen.tune.grads import compare_grads
from flashgen.tune.timing import Timing

H200 = DeviceInfo("NVIDIA H200", (9, 0), 132, 232448)
#: Interpreter winners: fp32 causal GQA (fa1, so the fa1 launch path is exported too) and
#: fp16 full attention (fa2).
P_FP32 = flashgen.Problem(1, 2, 1, 64, 64, 32, "fp32", True)
V_FP32 = flashgen.Variant("fa1", 32, 16, 2, 1)
P_FP16 = flashgen.Problem(1, 2, 2, 32, 32, 16, "fp16", False)
V_FP16 = flashgen.Variant("fa2", 32, 32, 2, 1, use_tma=True)  # the interpreter emulates TMA
BWD_FP16 = BwdVariant(16, 32, 2, 1, "atomic")  # a backward winner, in the atomic-dQ mode
#: An fa3 (Gluon, TMA) winner on a Hopper GPU: ahead of time it is compiled as its fa2 twin.
P_FA3 = flashgen.Problem(1, 2, 2, 256, 256, 64, "bf16", False)
V_FA3 = flashgen.Variant("fa3", 128, 128, 4, 2)
#: An fp8 TMA winner on a Hopper GPU: ahead of time, its pointer twin with the fp8 arguments.
P_FP8 = flashgen.Problem(1, 2, 1, 256, 256, 32, "fp8", True)
V_FP8 = flashgen.Variant("fa2", 64, 32, 4, 2, use_tma=True)


def _store(path: Path, problem: flashgen.Problem, variant: Any, device: DeviceInfo,
           mode: str = "fwd", stale: bool = False) -> None:
    with TuningDB(path) as db:
        key = TuningKey.for_problem(problem, device, mode)
        db.record_trial(key, problem, variant, "ok", timing=Timing(1.0, 0.9, 1.1, 5), tflops=1.0)
        db.update_winner(key)
    if stale:  # as if a template edit had changed its kernel since
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE winners SET kernel_hash = 'other' WHERE key_id = ?", [key.id])


def _export(*args: str) -> str:
    result = CliRunner().invoke(app, ["export", *args])
    assert result.exit_code == 0, result.output
    return result.output


def _check_modified(pkg: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mods: dict[str, Any], do: torch.Tensor) -> None:
    """`pkg.attention` (causal) with modifiers `mods`, output, LSE and gradients (dsinks
    too) against the float64 reference."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    extra = {n: (m.clone().requires_grad_(True) if n == "sinks" else m) for n, m in mods.items()}
    out, lse = pkg.attention(*leaves, causal=True, return_lse=True, **extra)
    checked = compare(out.detach(), q, k, v, True, lse=lse, modifiers=mods)
    assert checked.ok, (mods, checked.reason)
    out.backward(do)
    grads = [t.grad for t in leaves] + ([extra["sinks"].grad] if "sinks" in extra else [])
    checked = compare_grads(tuple(grads), q, k, v, do, True, modifiers=mods)
    assert checked.ok, (mods, "backward", checked.reason)


def _import_from(folder: Path, name: str) -> ModuleType:
    """Package `name`, imported from `folder`."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


def _export_and_import(tmp_path: Path, name: str) -> ModuleType:
    """Export the winners of tmp_path/t.db as package `name` and import it from there."""
    _export("--db", str(tmp_path / "t.db"), "--out", str(tmp_path), "--name", name)
    return _import_from(tmp_path, name)


# ---- the Python package, run where flashgen and its tuning stack cannot be imported --------

#: Run in a fresh interpreter: blocks the tuning stack, imports three exported packages and
#: saves what each computed for the parent to check against flashgen's reference.
SCRIPT = r'''
import sys, warnings
BLOCKED = {"jinja2", "optuna", "sqlite_utils", "flashgen"}

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"blocked for this test: {name}")

sys.meta_path.insert(0, Block())
import torch

def imported(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = __import__(name)
    return module, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

def inputs(b, hq, hkv, nq, nk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(dtype)
            for h, n in ((hq, nq), (hkv, nk), (hkv, nk))]

res = {"warnings": {}, "runs": {}, "errors": {}}
fgk, res["warnings"]["fgk"] = imported("fgk")
cases = {  # name: (package, shape, dtype, causal, with gradients)
    "hit": (fgk, (1, 2, 1, 50, 60, 32), torch.float32, True, True),
    "nearest": (fgk, (1, 2, 1, 100, 120, 32), torch.float32, True, False),
    "miss": (fgk, (1, 2, 1, 9, 9, 32), torch.float32, True, False),
    "fp16_hit": (fgk, (1, 2, 2, 25, 30, 16), torch.float16, False, True),
    "fp16_unaligned": (fgk, (1, 2, 2, 25, 30, 16), torch.float16, False, False),
}
stale, res["warnings"]["stale"] = imported("fgk_stale")
other, res["warnings"]["other"] = imported("fgk_other")
cases["stale"] = (stale, (1, 2, 1, 50, 60, 32), torch.float32, True, False)
cases["other"] = (other, (1, 2, 1, 50, 60, 32), torch.float32, True, False)
later = warnings.catch_warnings(record=True)
res["later_warnings"] = later.__enter__()
warnings.simplefilter("always")
for i, (name, (pkg, shape, dtype, causal, grads)) in enumerate(cases.items()):
    q, k, v = inputs(*shape, dtype, seed=i)
    if name == "fp16_unaligned":  # rows of 17 halves: 34 bytes, too ragged for TMA
        q = torch.nn.functional.pad(q, (0, 1))[..., :16]
    choice = pkg.explain(q, k, v, causal=causal)
    run = {"q": q, "k": k, "v": v, "causal": causal, "how": choice.how,
           "reason": choice.reason, "variant": choice.variant}
    if grads:
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = pkg.attention(*leaves, causal=causal, return_lse=True)
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
        out.backward(do)
        run.update(out=out.detach(), lse=lse, do=do, grads=[t.grad for t in leaves],
                   bwd_how=choice.backward.how)
    else:
        run["out"], run["lse"] = pkg.attention(q, k, v, causal=causal, return_lse=True)
    res["runs"][name] = run
for name, call in {
    "rank": lambda: fgk.attention(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)),
    "family": lambda: fgk.attention(*inputs(1, 1, 1, 8, 8, 24, torch.float32, 0)),
}.items():
    try:
        call()
    except (TypeError, ValueError) as exc:
        res["errors"][name] = f"{type(exc).__name__}: {exc}"
q, k, v = inputs(1, 2, 1, 50, 60, 32, torch.float32, seed=7)
compiled = torch.compile(lambda q, k, v: fgk.attention(q, k, v, causal=True) * 2.0,
                         fullgraph=True, backend="aot_eager")
res["compiled"] = {"q": q, "k": k, "v": v, "out": compiled(q, k, v) / 2.0}
res["ops"] = [ns for ns in ("fgk", "fgk_ustale", "fgk_uother")
              if hasattr(getattr(torch.ops, ns), "attention_fwd")]
later.__exit__(None, None, None)
res["later_warnings"] = [str(w.message) for w in res["later_warnings"]
                         if "generic default" in str(w.message)]
res["leaked"] = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
torch.save(res, sys.argv[1])
'''


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Export the interpreter database, a copy tuned with 'another' Triton, and an H200-only
    one, then run SCRIPT on them with only the export dir and site-packages importable."""
    tmp = tmp_path_factory.mktemp("export")
    db, h200_db = tmp / "cpu.db", tmp / "h200.db"
    _store(db, P_FP32, V_FP32, INTERPRETER)
    _store(db, P_FP16, V_FP16, INTERPRETER)
    _store(db, P_FP16, BWD_FP16, INTERPRETER, mode="bwd")
    _store(h200_db, P_FP32, flashgen.Variant("fa2", 64, 32, 4, 2), H200)
    out = tmp / "out"
    _export("--db", str(db), "--out", str(out), "--name", "fgk")
    _export("--db", str(h200_db), "--out", str(out), "--name", "fgk_other")
    shutil.copytree(out / "fgk", out / "fgk_stale")
    table = json.loads((out / "fgk_stale" / "table.json").read_text())
    table["gpus"]["cpu-interpreter"]["triton_version"] = "0.0.1"
    (out / "fgk_stale" / "table.json").write_text(json.dumps(table))

    (tmp / "run.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # The export dir and the environment's site-packages only: not the repository.
    env.update(PYTHONPATH=os.pathsep.join([str(out), sysconfig.get_paths()["purelib"]]),
               TRITON_INTERPRET="1", PYTHONNOUSERSITE="1")
    run = subprocess.run([sys.executable, str(tmp / "run.py"), str(tmp / "res.pt")], cwd=out,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return {"out": out, "res": torch.load(tmp / "res.pt", weights_only=False)}


def _exported_runtime(exported: dict[str, Any]) -> ModuleType:
    """The exported package's runtime module, imported from the export folder."""
    sys.path.insert(0, str(exported["out"]))
    try:
        return importlib.import_module("fgk")
    finally:
        sys.path.remove(str(exported["out"]))


def test_export_replaces_only_an_earlier_export(tmp_path: Path) -> None:
    """From a user audit: `--force` deleted whatever folder stood at OUT/NAME (a project's
    code went with it), died with a traceback on a symbolic link, and called a file at
    OUT/NAME "a part of its folder path". A non-ASCII name exported but did not import, and
    a name of an installed module (torch's sympy) would shadow it."""
    db = tmp_path / "t.db"
    _store(db, P_FP16, V_FP16, INTERPRETER)
    runner = CliRunner()

    def export(name: str, *args: str) -> Any:
        return runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path),
                                   "--name", name, *args])

    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "code.py").write_text("x = 1\n")
    refused = export("project", "--force")
    assert refused.exit_code == 2 and "is not a flashgen export" in refused.output
    assert (mine / "code.py").read_text() == "x = 1\n"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    linked = export("link", "--force")
    assert linked.exit_code == 2 and "is a symbolic link" in linked.output
    assert (tmp_path / "elsewhere").is_dir()
    (tmp_path / "plain").write_text("notes\n")
    plain = export("plain")
    assert plain.exit_code == 2 and "is a file, not an export" in plain.output
    assert (tmp_path / "plain").read_text() == "notes\n"
    (tmp_path / "empty").mkdir()
    assert export("empty", "--force").exit_code == 0  # nothing of the user's in it
    assert export("empty", "--force").exit_code == 0  # an earlier export: replaced
    assert (tmp_path / "empty" / "table.json").is_file()
    accented = export("\u00dcn\u00ef")
    assert accented.exit_code == 2 and "ASCII" in accented.output
    shadow = export("sympy")  # installed with torch, which imports it
    assert shadow.exit_code == 2 and "shadow the installed module 'sympy'" in shadow.output


def test_op_namespaces_of_two_package_names_never_meet() -> None:
    """`vend.pkg` and `vend_pkg` shared one namespace, so one's compiled calls ran the
    other's kernels."""
    from flashgen.runtime.ops import op_namespace

    names = ("flashgen", "vend.pkg", "vend_pkg", "vend_dpkg", "a._b", "a_.b", "a__b")
    spelt = [op_namespace(n) for n in names]
    assert len(set(spelt)) == len(names) and op_namespace("flashgen") == "flashgen"
    assert all(s.replace("_", "").isalnum() for s in spelt)


@pytest.mark.interpreter
def test_package_layout(exported: dict[str, Any]) -> None:
    pkg = exported["out"] / "fgk"
    assert {p.name for p in pkg.iterdir() if p.name != "__pycache__"} == {
        "__init__.py", "table.json", "kernels", "runtime", "README.md"}
    sources = list((pkg / "kernels").glob("*.py"))
    assert any(p.name.startswith("fwd_") for p in sources)
    assert {p.name.split("_")[1] for p in sources if p.name.startswith("bwd_")} == {
        "preprocess", "dkdv", "dq"}
    for path in sources:
        assert "flashgen" not in path.read_text().replace("# flashgen generated", "")
    table = json.loads((pkg / "table.json").read_text())
    assert set(table["gpus"]) == {"cpu-interpreter"}
    assert len(table["gpus"]["cpu-interpreter"]["fwd"]) == 2
    tma = next(e for e in table["gpus"]["cpu-interpreter"]["fwd"] if e["variant"]["use_tma"])
    assert set(tma["kernels"]) == {"fwd", "fwd_plain"}
    (bwd,) = table["gpus"]["cpu-interpreter"]["bwd"]
    assert bwd["variant"] == BWD_FP16.to_dict() and "dq" not in bwd["kernels"]
    # Defaults for both exported kinds over the 5 x 9 forward length buckets (keys to 4096),
    # 5 x 5 backward ones, per GPU and generic.
    assert len(table["generic"]["fwd_defaults"]) == 2 * len(LENGTHS) * len(FWD_KEY_LENGTHS)
    assert len(table["generic"]["bwd_defaults"]) == 2 * len(LENGTHS) ** 2


@pytest.mark.interpreter
def test_runs_without_the_tuning_stack(exported: dict[str, Any]) -> None:
    res = exported["res"]
    assert res["leaked"] == []
    assert res["warnings"]["fgk"] == []
    runs = res["runs"]
    assert (runs["hit"]["how"], runs["hit"]["variant"]) == ("exact", V_FP32.to_dict())
    assert (runs["fp16_hit"]["how"], runs["fp16_hit"]["variant"]) == ("exact", V_FP16.to_dict())
    assert runs["nearest"]["how"] == "nearest"
    assert runs["miss"]["how"] == "fallback"  # fa1's 32-row tile is too long for 9 queries
    assert runs["fp16_unaligned"]["how"] == "exact"  # run by the TMA winner's pointer twin
    for name, r in runs.items():
        result = compare(r["out"], r["q"], r["k"], r["v"], r["causal"], lse=r["lse"])
        assert result.ok, (name, result.reason)
    # torch.compile traces the package's own op; each package registers its own namespace.
    r = res["compiled"]
    assert compare(r["out"], r["q"], r["k"], r["v"], True).ok
    assert res["ops"] == ["fgk", "fgk_ustale", "fgk_uother"]  # `op_namespace` of each


@pytest.mark.interpreter
def test_gradients_with_tuned_and_default_backward(exported: dict[str, Any]) -> None:
    for name, how in (("hit", "fallback"), ("fp16_hit", "exact")):
        r = exported["res"]["runs"][name]
        assert r["bwd_how"] == how
        result = compare_grads(tuple(r["grads"]), r["q"], r["k"], r["v"], r["do"], r["causal"])
        assert result.ok, (name, result.reason)


@pytest.mark.interpreter
def test_mismatch_warns_once_and_uses_generic_defaults(exported: dict[str, Any]) -> None:
    res = exported["res"]
    (stale,) = res["warnings"]["stale"]
    assert "tuned with Triton 0.0.1" in stale and "generic default" in stale
    (other,) = res["warnings"]["other"]
    assert "NVIDIA H200" in other and "cpu-interpreter" in other
    assert res["later_warnings"] == []  # once, at import: calls do not repeat it
    for name in ("stale", "other"):
        assert res["runs"][name]["how"] == "fallback"
        assert "generic default" in res["runs"][name]["reason"]


@pytest.mark.interpreter
def test_bad_inputs_are_named_errors(exported: dict[str, Any]) -> None:
    errors = exported["res"]["errors"]
    assert errors["rank"].startswith("ValueError: q must be 4-D")
    assert "no fwd kernel for fp32 causal=False head dim 24" in errors["family"]
    assert len(errors["family"]) < 500  # the kinds it holds: six named, then a count


# ---- what gets exported ---------------------------------------------------------------------


def test_precomputed_rules_match_flashgen() -> None:
    """The runtime's table lookups (default per clamped bucket, `need` per tile) give what
    flashgen's own default_variant and validity rules give, at any length."""
    lengths = (1, 9, 16, 17, 33, 100, 256, 300, 5000)
    for dtype, d in (("fp16", 128), ("fp32", 24), ("bf16", 256)):
        for nq in lengths:
            for nk in lengths:
                p = flashgen.Problem(1, 2, 1, nq, nk, d, dtype, True)
                clamp = lambda n: min(LENGTHS[-1], max(LENGTHS[0], 1 << (n - 1).bit_length()))
                grid_p = p.with_(seq_q=clamp(nq), seq_k=clamp(nk))
                for dev in (H200, GENERIC):
                    assert flashgen.default_variant(grid_p, dev) == flashgen.default_variant(p, dev)
                    assert default_bwd_variant(grid_p, dev) == default_bwd_variant(p, dev)
    p16 = lambda n: max(16, 1 << (n - 1).bit_length())
    p = flashgen.Problem(1, 1, 1, 512, 512, 64)
    for v in (flashgen.Variant("fa2", 128, 16), flashgen.Variant("fa1", 16, 64, 2, 1)):
        need_q, need_k = tile_needs("fwd", v, p)
        for nq in lengths:
            for nk in lengths:
                fits = p16(nq) >= need_q and p16(nk) >= need_k
                assert fits == (why_invalid(v, p.with_(seq_q=nq, seq_k=nk), H200) is None)
    for bv in (BwdVariant(32, 128, 4, 2), BwdVariant(64, 16, 2, 1, "atomic")):
        need_q, need_k = tile_needs("bwd", bv, p)
        for nq in lengths:
            for nk in lengths:
                fits = p16(nq) >= need_q and p16(nk) >= need_k
                assert fits == (why_invalid_bwd(bv, p.with_(seq_q=nq, seq_k=nk), H200) is None)


def test_selection_precedence_gpu_filter_and_stale_rows(tmp_path: Path) -> None:
    first, second = tmp_path / "a.db", tmp_path / "b.db"
    winner, loser = flashgen.Variant("fa2", 64, 32, 4, 2), flashgen.Variant("fa2", 32, 32, 4, 2)
    _store(first, P_FP16, winner, H200)
    _store(second, P_FP16, loser, H200)  # same bucket: the first database wins it
    _store(second, P_FP16, loser, INTERPRETER)
    _store(second, P_FP32, loser, H200, stale=True)
    _store(second, P_FP32, BwdVariant(32, 64, 4, 1), H200, mode="bwd")
    # A window problem's row of the same bucket: an entry of its own, and its set shipped.
    _store(first, P_FP16.with_(window=True), loser, H200)
    sel = select_winners([first, second], modifiers=["k"])
    assert [g.device.name for g in sel.gpus] == ["NVIDIA H200", "cpu-interpreter"]
    h200 = sel.gpus[0]
    assert {(s.winner.variant, s.winner.key.modifiers) for s in h200.fwd} == {
        (winner, ""), (loser, "w")}
    assert [s.winner.variant for s in h200.bwd] == [BwdVariant(32, 64, 4, 1)]
    assert h200.device.shared_memory == H200.shared_memory
    assert any("other template text" in n for n in sel.notes)
    assert sel.modifier_sets == ["k"]
    assert any("tuned with modifiers (window) ship as their own" in n for n in sel.notes)
    only = select_winners([first, second], gpu="cpu-interpreter")
    assert [g.device.name for g in only.gpus] == ["cpu-interpreter"]


def test_an_fa3_winner_ships_with_its_pointer_twin(tmp_path: Path) -> None:
    # The exported runtime launches the Gluon kernel on TMA-addressable inputs and the fa2
    # twin (same tiles and warps) on others, as flashgen's dispatch does.
    db = tmp_path / "h200.db"
    _store(db, P_FA3, V_FA3, H200)
    _export("--db", str(db), "--out", str(tmp_path), "--name", "fgk_fa3")
    table = json.loads((tmp_path / "fgk_fa3" / "table.json").read_text())
    (entry,) = [e for e in table["gpus"]["NVIDIA H200"]["fwd"] if e["variant"]["loop_order"]
                == "fa3"]
    fwd, twin = (tmp_path / "fgk_fa3" / "kernels" / f"{entry['kernels'][role]}.py"
                 for role in ("fwd", "fwd_plain"))
    assert "@gluon.jit" in fwd.read_text()
    assert twin.read_text() == flashgen.render(V_FA3.pointer_twin(), P_FA3)
    assert entry["twin"] == V_FA3.pointer_twin().to_dict()


def test_a_persistent_fa3_winner_names_its_twins_own_grid(tmp_path: Path) -> None:
    # The twin of a persistent 192-row fa3 winner is a plain 128-row fa2 kernel: the runtime
    # must size its grid from the twin, not from the winner (one program per tile).
    db = tmp_path / "h200.db"
    winner = flashgen.Variant("fa3", 192, 128, 4, 2, programs_per_sm=1, pingpong=True)
    _store(db, P_FA3, winner, H200)
    _export("--db", str(db), "--out", str(tmp_path), "--name", "fgk_p")
    table = json.loads((tmp_path / "fgk_p" / "table.json").read_text())
    (entry,) = table["gpus"]["NVIDIA H200"]["fwd"]
    assert entry["twin"]["programs_per_sm"] == 0 and entry["twin"]["block_m"] == 128


@pytest.mark.interpreter
def test_exported_fa3_winner_runs_its_twin_on_the_twins_grid(tmp_path: Path) -> None:
    """On rows TMA cannot address, the exported runtime runs a persistent fa3 winner's fa2
    twin, one program per Q tile: sized from the winner's persistent grid instead, it left
    every tile after the first unwritten (the interpreter counts as one SM)."""
    problem = flashgen.Problem(1, 2, 2, 300, 300, 16, "fp16", False)  # three 128-row tiles
    _store(tmp_path / "t.db", problem, flashgen.Variant("fa3", 128, 64, 4, 2, programs_per_sm=1),
           INTERPRETER)
    package = _export_and_import(tmp_path, "fgk_twin_grid")
    q, k, v = make_inputs(1, 2, 2, 300, 300, 16, torch.float16, seed=3)
    q = torch.nn.functional.pad(q, (0, 1))[..., :16]  # rows of 17 halves: too ragged for TMA
    assert package.explain(q, k, v).how == "exact"
    out, lse = package.attention(q, k, v, return_lse=True)
    result = compare(out, q, k, v, False, lse=lse)
    assert result.ok, result.reason


def test_an_fa3_backward_winner_ships_with_its_triton_twin(tmp_path: Path) -> None:
    db = tmp_path / "h200.db"
    winner, problem = BwdVariant(64, 128, 4, 2, fa3="both"), P_FA3.with_(head_dim=128)
    _store(db, problem, winner, H200, mode="bwd")
    _export("--db", str(db), "--out", str(tmp_path), "--name", "fgk_fa3_bwd")
    table = json.loads((tmp_path / "fgk_fa3_bwd" / "table.json").read_text())
    (entry,) = table["gpus"]["NVIDIA H200"]["bwd"]
    twin = bwd_pointer_twin(winner, problem, H200)
    assert entry["variant"] == winner.to_dict() and entry["twin"] == twin.to_dict()
    kernels = tmp_path / "fgk_fa3_bwd" / "kernels"

    def text(role: str) -> str:
        return (kernels / f"{entry['kernels'][role]}.py").read_text()

    for role in ("dkdv", "dq"):
        assert "@gluon.jit" in text(role)
        assert text(f"{role}_plain") == render_bwd(role, twin, problem)
    # On Hopper the D128 defaults are fa3 kernels too, each with its twin.
    defaults = table["gpus"]["NVIDIA H200"]["bwd_defaults"]
    assert "both" in {e["variant"]["fa3"] for e in defaults}  # short lengths: Triton
    assert all("twin" in e for e in defaults if e["variant"]["fa3"] != "none")


def test_cli_refusals(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    _store(db, P_FP16, V_FP16, INTERPRETER)
    runner = CliRunner()
    miss = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path), "--gpu", "B200"])
    assert miss.exit_code == 2 and "no current winners for GPU 'B200'" in miss.output
    _export("--db", str(db), "--out", str(tmp_path), "--name", "pkg")
    again = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path), "--name", "pkg"])
    assert again.exit_code == 2 and "--force" in again.output
    _export("--db", str(db), "--out", str(tmp_path), "--name", "pkg", "--force")
    bad = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path), "--name", "a-b"])
    assert bad.exit_code == 2 and "identifier" in bad.output
    keyword = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path), "--name",
                                  "import"])  # an identifier, but `import import` is no import
    assert keyword.exit_code == 2 and "identifier" in keyword.output
    fp8_out = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path), "--name",
                                  "pkg8", "--fp8-out", "fp16"])  # the python format's
    assert fp8_out.exit_code == 2 and "--fp8-out is for --format aot" in fp8_out.output
    ours = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path), "--name",
                               "flashgen"])
    assert ours.exit_code == 2 and "shadow" in ours.output
    for taken in ("os", "torch"):  # the standard library's and what the package imports
        hidden = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path),
                                     "--name", taken])
        assert hidden.exit_code == 2 and f"shadow the module {taken!r}" in hidden.output
    aot = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path), "--format", "aot"])
    assert aot.exit_code == 2 and "only the CPU interpreter" in aot.output
    fp32 = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path), "--format",
                               "aot", "--fp8-out", "bf16,fp32"])
    assert fp32.exit_code == 2 and "bf16, fp16, got bf16, fp32" in fp32.output
    for args, says in ((["--modifiers", "softcap,tilt"], "unknown modifier 'tilt'"),
                       (["--kinds", "bf16:300"], "not DTYPE:HEAD_DIM"),
                       (["--kinds", "bf17:64"], "not DTYPE:HEAD_DIM"),
                       (["--format", "aot", "--modifiers", "window"], "--modifiers is for")):
        refused = runner.invoke(app, ["export", "--db", str(db), "--out", str(tmp_path),
                                      "--name", "pkg_r", *args])
        assert refused.exit_code == 2 and says in refused.output, (args, refused.output)


@pytest.mark.interpreter
def test_kinds_ship_default_kernels_where_no_winner_is(tmp_path: Path) -> None:
    """`--kinds` gives a kind no winner covers its default grids: the call that was a named
    error (which says so) runs the default, matches the reference and trains."""
    _store(tmp_path / "t.db", P_FP16, V_FP16, INTERPRETER)
    plain = _export_and_import(tmp_path, "fgk_no_kinds")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 24, generator=gen) for _ in range(3))
    with pytest.raises(ValueError, match="--kinds fp32:24"):
        plain.attention(q, k, v)
    _export("--db", str(tmp_path / "t.db"), "--out", str(tmp_path), "--name", "fgk_kinds",
            "--kinds", "fp32:24")
    pkg = _import_from(tmp_path, "fgk_kinds")
    for causal in (False, True):
        assert pkg.explain(q, k, v, causal=causal).how == "fallback"
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = pkg.attention(*leaves, causal=causal)
        assert compare(out.detach(), q, k, v, causal).ok
        do = torch.randn(out.shape, generator=gen)
        out.backward(do)
        checked = compare_grads(tuple(t.grad for t in leaves), q, k, v, do, causal)
        assert checked.ok, checked.reason


# ---- AOT: cubins for a GPU this machine does not have --------------------------------------


def _load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"exported_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def aot_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("aot")
    db = tmp / "h200.db"
    _store(db, flashgen.Problem(1, 2, 1, 256, 256, 16, "fp16", True),
           flashgen.Variant("fa2", 64, 32, 4, 2), H200)
    _store(db, flashgen.Problem(1, 2, 1, 512, 512, 16, "fp16", True),
           flashgen.Variant("fa1", 64, 32, 4, 2), H200)
    _store(db, P_FA3, V_FA3, H200)
    _store(db, P_FP8, V_FP8, H200)
    _store(db, P_FP16, V_FP16, INTERPRETER)
    output = _export("--db", str(db), "--out", str(tmp), "--name", "fgaot", "--format", "aot")
    assert "NVIDIA H200" in output
    return tmp / "fgaot"


def test_aot_manifest_and_cubins(aot_export: Path) -> None:
    manifest = json.loads((aot_export / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"]) == ("flashgen-aot", 2)
    assert manifest["gpus"]["NVIDIA H200"]["capability"] == "9.0"
    tuned, fa3 = sorted((r for r in manifest["dispatch"] if r["dtype"] != "fp8"),
                        key=lambda r: r["head_dim"])
    assert (tuned["seq_q_bucket"], tuned["head_dim"], tuned["gqa"]) == (256, 16, 2)
    # The fa3 winner's cubin is its pointer twin: fa2 code, the same tiles and warps; the row
    # says per row that, and why, it is not the tuned kernel.
    assert (fa3["dtype"], fa3["head_dim"]) == ("bf16", 64)
    assert not fa3["as_tuned"] and "Gluon" in fa3["why_not"] and "twin" in fa3["why_not"]
    assert fa3["tuned_variant"]["loop_order"] == "fa3" and tuned["as_tuned"]
    reasons = [s["reason"] for s in manifest["skipped"]]
    assert any("fa1" in r for r in reasons) and any("interpreter" in r for r in reasons)
    assert not any("fp8" in r for r in reasons)
    # three kinds: D16 fp16, D64 bf16, D32 fp8 (bf16 out)
    assert len(manifest["defaults"]) == 3 * len(LENGTHS) ** 2
    kernels = {k["id"]: k for k in manifest["kernels"]}
    assert tuned["kernel"] in kernels and all(r["kernel"] in kernels for r in manifest["defaults"])
    twin = kernels[fa3["kernel"]]
    assert twin["grid"][0] == "cdiv(N_Q, 128)" and twin["block"] == [128, 1, 1]
    assert twin["constexprs"]["BLOCK_N"] == 128
    entry = kernels[tuned["kernel"]]
    assert entry == json.loads((aot_export / "kernels" / f"{entry['id']}.json").read_text())
    cubin = (aot_export / entry["cubin"]).read_bytes()
    assert cubin[:4] == b"\x7fELF" and entry["kernel_name"].encode() in cubin
    names = [a["name"] for a in entry["arguments"]]
    assert names[:5] == ["Q", "K", "V", "O", "LSE"] and names[-5:] == [
        "sm_scale", "N_Q", "N_K", "H_Q", "GROUP"]
    assert not set(names) & {"stride_qd", "stride_kd", "stride_vd", "stride_od"}
    types = {a["name"]: a for a in entry["arguments"]}
    assert types["Q"] == {"name": "Q", "type": "*fp16", "align": 16}
    assert types["stride_qn"] == {"name": "stride_qn", "type": "i32", "divisible_by": 16}
    assert types["N_K"] == {"name": "N_K", "type": "i32"}
    assert types["sm_scale"]["type"] == "fp32"
    assert entry["constexprs"]["BLOCK_M"] == 64 and entry["constexprs"]["stride_qd"] == 1
    assert (entry["abi"], entry["out_dtype"]) == ("fwd", "fp16")
    assert manifest["argument_lists"]["fwd"] == names
    assert entry["grid"] == ["cdiv(N_Q, 64)", "B * H_Q", "1"] and entry["block"] == [128, 1, 1]
    assert entry["shared_bytes"] > 0 and entry["global_scratch_bytes"] == 0
    assert [t["name"] for t in manifest["abi"]["trailing_arguments"]] == [
        "global_scratch", "profile_scratch"]


def test_aot_buckets_an_unmigrated_files_rows_by_their_tuned_lengths(tmp_path: Path) -> None:
    """A file keyed by powers of two (before m014) holds an N257 winner in its (512, 512)
    key: the AOT dispatch table puts it at (384, 384), as the runtime's dispatch and a
    migrated file do, and the export leaves the file unmigrated."""
    from test_db import _m013_file

    path = tmp_path / "m013.db"
    _m013_file(path)
    _export("--db", str(path), "--out", str(tmp_path), "--name", "fgold", "--format", "aot")
    manifest = json.loads((tmp_path / "fgold" / "manifest.json").read_text())
    rows = {(r["seq_q_bucket"], r["seq_k_bucket"]) for r in manifest["dispatch"]}
    assert rows == {(384, 384)}
    applied = sqlite3.connect(path).execute("SELECT name FROM _sqlite_migrations").fetchall()
    assert ("m014_length_ladder",) not in applied


def test_aot_loader_checks_without_a_gpu(aot_export: Path) -> None:
    loader = _load_module(aot_export / "cuda_loader.py")
    entry = json.loads((aot_export / "manifest.json").read_text())["kernels"][0]
    assert loader.grid_dim("cdiv(N_Q, 64)", {"N_Q": 130}) == 3
    assert loader.grid_dim("B * H_Q", {"B": 2, "H_Q": 8}) == 16
    args: dict[str, int | float] = {a["name"]: 16 for a in entry["arguments"]}
    loader.check_args(entry, args)
    for name, value, message in (("Q", 8, "aligned"), ("stride_qn", 24, "multiple of 16"),
                                 ("N_Q", 2**31, "does not fit"), ("stride_qd", 2, "compiled")):
        with pytest.raises(ValueError, match=message):
            loader.check_args(entry, {**args, name: value})


#: What an fp8 kernel compiles in as 1 and does not take: the head-dim strides of Q, K, O and
#: V's key stride (V keys-inner, `fp8.quantize`'s layout).
FP8_FIXED = {"stride_qd", "stride_kd", "stride_vn", "stride_od"}


def _signature_names(source: str) -> list[str]:
    """The parameters of `attn_fwd` in a rendered kernel, parsed here (not by the export)."""
    (fn,) = [n for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.FunctionDef) and n.name == "attn_fwd"]
    return [a.arg for a in fn.args.args]


def test_aot_fp8_kernels_and_their_argument_list(aot_export: Path) -> None:
    """fp8 winners and defaults are compiled (the TMA winner as its pointer twin); each fp8
    kernel's manifest arguments are its signature's runtime parameters in order, and the
    header's fp8 struct lists the same."""
    manifest = json.loads((aot_export / "manifest.json").read_text())
    (row,) = [r for r in manifest["dispatch"] if r["dtype"] == "fp8"]
    assert (row["head_dim"], row["causal"], row["out_dtype"]) == (32, True, "bf16")
    assert not row["as_tuned"] and "use_tma" in row["why_not"] and "twin" in row["why_not"]
    defaults = [r for r in manifest["defaults"] if r["dtype"] == "fp8"]
    assert len(defaults) == len(LENGTHS) ** 2 and {r["out_dtype"] for r in defaults} == {"bf16"}
    assert manifest["fp8_out_dtypes"] == ["bf16"]
    fp8 = {k["id"]: k for k in manifest["kernels"] if k["dtype"] == "fp8"}
    assert set(fp8) == {row["kernel"]} | {r["kernel"] for r in defaults}
    assert fp8[row["kernel"]]["variant"] == V_FP8.pointer_twin().to_dict()
    for entry in fp8.values():
        assert (entry["abi"], entry["out_dtype"]) == ("fwd_fp8", "bf16")
        cubin = (aot_export / entry["cubin"]).read_bytes()
        assert cubin[:4] == b"\x7fELF" and entry["kernel_name"].encode() in cubin
        params = _signature_names((aot_export / entry["source"]).read_text())
        names = [a["name"] for a in entry["arguments"]]
        assert names == [n for n in params if n not in FP8_FIXED]
        assert all(entry["constexprs"][n] == 1 for n in FP8_FIXED)
        assert names == manifest["argument_lists"]["fwd_fp8"]
    assert names[24:] == ["DQ", "DK", "DV", *(f"stride_d{t}{s}" for t in "qkv" for s in "bhn")]
    types = {a["name"]: a for a in entry["arguments"]}
    assert types["Q"] == types["V"] | {"name": "Q"} == {"name": "Q", "type": "*fp8e4nv",
                                                       "align": 16}
    assert types["O"]["type"] == "*bf16" and types["LSE"]["type"] == "*fp32"
    assert types["DQ"] == {"name": "DQ", "type": "*fp32", "align": 4}
    assert types["stride_dqn"] == {"name": "stride_dqn", "type": "i32"}  # 0: per-tensor
    assert types["stride_vd"]["divisible_by"] == 16 and types["stride_qn"]["divisible_by"] == 16
    header = (aot_export / "fgaot.h").read_text()
    struct = re.search(r"typedef struct \{\n([^}]*)\n\} fgaot_fwd_fp8_args;", header)
    assert struct is not None
    assert [line.split()[-1].rstrip(";") for line in struct[1].splitlines()] == names
    assert "fgaot_launch_fwd_fp8(" in header and '"fp8", "bf16", "fwd_fp8"' in header


def test_aot_loader_packs_fp8_arguments(aot_export: Path) -> None:
    loader = _load_module(aot_export / "cuda_loader.py")
    manifest = json.loads((aot_export / "manifest.json").read_text())
    entry = next(k for k in manifest["kernels"] if k["abi"] == "fwd_fp8")
    args: dict[str, int | float] = {a["name"]: 16 for a in entry["arguments"]}
    args.update(DQ=4, stride_dqb=0, stride_dqh=0, stride_dqn=0, sm_scale=0.125)
    loader.check_args(entry, {**args, "stride_vn": 1})
    values = loader.pack_args(entry, args)
    assert len(values) == len(entry["arguments"]) == 36
    kinds = {a["name"]: type(v) for a, v in zip(entry["arguments"], values, strict=True)}
    assert kinds["V"] is kinds["DQ"] is ctypes.c_uint64 and kinds["stride_dvn"] is ctypes.c_int32
    assert values[-12].value == 4 and kinds["sm_scale"] is ctypes.c_float
    for name, value, message in (("stride_vn", 64, "compiled"), ("DQ", 2, "aligned"),
                                 ("stride_vd", 40, "multiple of 16"), ("V", 8, "aligned")):
        with pytest.raises(ValueError, match=message):
            loader.check_args(entry, {**args, name: value})


def test_aot_fp8_out_dtypes_and_gpus_without_fp8(tmp_path: Path) -> None:
    """Each fp8 out dtype is its own kernel (O's type is compiled in) with its own rows; an
    fa3 fp8 winner runs its fa2 twin; a GPU below sm89 gets no fp8 kernels. Planned only:
    nothing is compiled."""
    from flashgen.export.aot import NO_FP8, _Compiler, _plan_gpu, arg_names, signature

    db = tmp_path / "t.db"
    _store(db, flashgen.Problem(1, 2, 2, 256, 256, 64, "fp8", False), V_FA3, H200)
    a100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912)
    _store(db, flashgen.Problem(1, 2, 2, 256, 256, 64, "fp8", False),
           flashgen.Variant("fa2", 64, 32, 4, 2), a100)
    sel = select_winners([db])
    comp = _Compiler(tmp_path)
    manifest: dict[str, Any] = {"dispatch": [], "defaults": [], "skipped": []}
    for gpu in sel.gpus:
        _plan_gpu(comp, gpu, sel.families(), manifest, ("bf16", "fp16"))
    rows = {r["out_dtype"]: r for r in manifest["dispatch"]}
    assert set(rows) == {"bf16", "fp16"} and rows["bf16"]["kernel"] != rows["fp16"]["kernel"]
    assert {r["gpu"] for r in manifest["dispatch"] + manifest["defaults"]} == {"NVIDIA H200"}
    assert len(manifest["defaults"]) == 2 * len(LENGTHS) ** 2
    assert all(j.variant.loop_order == "fa2" and not j.variant.use_tma
               for j in comp.jobs.values())
    assert len({j.out_dtype for j in comp.jobs.values()}) == 2
    assert len(comp.jobs) == 2 * len({(j.source, j.variant) for j in comp.jobs.values()})
    job = comp.jobs[rows["fp16"]["kernel"]]
    sig, _, _ = signature(arg_names(job.source), "fp8", 64, job.out_dtype)
    assert (sig["O"], sig["Q"], sig["DV"]) == ("*fp16", "*fp8e4nv", "*fp32")
    assert [s["reason"] for s in manifest["skipped"]] == [NO_FP8, f"defaults: {NO_FP8}"]


def test_aot_header_compiles(aot_export: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    import triton

    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    main = aot_export.parent / "main.c"
    main.write_text('#include "fgaot.h"\nint main(void) { fgaot_fwd_args a = {0}; '
                    "fgaot_fwd_fp8_args f = {0}; return "
                    "fgaot_launch_fwd(0, &fgaot_kernels[0], &a, 1, 0, 0) != CUDA_SUCCESS || "
                    "fgaot_launch_fwd_fp8(0, &fgaot_kernels[0], &f, 1, 0, 0) != CUDA_SUCCESS; }\n")
    run = subprocess.run([compiler, "-std=c99", "-Wall", "-Werror", "-fsyntax-only",
                          f"-I{aot_export}", f"-I{include}", str(main)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# ---- on a GPU -------------------------------------------------------------------------------


def _fwd_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, scale: float) -> dict[str, int | float]:
    """The kernel arguments by manifest name, from torch tensors (strides in elements)."""
    args: dict[str, int | float] = {n: t.data_ptr() for n, t in
                                    zip("QKVO", (q, k, v, out), strict=True)}
    args["LSE"] = lse.data_ptr()
    for letter, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        args.update(zip((f"stride_{letter}{s}" for s in "bhnd"), t.stride(), strict=True))
    args.update(stride_lb=lse.stride(0), stride_lh=lse.stride(1), sm_scale=scale,
                N_Q=q.shape[2], N_K=k.shape[2], H_Q=q.shape[1], GROUP=q.shape[1] // k.shape[1])
    return args


def _aot_on_this_gpu(tmp_path: Path, problem: flashgen.Problem, variant: flashgen.Variant,
                     dev: DeviceInfo, *options: str,
                     ) -> tuple[Path, ModuleType, list[tuple[str, tuple[int, int]]]]:
    """Export `variant` tuned on `dev` as AOT: (root, its loader, [(kernel id, (Nq, Nk))]
    for the tuned kernel at 300 x 333 and the default of bucket (32, 32) at 20 x 27)."""
    _store(tmp_path / "t.db", problem, variant, dev)
    _export("--db", str(tmp_path / "t.db"), "--out", str(tmp_path), "--name", "fgaot",
            "--format", "aot", *options)
    root = tmp_path / "fgaot"
    manifest = json.loads((root / "manifest.json").read_text())
    (tuned,) = manifest["dispatch"]
    short = next(r for r in manifest["defaults"]
                 if (r["seq_q_bucket"], r["seq_k_bucket"]) == (32, 32))
    return root, _load_module(root / "cuda_loader.py"), [(tuned["kernel"], (300, 333)),
                                                         (short["kernel"], (20, 27))]


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "d", "causal", "variant", "layout"), [
    ("fp16", 64, True, flashgen.Variant("fa2", 128, 64, 4, 3), "bhnd"),
    ("bf16", 128, False, flashgen.Variant("fa2", 128, 64, 8, 3, True, True), "bnhd"),
    ("fp32", 80, True, flashgen.Variant("fa2", 64, 32, 4, 2), "bhnd"),
])
def test_gpu_aot_cubin_through_the_driver_api(tmp_path: Path, dtype: str, d: int, causal: bool,
                                              variant: flashgen.Variant, layout: str) -> None:
    """Compile for this GPU as `export --format aot` does, then launch the cubin with ctypes
    and the driver API only (no Triton on the launch path), tuned kernel and a default."""
    dev = flashgen.device_info("cuda")
    if variant.warp_specialize and not dev.is_hopper:
        pytest.skip("warp specialization needs Hopper")
    problem = flashgen.Problem(2, 4, 2, 512, 512, d, dtype, causal)
    root, loader, runs = _aot_on_this_gpu(tmp_path, problem, variant, dev)
    torch_dtype = DTYPES[dtype]
    for kid, (nq, nk) in runs:
        q, k, v = make_inputs(2, 4, 2, nq, nk, d, torch_dtype, "cuda", seed=nq, layout=layout)
        out = torch.empty_like(q)
        lse = torch.empty((2, 4, nq), device="cuda", dtype=torch.float32)
        kernel = loader.Kernel.load(root, kid, torch.cuda.current_device())
        grid = kernel.grid(B=2, N_Q=nq, H_Q=4)
        kernel.launch(grid, _fwd_args(q, k, v, out, lse, 1 / math.sqrt(d)),
                      torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        result = compare(out, q, k, v, causal, lse=lse)
        assert result.ok, (kid, result.reason)
        kernel.unload()


@pytest.mark.gpu
@pytest.mark.parametrize(("causal", "variant", "per_tensor", "out_dtype"), [
    (True, flashgen.Variant("fa2", 64, 64, 4, 3), False, "bf16"),
    (False, flashgen.Variant("fa2", 128, 64, 8, 3, use_tma=True), True, "fp16"),
])
def test_gpu_aot_fp8_cubin_through_the_driver_api(tmp_path: Path, causal: bool,
                                                  variant: flashgen.Variant, per_tensor: bool,
                                                  out_dtype: str) -> None:
    """An fp8 winner (a TMA one runs its pointer twin) and an fp8 default, launched through
    the loader on `fp8.quantize`'s output (V keys-inner), block and per-tensor descales, match
    flashgen's own fp8 attention and pass the fp8 gate."""
    from flashgen.fp8 import quantize
    from flashgen.runtime.modifiers import Fp8
    from flashgen.tune.check import compare_fp8

    dev = flashgen.device_info("cuda")
    if dev.capability < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9 or later")
    problem = flashgen.Problem(2, 4, 2, 512, 512, 64, "fp8", causal)
    root, loader, runs = _aot_on_this_gpu(tmp_path, problem, variant, dev, "--fp8-out",
                                          out_dtype)
    torch_out = DTYPES[out_dtype]
    for kid, (nq, nk) in runs:
        gen = torch.Generator(device="cuda").manual_seed(nq)
        q = torch.randn(2, 4, nq, 64, device="cuda", generator=gen)
        k, v = (torch.randn(2, 2, nk, 64, device="cuda", generator=gen) for _ in range(2))
        qz = quantize(q, k, v, block=None if per_tensor else 128)
        assert qz.v.stride(2) == 1  # keys inner, as the fp8 ABI takes it
        out = torch.empty(q.shape, device="cuda", dtype=torch_out)
        lse = torch.empty((2, 4, nq), device="cuda", dtype=torch.float32)
        # flashgen's runtime view of the descales: (B, H, blocks), a per-tensor one expanded
        # with zero strides; the ABI takes exactly that.
        scales = Fp8.of(qz.q, qz.k, (qz.descale_q, qz.descale_k, qz.descale_v), torch_out, 128)
        args = _fwd_args(qz.q, qz.k, qz.v, out, lse, 1 / math.sqrt(64))
        for name, t in zip(("DQ", "DK", "DV"), (scales.descale_q, scales.descale_k,
                                                scales.descale_v), strict=True):
            args[name] = t.data_ptr()
            args.update(zip((f"stride_d{name[1].lower()}{s}" for s in "bhn"), t.stride(),
                            strict=True))
        kernel = loader.Kernel.load(root, kid, torch.cuda.current_device())
        kernel.launch(kernel.grid(B=2, N_Q=nq, H_Q=4), args,
                      torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        checked = compare_fp8(out, qz, causal=causal, block=None if per_tensor else 128)
        assert checked.ok, (kid, checked.reason)
        ours = flashgen.attention(qz.q, qz.k, qz.v, causal=causal, descale_q=qz.descale_q,
                                  descale_k=qz.descale_k, descale_v=qz.descale_v,
                                  out_dtype=torch_out)
        assert (out.double() - ours.double()).abs().max().item() <= checked.bound, kid
        assert torch.isfinite(lse).all()
        kernel.unload()


GPU_EXPORTED = [flashgen.Variant("fa2", 128, 32, 4, 2),
                flashgen.Variant("fa2", 128, 64, 4, 3, use_tma=True),
                flashgen.Variant("fa3", 128, 128, 4, 3),
                flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1)]


@pytest.mark.gpu
@pytest.mark.parametrize("tuned", GPU_EXPORTED, ids=str)
def test_gpu_python_export_hit_miss_and_training(tmp_path: Path,
                                                 tuned: flashgen.Variant) -> None:
    dev = flashgen.device_info("cuda")
    if tuned.needs_tma and not dev.is_hopper:
        pytest.skip("TMA and fa3 need Hopper")
    problem = flashgen.Problem(2, 8, 2, 1024, 1024, 64, "fp16", True)
    _store(tmp_path / "t.db", problem, tuned, dev)
    fgk_gpu = _export_and_import(tmp_path, f"fgk_gpu_{GPU_EXPORTED.index(tuned)}")
    for n, how in ((1000, "exact"), (3000, "nearest"), (40, "fallback")):
        q, k, v = make_inputs(2, 8, 2, n, n, 64, torch.float16, "cuda", seed=n)
        choice = fgk_gpu.explain(q, k, v, causal=True)
        assert choice.how == how, choice
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = fgk_gpu.attention(*leaves, causal=True, return_lse=True)
        result = compare(out.detach(), q, k, v, True, lse=lse)
        assert result.ok, (n, result.reason)
        do = torch.randn_like(out)
        out.backward(do)
        grads = compare_grads(tuple(t.grad for t in leaves), q, k, v, do, True)
        assert grads.ok, (n, grads.reason)


@pytest.mark.gpu
@pytest.mark.parametrize("tuned", GPU_EXPORTED[2:], ids=str)
def test_gpu_python_export_with_modifiers_trains(tmp_path: Path, tuned: flashgen.Variant) -> None:
    """Exported with `--modifiers`, a Hopper winner's kernels run window, softcap and sinks
    (the persistent one refuses them, so the sets' default grids serve), packed sequences
    and the decode family's window, forward and backward, against the float64 reference."""
    from flashgen.kernels.problem import DecodeProblem
    from flashgen.tune.decode_bench import compare_kvcache, make_kvcache

    dev = flashgen.device_info("cuda")
    if not dev.is_hopper:
        pytest.skip("fa3 needs Hopper")
    problem = flashgen.Problem(2, 8, 2, 1024, 1024, 64, "bf16", True)
    _store(tmp_path / "t.db", problem, tuned, dev)
    name = f"fgk_gpu_mods_{GPU_EXPORTED.index(tuned)}"
    _export("--db", str(tmp_path / "t.db"), "--out", str(tmp_path), "--name", name,
            "--modifiers", "window,softcap,sinks,varlen")
    fgk = _import_from(tmp_path, name)
    q, k, v = make_inputs(2, 8, 2, 1000, 1000, 64, torch.bfloat16, "cuda", seed=3)
    sinks = torch.randn(8, device="cuda")
    if tuned.programs_per_sm:  # refused by the persistent kernel: its one-tile form runs
        assert "one-tile" in fgk.explain(q, k, v, causal=True, window=(100, 0)).reason
    for mods in ({"window": (100, 0)}, {"softcap": 20.0}, {"sinks": sinks}):
        _check_modified(fgk, q, k, v, mods, torch.randn_like(q))
    cu = torch.tensor([0, 300, 1000, 1700], dtype=torch.int32, device="cuda")
    pq, pk, pv = (t.reshape(-1, t.shape[2], 64)[:1700].contiguous()
                  for t in (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    packed = [t.clone().requires_grad_(True) for t in (pq, pk, pv)]
    out = fgk.attention_varlen(*packed, cu, cu, 700, 700, causal=True)
    offsets = (cu.tolist(), cu.tolist())
    checked = compare(out.detach(), pq, pk, pv, True, cu=offsets)
    assert checked.ok, ("varlen", checked.reason)
    dout = torch.randn_like(out)
    out.backward(dout)
    checked = compare_grads(tuple(t.grad for t in packed), pq, pk, pv, dout, True, cu=offsets)
    assert checked.ok, ("varlen backward", checked.reason)
    c = make_kvcache(DecodeProblem(4, 8, 2, 1, 4096, 64, "bf16", True), "cuda",
                     seqlens=[4096, 1000, 17, 2500])
    out = fgk.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, window=(511, 0))
    checked = compare_kvcache(out, c, True, modifiers={"window": (511, 0)})
    assert checked.ok, ("decode window", checked.reason)


@pytest.mark.gpu
def test_gpu_exported_gluon_dq_on_its_own_tiles_trains(tmp_path: Path) -> None:
    """A backward winner whose Gluon dQ kernel streams its own tile (dq_block_streamed) runs from
    the exported package with that tile's TMA descriptors, aligned and not."""
    dev = flashgen.device_info("cuda")
    if not dev.is_hopper:
        pytest.skip("the Gluon backward kernels need Hopper")
    problem = flashgen.Problem(2, 8, 2, 1024, 1024, 64, "fp16", True)
    winner = BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=128)
    _store(tmp_path / "t.db", problem, winner, dev, mode="bwd")
    fgk = _export_and_import(tmp_path, "fgk_gpu_dq")
    for n, pad in ((1000, 0), (700, 3)):  # pad 3: rows TMA cannot address, the twin runs
        padded = make_inputs(2, 8, 2, n, n, 64 + pad, torch.float16, "cuda", seed=n)
        leaves = [t.clone().requires_grad_(True) for t in padded]
        q, k, v = (t[..., :64] for t in leaves)  # views: row strides of 64 + pad elements
        assert all(t.stride(-2) == 64 + pad for t in (q, k, v))
        out = fgk.attention(q, k, v, causal=True)
        do = torch.randn_like(out)
        out.backward(do)
        grads = compare_grads(tuple(t.grad[..., :64] for t in leaves), *(t.detach() for t in
                              (q, k, v)), do, True)
        assert grads.ok, (n, grads.reason)


GLUON_BWD_WINNERS = [BwdVariant(32, 128, 4, 3, fa3="dq", dq_block_streamed=128),
                     BwdVariant(64, 128, 4, 2, fa3="both", dq_block_streamed=128),
                     BwdVariant(64, 128, 4, 3, fa3="both"),
                     # the D64 shipped winners' 128-row dK/dV step, dQ on 64-key tiles
                     BwdVariant(128, 128, 4, 2, fa3="both", dq_block_streamed=64)]


@pytest.mark.parametrize("winner", GLUON_BWD_WINNERS, ids=str)
def test_exported_gluon_backward_uses_the_winners_tiles(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        winner: BwdVariant) -> None:
    """An exported Gluon backward winner reaches its kernels with the TMA tiles its knobs
    give (dq_block_streamed included): 64 rows per owned tensor, the kernel's streamed tile
    (`BwdVariant.streamed`) per streamed one. Checked without a GPU: the package's table is
    served with its device name faked, and descriptors and launches are recorded."""
    _store(tmp_path / "t.db", P_FA3, winner, H200, mode="bwd")
    package = _export_and_import(tmp_path, f"fgk_rows_{GLUON_BWD_WINNERS.index(winner)}")
    runtime = sys.modules[f"{package.__name__}.runtime.package"]
    launches: dict[str, tuple[Any, ...]] = {}

    class Recorder:
        def __init__(self, role: str) -> None:
            self.role = role

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda *args, **kw: launches.__setitem__(self.role, args)

    monkeypatch.setattr(runtime, "device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(sys.modules[f"{package.__name__}.runtime.backward"], "gluon_descriptor",
                        lambda t, rows, cols=None: ("tma", rows))
    monkeypatch.setattr(runtime.PackageDispatcher, "kernel",
                        lambda self, entry, role, shape: Recorder(role))
    # The kernels are recorded, never run, so the interpreter's refusal of bf16 (its dots are
    # wrong) does not apply to this bf16 winner's launch arguments.
    monkeypatch.setattr(sys.modules[f"{package.__name__}.runtime.dispatch"], "check_runnable",
                        lambda device, dtype=None: None)
    q, k, v = make_inputs(1, 2, 2, 256, 256, 64, torch.bfloat16, seed=4)
    lse = torch.zeros(1, 2, 256)
    dispatcher = runtime.PackageDispatcher()
    assert dispatcher.explain(q, k, v).backward.how == "exact"
    saved = sys.modules[f"{package.__name__}.runtime.dispatch"].Saved
    dispatcher.backward(torch.randn_like(q), saved(q, k, v, torch.empty_like(q), lse), False,
                        0.125)
    for kernel in ("dkdv", "dq"):
        rows = tuple(a[1] for a in launches[kernel] if isinstance(a, tuple) and a[:1] == ("tma",))
        s = winner.streamed(kernel)
        want = (s, 64, 64, s, 64, 64) if kernel == "dkdv" else (64, s, s, 64, 64)
        assert rows == (want if winner.gluon(kernel) else ()), kernel


# ---- one runtime ----------------------------------------------------------------------------


@pytest.mark.interpreter
def test_the_package_runs_flashgens_runtime_verbatim(exported: dict[str, Any]) -> None:
    """The package's Python files are its kernel sources, flashgen's runtime byte for byte,
    and one short generated __init__.py."""
    pkg = exported["out"] / "fgk"
    ours = {p.name: p.read_bytes() for p in runtime_files()}
    theirs = {p.name: p.read_bytes() for p in (pkg / "runtime").glob("*.py")}
    assert theirs == ours
    python = {p.relative_to(pkg) for p in pkg.rglob("*.py") if "__pycache__" not in p.parts}
    kernels = {p for p in python if p.parts[0] == "kernels"}
    assert kernels and python - kernels == {Path("runtime", n) for n in ours} | {
        Path("__init__.py")}
    assert len((pkg / "__init__.py").read_text().splitlines()) <= 40


def test_the_runtime_imports_only_torch_triton_and_the_standard_library() -> None:
    allowed = {"torch", "triton", *sys.stdlib_module_names}
    for path in runtime_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.partition(".")[0] in allowed, f"{path.name} imports {name}"


@pytest.mark.interpreter
def test_decode_winners_ship_and_run(tmp_path: Path) -> None:
    """A decode winner (paged, 16-key pages) ships with both decode kernels; the package
    serves it exactly, and a contiguous cache of the same kind from the default grid."""
    from dataclasses import replace

    from flashgen.kernels.decode_variant import DecodeVariant
    from flashgen.kernels.problem import DecodeProblem
    from flashgen.tune.decode_bench import compare_kvcache, make_kvcache

    problem = DecodeProblem(2, 8, 2, 1, 48, 16, "fp32", True, page_size=16)
    variant = DecodeVariant(16, 16, 3, 1, 1)
    _store(tmp_path / "t.db", problem, variant, INTERPRETER, mode="decode")
    pkg = _export_and_import(tmp_path, "fgk_decode")
    table = json.loads((tmp_path / "fgk_decode" / "table.json").read_text())
    (tuned,) = table["gpus"]["cpu-interpreter"]["decode"]
    assert tuned["variant"] == variant.to_dict() and tuned["page_size"] == 16
    assert set(tuned["kernels"]) == {"decode", "decode_combine"}
    assert len(table["generic"]["decode_defaults"]) == 3 * 4  # rows x page sizes, one kind
    dispatcher = pkg.runtime.dispatch.default_dispatcher()
    for p, how in ((problem, "exact"), (replace(problem, page_size=0), "fallback")):
        c = make_kvcache(p, seqlens=[48, 21])
        out, lse = pkg.attention_with_kvcache(c.q, c.k, c.v, c.seqlens,
                                              block_table=c.block_table, return_lse=True)
        assert dispatcher.explain_kvcache(c.q, c.k, c.v, c.seqlens, c.block_table).how == how
        checked = compare_kvcache(out, c, True, lse=lse)
        assert checked.ok, (p, checked.reason)


@pytest.mark.interpreter
def test_fp8_winners_ship_and_run(tmp_path: Path) -> None:
    """An fp8 winner ships with its fp8 kernel and forward defaults only (fp8 has no backward
    nor decode kernels); the package serves it exactly and answers the fp8 gate."""
    from flashgen.fp8 import quantize
    from flashgen.tune.check import compare_fp8

    problem = flashgen.Problem(1, 2, 1, 150, 150, 32, "fp8", True)
    variant = flashgen.Variant("fa2", 64, 32, 4, 2)
    _store(tmp_path / "t.db", problem, variant, INTERPRETER)
    pkg = _export_and_import(tmp_path, "fgk_fp8")
    table = json.loads((tmp_path / "fgk_fp8" / "table.json").read_text())
    gpu = table["gpus"]["cpu-interpreter"]
    assert [e["variant"] for e in gpu["fwd"]] == [variant.to_dict()]
    for defaults in (gpu, table["generic"]):
        assert {e["dtype"] for e in defaults["fwd_defaults"]} == {"fp8"}
        assert not defaults["bwd_defaults"] and not defaults["decode_defaults"]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 150, 32, generator=gen)
    k, v = (torch.randn(1, 1, 150, 32, generator=gen) for _ in range(2))
    qz = quantize(q, k, v)
    out = pkg.attention(qz.q, qz.k, qz.v, causal=True, descale_q=qz.descale_q,
                        descale_k=qz.descale_k, descale_v=qz.descale_v)
    assert out.dtype == torch.bfloat16  # fp8's default output
    checked = compare_fp8(out, qz, causal=True)
    assert checked.ok, checked.reason
    assert pkg.explain(qz.q, qz.k, qz.v, causal=True).how == "exact"


def test_a_persistent_winner_ships_its_one_tile_form_for_modifiers(tmp_path: Path) -> None:
    """The persistent fa3 kernel takes a window nowhere and softcap only where tuned with it,
    so flashgen runs such a winner's one-tile form (same tiles, warps and stages) for those
    calls: the export renders that form per set, and the package picks what flashgen picks."""
    from flashgen.runtime.table import Shape
    from flashgen.serve import Dispatcher

    db = tmp_path / "t.db"
    persistent = flashgen.Variant("fa3", 128, 128, 4, 2, programs_per_sm=1, pingpong=True)
    _store(db, P_FA3, persistent, H200)
    _export("--db", str(db), "--out", str(tmp_path), "--name", "fgk_one_tile",
            "--modifiers", "window,softcap")
    table = json.loads((tmp_path / "fgk_one_tile" / "table.json").read_text())
    (tuned,) = table["gpus"]["NVIDIA H200"]["fwd"]
    assert set(tuned["refuses"]) == set(tuned["one_tile"]) == {"w", "k"}
    with warnings.catch_warnings():  # no H200 here: the import says so (not asked)
        warnings.simplefilter("ignore", RuntimeWarning)
        pkg = _import_from(tmp_path, "fgk_one_tile")
    ours = pkg.runtime.package.PackageDispatcher()
    theirs = Dispatcher([db])
    for mods in ({"window": True}, {"softcap": True}):
        shape = Shape(1, 2, 2, 300, 300, 64, "bf16", False, **mods)
        choice, found = ours.lookup(ours._open("NVIDIA H200", 132), "fwd", shape)
        assert choice.how == "nearest" and "one-tile" in choice.reason, choice
        assert found["variant"] == {**persistent.to_dict(), "programs_per_sm": 0,
                                    "pingpong": False}
        expected, _ = theirs.lookup(theirs.table_for(H200), "fwd", shape)
        assert expected.variant.to_dict() == found["variant"]
        assert found["kernels"]["fwd"] != tuned["kernels"]["fwd"]


@pytest.mark.interpreter
def test_modified_and_packed_kernels_ship_and_run(tmp_path: Path) -> None:
    """A softcap winner ships as a tuned entry of its own; `--modifiers` ships each set's
    kernels: the plain winner's with window, sinks and softcap rendered in (and why its fa1
    variant cannot take packing, which the set's default grid then serves), the backward's
    and the decode family's defaults with them. Each call matches the float64 reference,
    gradients included; a set that was not exported, and a left-padded cache, are named
    errors."""
    from flashgen.kernels.problem import DecodeProblem
    from flashgen.tune.decode_bench import compare_kvcache, make_kvcache

    db = tmp_path / "t.db"
    _store(db, P_FP32, V_FP32, INTERPRETER)
    soft = flashgen.Variant("fa2", 32, 16, 2, 1)
    _store(db, P_FP32.with_(softcap=True), soft, INTERPRETER)
    _export("--db", str(db), "--out", str(tmp_path), "--name", "fgk_mods",
            "--modifiers", "window,sinks,varlen,softcap")
    _export("--db", str(db), "--out", str(tmp_path), "--name", "fgk_softcap_only")
    assert "softcap" not in json.loads(
        (tmp_path / "fgk_softcap_only" / "table.json").read_text())["modifier_sets"]
    table = json.loads((tmp_path / "fgk_mods" / "table.json").read_text())
    assert table["modifier_sets"] == {"k": "softcap", "s": "sinks", "v": "varlen",
                                      "w": "window"}
    fwd = table["gpus"]["cpu-interpreter"]["fwd"]
    plain = next(e for e in fwd if "modifiers" not in e)
    assert set(plain["modified"]) == {"k", "s", "w"}
    assert "fa1" in plain["refuses"]["v"]
    assert next(e for e in fwd if e.get("modifiers") == "k")["variant"] == soft.to_dict()
    pkg, other = _import_from(tmp_path, "fgk_mods"), _import_from(tmp_path, "fgk_softcap_only")

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 50, 32, generator=gen)
    k, v = (torch.randn(1, 1, 60, 32, generator=gen) for _ in range(2))
    do = torch.randn(1, 2, 50, 32, generator=gen)
    sinks = torch.randn(2, generator=gen)
    cases = {"window": ({"window": (8, 0)}, "nearest"), "softcap": ({"softcap": 5.0}, "exact"),
             "sinks": ({"sinks": sinks}, "nearest")}
    for name, (mods, how) in cases.items():
        assert pkg.explain(q, k, v, causal=True, **mods).how == how, name
        _check_modified(pkg, q, k, v, mods, do)

    lens = [5, 17, 1]
    cu = torch.tensor([0, 5, 22, 23], dtype=torch.int32)
    pq = torch.randn(23, 2, 32, generator=gen)
    pk, pv = (torch.randn(23, 1, 32, generator=gen) for _ in range(2))
    packed = [t.clone().requires_grad_(True) for t in (pq, pk, pv)]
    out = pkg.attention_varlen(*packed, cu, cu, max(lens), max(lens), causal=True)
    assert pkg.explain(pq, pk, pv, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                       max_seqlen_q=17, max_seqlen_k=17).how == "fallback"
    offsets = (cu.tolist(), cu.tolist())
    assert compare(out.detach(), pq, pk, pv, True, cu=offsets).ok
    dout = torch.randn(out.shape, generator=gen)
    out.backward(dout)
    checked = compare_grads(tuple(t.grad for t in packed), pq, pk, pv, dout, True, cu=offsets)
    assert checked.ok, ("varlen backward", checked.reason)

    c = make_kvcache(DecodeProblem(2, 4, 1, 1, 48, 32, "fp32", True), seqlens=[48, 21])
    out = pkg.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, window=(7, 0))
    checked = compare_kvcache(out, c, True, modifiers={"window": (7, 0)})
    assert checked.ok, ("decode window", checked.reason)

    with pytest.raises(ValueError, match="--modifiers window"):
        other.attention(q, k, v, causal=True, window=(8, 0))
    pads = torch.zeros(2, dtype=torch.int32)
    for mods in ({}, {"window": (7, 0)}):  # no export helps: named before the modifiers' error
        with pytest.raises(ValueError, match="ships no cache_leftpad kernels"):
            pkg.attention_with_kvcache(c.q, c.k, c.v, c.seqlens, cache_leftpad=pads, **mods)


def test_a_package_prints_its_variants_on_one_line() -> None:
    """An exported package has no variant classes: its `explain` printed the knobs as a
    dict (braces and quotes); they read as one line of name=value now."""
    from flashgen.runtime.table import Choice

    choice = Choice({"loop_order": "fa2", "block_m": 16}, "exact", "tuned")
    assert str(choice) == "loop_order=fa2 block_m=16 (exact): tuned"


def test_a_package_names_what_a_modified_call_lacks() -> None:
    """Where a package has no default for a call, its error says why and what export would
    ship it: the set was not exported (the --modifiers to add), the kind is missing (the
    --kinds, and --modifiers where the set is missing too, in one message), fp8 kernels take
    no sets (no export helps), or the export found no default for the kind (its reason)."""
    from flashgen.runtime.table import Shape, Table

    def grid(dtype: str, mods: str = "") -> dict[str, Any]:
        return {"dtype": dtype, "causal": False, "head_dim": 64, "seq_q_bucket": 16,
                "seq_k_bucket": 16, "variant": {}, **({"modifiers": mods} if mods else {})}

    no_default = {"mode": "fwd", "dtype": "fp32", "causal": False, "head_dim": 64,
                  "modifiers": "k", "reason": "none fits"}
    table = Table({"preprocess_block_m": 64, "lengths": [16], "modifier_sets": {"k": "softcap"},
                   "fwd_defaults": [grid("fp8"), grid("bf16"), grid("bf16", "k")],
                   "no_defaults": [no_default]}, "pkg", 1)
    cases = {("fp8", "softcap"): "render modifiers into no fp8 kernel",
             ("bf16", "window"): "exported without them. Export again with --modifiers window",
             ("fp16", "softcap"): "or with --kinds fp16:64 for its default kernels",
             ("fp16", "window"): "or with --kinds fp16:64 --modifiers window for its default",
             ("fp32", "softcap"): "found no default variant for this kind (none fits)"}
    for (dtype, mod), says in cases.items():
        with pytest.raises(ValueError, match=re.escape(says)):
            table.default("fwd", Shape(1, 1, 1, 16, 16, 64, dtype, False, **{mod: True}))
    assert table.default("fwd", Shape(1, 1, 1, 16, 16, 64, "bf16", False, softcap=True))[
        "modifiers"] == "k"


def test_kinds_without_a_default_are_noted_not_a_crash(tmp_path: Path) -> None:
    """A kind flashgen has no default for on a GPU (fp8 below sm89; fp32 head dims above 128
    in the generic backward's shared memory) gets no default grid: the export says so in a
    note, and the package's error for such a call quotes the reason."""
    a100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912)
    _store(tmp_path / "a.db", P_FA3.with_(dtype="fp16"), flashgen.Variant("fa2", 64, 64, 4, 2),
           a100)
    out = _export("--db", str(tmp_path / "a.db"), "--out", str(tmp_path), "--name", "fg_a100",
                  "--kinds", "fp8:128")
    assert "A100-SXM4-80GB: no default kernels for fp8:128 fwd" in out
    assert "no fp8 tensor cores" in out
    _store(tmp_path / "i.db", P_FP16, V_FP16, INTERPRETER)
    out = _export("--db", str(tmp_path / "i.db"), "--out", str(tmp_path), "--name", "fg_d256",
                  "--kinds", "fp32:256")
    assert "generic: no default kernels for fp32:256 bwd" in out
    table = json.loads((tmp_path / "fg_d256" / "table.json").read_text())
    assert {(e["mode"], e["head_dim"]) for e in table["generic"]["no_defaults"]} == {
        ("bwd", 256)}
    assert any(e["head_dim"] == 256 for e in table["generic"]["fwd_defaults"])


def test_plain_rows_choose_the_exported_triton(tmp_path: Path) -> None:
    """Where a GPU's rows span Triton versions (none installed here), the plain rows decide:
    one softcap row tuned on a newer Triton does not push out the plain winners."""
    db = tmp_path / "t.db"
    _store(db, P_FA3, flashgen.Variant("fa2", 64, 32, 4, 2), H200)
    _store(db, P_FA3.with_(seq_q=1024, seq_k=1024, causal=True),
           flashgen.Variant("fa2", 128, 64, 4, 2), H200)
    _store(db, P_FA3.with_(softcap=True), flashgen.Variant("fa2", 64, 64, 4, 2), H200)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE winners SET triton_version = '3.0.0', updated_at = "
                     "'2026-01-01T00:00:00' WHERE modifiers = ''")
        conn.execute("UPDATE winners SET triton_version = '3.1.0', updated_at = "
                     "'2026-06-01T00:00:00' WHERE modifiers != ''")
    selection = select_winners([db])
    (gpu,) = selection.gpus
    assert gpu.triton_version == "3.0.0"
    assert sorted(s.winner.key.modifiers for s in gpu.fwd) == ["", ""]
    assert any("rows of Triton ['3.1.0'] left out" in n for n in selection.notes)


def test_long_key_defaults_match_flashgen() -> None:
    """flashgen's defaults choose by key count past the tiles' lengths (persistent fa3 at
    D64 from 2048 or 4096 keys): an exported table's forward default at any length is the
    variant flashgen's own default_variant gives."""
    from flashgen.export.package import build_table
    from flashgen.export.rows import GpuWinners, Selection
    from flashgen.runtime.table import Shape, Table

    families = [("bf16", causal, d) for causal in (False, True) for d in (64, 128)]
    gpu = GpuWinners(device=H200, device_key="k", triton_version="t", fwd=[], bwd=[],
                     decode=[])
    table, _ = build_table(Selection(gpus=[gpu], extra_families=families))
    common = {k: table[k] for k in ("lengths", "preprocess_block_m", "fwd_key_lengths")}
    for name, data, device in (("h200", table["gpus"]["NVIDIA H200"], H200),
                               ("generic", table["generic"], GENERIC)):
        runtime = Table({**common, **data}, name, 132)
        for dtype, causal, d in families:
            for nq in (100, 256, 4096):
                for nk in (100, 300, 2047, 2048, 3000, 4096, 70000):
                    p = flashgen.Problem(1, 1, 1, nq, nk, d, dtype, causal)
                    got = runtime.default("fwd", Shape(*vars(p).values()))
                    assert got is not None
                    assert flashgen.Variant(**got["variant"]) == flashgen.default_variant(
                        p, device), (name, p)


def test_aot_workers_report_progress_and_a_failed_worker_its_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile tells how many kernels are done, from 0 to all, each count once (an
    export compiled for minutes without a word); a worker that dies names what it printed."""
    from flashgen.export import aot

    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "for job in json.loads(Path(sys.argv[1]).read_text()):\n"
        "    if job.get('fail'):\n"
        "        print('boom in the worker'); sys.exit(3)\n"
        "    time.sleep(0.05)\n"
        "    Path(job['metadata']).write_text('{}')\n")
    monkeypatch.setattr(aot, "WORKER", worker)
    monkeypatch.setattr(aot, "POLL_S", 0.01)
    jobs = [{"metadata": str(tmp_path / f"m{i}.json")} for i in range(7)]
    seen: list[tuple[int, int]] = []
    aot.run_workers(jobs, tmp_path, 3, lambda done, total: seen.append((done, total)))
    counts = [done for done, _ in seen]
    assert seen[0] == (0, 7) and seen[-1] == (7, 7) and {t for _, t in seen} == {7}
    assert counts == sorted(set(counts))
    with pytest.raises(RuntimeError, match="boom in the worker"):
        aot.run_workers([{"metadata": str(tmp_path / "x.json"), "fail": True}], tmp_path, 1)


def test_aot_compile_progress_off_a_terminal_is_a_line_a_tenth(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Piped (a batch job's log), the compile's progress is plain lines: its start, then one
    per tenth done, not one per kernel."""
    from flashgen.cli import _compile_progress

    with _compile_progress() as show:
        for done in range(0, 41):
            show(done, 40)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "compiling 40 cubin(s)"
    assert len(lines) == 11 and lines[-1].startswith("compiled 40/40 cubin(s) in ")
