"""`flashgen export`: a self-contained Python package of the tuned kernels.

The package needs only torch and triton. It holds every kernel it may run as a rendered Triton
source under `kernels/` (named by source hash, so shared kernels are written once), a static
dispatch table `table.json`, and flashgen's own runtime (`flashgen/runtime/`, copied byte for
byte), which serves the table through `runtime/package.py`. Layout:

    PACKAGE/__init__.py      generated, a few lines: attention(), explain(), tuned_gpus()
    PACKAGE/runtime/*.py     flashgen's runtime, verbatim
    PACKAGE/table.json       per GPU: tuned forward/backward entries and default grids;
                             plus generic defaults for GPUs or Tritons that were not tuned
                             (a nondeterministic backward winner is followed by its key's
                             fastest deterministic trial, as in flashgen's own tables)
    PACKAGE/kernels/*.py     fwd_<hash>.py, bwd_{preprocess,dkdv,dq}_<hash>.py,
                             decode_<hash>.py and decode_combine_<hash>.py (a use_tma
                             or fa3 forward, or an fa3 backward, also gets its pointer twin,
                             for unaligned inputs; the entry names the twin's variant)
    PACKAGE/README.md        what was exported, from where

Backward winners are exported where the database has them; the default backward grid is
always exported, so every exported forward kind also trains. Decode winners are exported
likewise, with a default decode grid (packed rows x page size) for every kind with a decode
or forward winner, so `attention_with_kvcache` and `attention`'s decode dispatch run.

Modifiers (window, softcap, sinks) and packed sequences are kernel structure, which the
package cannot render. Winners tuned with them ship as tuned entries of their own (their
kernels rendered with them), and `--modifiers` names sets whose kernels every plain entry
carries ("modified", or "refuses" with why its variant cannot take the set) beside default
grids of their own (entries with "modifiers"). A call with a set that was not exported is
a named error that says which `--modifiers` to export with.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import flashgen.runtime
from flashgen.export.rows import (
    FWD_KEY_LENGTHS,
    GENERIC,
    LENGTHS,
    AnyVariant,
    Family,
    GpuWinners,
    NoDefault,
    Selection,
    Sourced,
    decode_default_grid,
    default_grid,
    tile_needs,
    with_modifiers,
)
from flashgen.export.target import check_name, check_not_shadowing, check_target
from flashgen.kernels.bwd_render import PREPROCESS_BLOCK_M, bwd_roles, render_bwd
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.decode_render import render_decode
from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.hardware import DeviceInfo
from flashgen.kernels.modes import space_of
from flashgen.kernels.problem import Problem
from flashgen.kernels.render import render, source_hash
from flashgen.kernels.variant import Variant
from flashgen.runtime.table import modified_untuned, modifier_letters, modifier_names
from flashgen.store.table import DETERMINISTIC_ROLE, entry, winner_entry
from flashgen.version import __version__

#: flashgen's runtime, which the package carries verbatim.
RUNTIME = Path(flashgen.runtime.__file__).parent
TABLE_FORMAT = 1
#: The package's one generated Python file (the runtime's `package.py` does the work).
INIT = '''"""{name}: flash-attention kernels exported by flashgen {version}.

Needs only torch and triton. Tuned for: {gpus}.
`runtime/` is flashgen's own runtime, copied verbatim; `kernels/` holds the rendered Triton
sources, and `table.json` says which of them serves which problem (see README.md).
"""

from .runtime import package as _package
from .runtime.api import attention, attention_varlen, attention_with_kvcache, explain
from .runtime.sdpa import scaled_dot_product_attention
from .runtime.table import Choice

tuned_gpus = _package.tuned_gpus
_package.install()

__all__ = ["Choice", "attention", "attention_varlen", "attention_with_kvcache", "explain",
           "scaled_dot_product_attention", "tuned_gpus"]
'''


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote: for the CLI's summary and for tests."""

    path: Path
    gpus: list[str]
    tuned: int  # tuned entries, forward and backward, over all GPUs
    kernels: int  # distinct rendered sources
    families: list[Family]


class _Kernels:
    """Rendered sources by module name; equal sources share one module."""

    def __init__(self) -> None:
        self.sources: dict[str, str] = {}

    def add(self, prefix: str, source: str) -> str:
        name = f"{prefix}_{source_hash(source)}"
        self.sources[name] = source
        return name

    def of(self, mode: str, variant: AnyVariant, problem: Problem,
           twin: AnyVariant | None = None) -> dict[str, str]:
        """The kernel modules that run `variant`, by role; `twin`'s as "<role>_plain"."""
        if mode == "decode":
            assert isinstance(variant, DecodeVariant)
            # Both kernels, whatever the splits: the runtime may pick its own count.
            return {r: self.add(r, render_decode(r, variant, problem))  # type: ignore[arg-type]
                    for r in ("decode", "decode_combine")}
        if mode == "fwd":
            assert isinstance(variant, Variant)
            kernels = {"fwd": self.add("fwd", render(variant, problem))}
            if twin is not None:
                assert isinstance(twin, Variant)
                kernels["fwd_plain"] = self.add("fwd", render(twin, problem))
            return kernels
        assert isinstance(variant, BwdVariant)
        roles = bwd_roles(variant)
        kernels = {r: self.add(f"bwd_{r}", render_bwd(r, variant, problem)) for r in roles}
        if twin is not None:
            assert isinstance(twin, BwdVariant)
            kernels.update({f"{r}_plain": self.add(f"bwd_{r}", render_bwd(r, twin, problem))
                            for r in roles if r != "preprocess"})
        return kernels


def _takes(mode: str, letters: str, dtype: str) -> bool:
    """Whether kernels of `mode` in `dtype` are exported with the modifiers of `letters`:
    decode has no packed layout, and `--modifiers` sets are not rendered into fp8 kernels
    (fp8 winners tuned with modifiers still ship with them)."""
    return dtype != "fp8" and not (mode == "decode" and "v" in letters)


def _why_not(mode: str, variant: AnyVariant, problem: Problem, device: DeviceInfo,
             twin: AnyVariant | None) -> str | None:
    """Why `variant` (or its twin) cannot serve `problem`, a modified problem, by flashgen's
    validity rules and, for the forward, its rule for plain winners under modifiers."""
    why_invalid = space_of(mode).why_invalid
    reason = why_invalid(variant, problem, device)  # type: ignore[arg-type]
    if reason is None and mode == "fwd":
        reason = modified_untuned(variant)
    if reason is None and twin is not None:
        reason = why_invalid(twin, problem, device)  # type: ignore[arg-type]
    return reason


def _shipped(found: dict[str, Any], kernels: _Kernels, mode: str, variant: AnyVariant,
             problem: Problem, device: DeviceInfo, sets: list[str]) -> dict[str, Any]:
    """`found` (a table entry of `variant`) with what the package's runtime reads in place of
    flashgen's renderer and rules: its kernel modules, the lengths its tiles need, and for a
    plain entry, per modifier set of `sets`, its kernels with the set rendered in or why it
    cannot take it."""
    twin = type(variant).from_dict(found["twin"]) if "twin" in found else None
    found["kernels"] = kernels.of(mode, variant, problem, twin)
    if mode != "decode":  # decode tiles are correct at any length (masked), only slower
        found["need"] = list(tile_needs(mode, variant, problem))
    if problem.modifiers:  # tuned with its modifiers: its kernels already have them
        return found
    for letters in (s for s in sets if _takes(mode, s, problem.dtype)):
        modified = with_modifiers(problem, letters)
        reason = _why_not(mode, variant, modified, device, twin)
        if reason is not None:
            found.setdefault("refuses", {})[letters] = reason
            one = _one_tile(kernels, variant, modified, device)
            if one is not None:
                found.setdefault("one_tile", {})[letters] = one
        else:
            found.setdefault("modified", {})[letters] = kernels.of(mode, variant, modified,
                                                                   twin)
    return found


def _one_tile(kernels: _Kernels, variant: AnyVariant, problem: Problem,
              device: DeviceInfo) -> dict[str, Any] | None:
    """flashgen's one-tile form of a persistent fa3 forward winner (`Dispatcher.
    _one_tile_form`: the same tiles, warps and stages), which takes the modifiers of
    `problem` where the persistent kernel does not, as an entry of its own with them
    rendered in (None: not such a winner, or the form is invalid too)."""
    if not (isinstance(variant, Variant) and variant.loop_order == "fa3"
            and variant.programs_per_sm):
        return None
    one = replace(variant, programs_per_sm=0, pingpong=False, head_units=False)
    found = entry(one, problem, device)
    twin = Variant.from_dict(found["twin"]) if "twin" in found else None
    if _why_not("fwd", one, problem, device, twin) is not None:
        return None
    # Its kernels have the modifiers rendered in, as a modified default's have.
    found.update(modifiers=modifier_letters(problem),
                 kernels=kernels.of("fwd", one, problem, twin),
                 need=list(tile_needs("fwd", one, problem)))
    return found


def _entry(kernels: _Kernels, mode: str, variant: AnyVariant, problem: Problem,
           device: DeviceInfo) -> dict[str, Any]:
    return _shipped(entry(variant, problem, device), kernels, mode, variant, problem, device,
                    [])


def _tuned(kernels: _Kernels, mode: str, row: Sourced, device: DeviceInfo,
           sets: list[str]) -> list[dict[str, Any]]:
    """The winner's entry, then its deterministic alternate's where it has one (the order
    the runtime tries them in)."""
    w = row.winner
    entries = [_shipped(winner_entry(w, row.source(), device), kernels, mode, w.variant,
                        w.problem, device, sets)]
    if row.alternate is not None:
        a = row.alternate
        found = winner_entry(a, f"{row.source(a)} ({DETERMINISTIC_ROLE})", device,
                             DETERMINISTIC_ROLE, w)
        entries.append(_shipped(found, kernels, mode, a.variant, a.problem, device, sets))
    return entries


def _defaults(kernels: _Kernels, families: list[Family], decode_families: list[Family],
              device: DeviceInfo, sets: list[str], notes: list[str]) -> dict[str, Any]:
    """The default grids of every family, plain and with each modifier set of `sets` (those
    entries carry the set as "modifiers": their kernels are rendered with it). A family
    flashgen has no default for on `device` gets none: "no_defaults" says why (the package's
    error for such a call quotes it), and so does a note."""
    out: dict[str, Any] = {"fwd_defaults": [], "bwd_defaults": [], "no_defaults": []}
    for mode in ("fwd", "bwd"):
        for fam in families:
            if mode == "bwd" and fam[0] == "fp8":  # fp8: forward only
                continue
            for letters in ("", *(s for s in sets if _takes(mode, s, fam[0]))):
                try:
                    grid = default_grid(mode, fam, device, letters,
                                        FWD_KEY_LENGTHS if mode == "fwd" else LENGTHS)
                except NoDefault as exc:
                    out["no_defaults"].append({"mode": mode, "dtype": fam[0],
                                               "causal": fam[1], "head_dim": fam[2],
                                               **({"modifiers": letters} if letters else {}),
                                               "reason": str(exc)})
                    continue
                out[f"{mode}_defaults"] += [
                    {"dtype": fam[0], "causal": fam[1], "head_dim": fam[2],
                     **({"modifiers": letters} if letters else {}),
                     "seq_q_bucket": nq, "seq_k_bucket": nk,
                     **_entry(kernels, mode, variant, problem, device)}
                    for nq, nk, variant, problem in grid]
    skipped = sorted({f"{e['dtype']}:{e['head_dim']} {e['mode']}"
                      f"{' with ' + modifier_names(e['modifiers']) if 'modifiers' in e else ''}"
                      f" ({e['reason']})" for e in out["no_defaults"]})
    if skipped:
        notes.append(f"{device.name}: no default kernels for {'; '.join(skipped)}")
    out["decode_defaults"] = [
        {"dtype": fam[0], "causal": fam[1], "head_dim": fam[2],
         **({"modifiers": letters} if letters else {}), "rows": rows,
         "page_size": page, **_entry(kernels, "decode", variant, problem, device)}
        for letters in ("", *sets)
        for fam in decode_families if not letters or _takes("decode", letters, fam[0])
        for rows, page, variant, problem in decode_default_grid(fam, device, letters)
    ]
    return out


def _gpu_table(kernels: _Kernels, gpu: GpuWinners, families: list[Family],
               decode_families: list[Family], sets: list[str],
               notes: list[str]) -> dict[str, Any]:
    major, minor = gpu.device.capability
    return {
        "capability": f"{major}.{minor}", "sm_count": gpu.device.sm_count,
        "device_key": gpu.device_key, "triton_version": gpu.triton_version,
        **{mode: [e for s in getattr(gpu, mode)
                  for e in _tuned(kernels, mode, s, gpu.device, sets)]
           for mode in ("fwd", "bwd", "decode")},
        **_defaults(kernels, families, decode_families, gpu.device, sets, notes),
    }


def build_table(selection: Selection) -> tuple[dict[str, Any], dict[str, str]]:
    """(table.json's content, kernel module name -> Triton source)."""
    kernels = _Kernels()
    families, decode_families = selection.families(), selection.decode_families()
    sets = selection.modifier_sets
    table = {
        "format": TABLE_FORMAT,
        "flashgen_version": __version__,
        "preprocess_block_m": PREPROCESS_BLOCK_M,
        "lengths": list(LENGTHS),
        "fwd_key_lengths": list(FWD_KEY_LENGTHS),
        "modifier_sets": {letters: modifier_names(letters) for letters in sets},
        "gpus": {g.device.name: _gpu_table(kernels, g, families, decode_families, sets,
                                           selection.notes)
                 for g in selection.gpus},
        "generic": {"device": GENERIC.to_dict(),
                    **_defaults(kernels, families, decode_families, GENERIC, sets,
                                selection.notes)},
    }
    return table, kernels.sources


def runtime_files() -> list[Path]:
    """The runtime's source files, which an exported package carries byte for byte."""
    return sorted(RUNTIME.glob("*.py"))


def _readme(name: str, table: dict[str, Any], notes: list[str]) -> str:
    lines = [
        f"# {name}", "",
        f"Flash-attention kernels exported by flashgen {table['flashgen_version']}. Needs only "
        "torch and triton.", "",
        "```python",
        f"from {name} import attention, explain",
        "out = attention(q, k, v, causal=True)   # q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D)",
        "print(explain(q, k, v, causal=True))  # which kernel, and why",
        "```", "", "Tuned for:", "",
    ]
    for gpu, t in table["gpus"].items():
        winners = {m: sum("role" not in e for e in t[m]) for m in ("fwd", "bwd", "decode")}
        lines.append(f"- {gpu} (sm {t['capability']}, Triton {t['triton_version']}): "
                     f"{winners['fwd']} forward, {winners['bwd']} backward and "
                     f"{winners['decode']} decode winners")
    lines += ["", "Other GPUs and Triton versions get the generic default variants, with a "
              "warning."]
    lines += [f"- note: {n}" for n in notes]
    return "\n".join(lines) + "\n"


#: Modules an exported package imports or sits beside: one named so would hide them (the
#: standard library's names are refused too).
_TAKEN_NAMES = frozenset({"flashgen", "torch", "triton", "numpy", "jinja2"})


def write_package(selection: Selection, out: Path, name: str, force: bool = False) -> ExportReport:
    """Write package `name` under `out` (replacing an existing one only with `force`)."""
    check_name(name, "package name")
    if name in _TAKEN_NAMES or name in sys.stdlib_module_names:
        raise ValueError(f"package name {name!r} would shadow the module {name!r} for whoever "
                         "imports it; pick another")
    target = out / name
    check_not_shadowing(name, target)
    if not selection.gpus:
        raise ValueError("no winners to export (see the notes)")
    check_target(target, force)
    table, sources = build_table(selection)
    out.mkdir(parents=True, exist_ok=True)
    # Build beside the target and swap it in, so a failed export leaves no half package.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        # kernels/ is a namespace package: its only Python files are the kernel sources.
        (tmp / "kernels").mkdir()
        for module, source in sources.items():
            (tmp / "kernels" / f"{module}.py").write_text(source, encoding="utf-8")
        (tmp / "table.json").write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
        (tmp / "runtime").mkdir()
        for path in runtime_files():
            shutil.copyfile(path, tmp / "runtime" / path.name)
        gpus = ", ".join(table["gpus"]) or "no GPU"
        (tmp / "__init__.py").write_text(
            INIT.format(name=name, version=table["flashgen_version"], gpus=gpus),
            encoding="utf-8")
        (tmp / "README.md").write_text(_readme(name, table, selection.notes), encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tuned = sum(len(t["fwd"]) + len(t["bwd"]) + len(t["decode"])
                for t in table["gpus"].values())
    return ExportReport(target, list(table["gpus"]), tuned, len(sources), selection.families())
