"""What an exported package plugs into the runtime: its `table.json` and its `kernels/`.

`flashgen export` writes this runtime next to the rendered kernels (`kernels/<module>.py`)
and `table.json`; the package's generated `__init__.py` calls `install`. flashgen itself never
imports this module: its own dispatcher reads the tuning databases instead.

table.json holds, per tuned GPU, that GPU's table (see `table`) with its Triton version, and
"generic": default variants valid on any GPU Triton supports. On a GPU or Triton other than
a tuned one, one warning says so and only the generic defaults are used.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import triton

from .dispatch import Dispatcher, default_dispatcher, serve
from .forward import sm_count
from .table import Entry, Shape, Table, modifier_letters, modifier_names

#: The package's import name and folder: this file is <package>/runtime/package.py.
PACKAGE = (__package__ or __name__).rpartition(".")[0]
ROOT = Path(__file__).resolve().parent.parent
#: The device name flashgen gives the Triton interpreter (CPU tensors, TRITON_INTERPRET=1).
CPU_INTERPRETER = "cpu-interpreter"


@functools.cache
def table_json() -> dict[str, Any]:
    return json.loads((ROOT / "table.json").read_text(encoding="utf-8"))


def tuned_gpus() -> dict[str, str]:
    """GPU name -> the Triton version it was tuned with, for every GPU in the table."""
    return {name: t["triton_version"] for name, t in table_json()["gpus"].items()}


def device_name(device: torch.device) -> str:
    return CPU_INTERPRETER if device.type == "cpu" else torch.cuda.get_device_name(device)


class PackageDispatcher(Dispatcher):
    """Serves table.json's entries with the kernels of the package's `kernels/` folder.

    Modifiers and packed sequences run where the export rendered kernels for their set
    (`flashgen export --modifiers`): a plain entry's "modified" kernels, an entry tuned with
    the set, or the set's default grid. Elsewhere the call is a named error."""

    renders_modifiers = True

    def __init__(self) -> None:
        super().__init__()
        self._by_name: dict[str, Table] = {}

    def load_table(self, device: torch.device) -> Table:
        """The table of the GPU's model, read once per model: it warns at most once."""
        name = device_name(device)
        if name not in self._by_name:
            self._by_name[name] = self._open(name, sm_count(device))
        return self._by_name[name]

    def _open(self, name: str, sms: int) -> Table:
        data = table_json()
        common = {"lengths": data["lengths"], "preprocess_block_m": data["preprocess_block_m"],
                  "modifier_sets": data.get("modifier_sets", {}),
                  "fwd_key_lengths": data.get("fwd_key_lengths", data["lengths"])}
        gpu = data["gpus"].get(name)
        if gpu is None:
            why = f"kernels were tuned for {sorted(data['gpus']) or 'no GPU'}, not {name}"
        elif gpu["triton_version"] != triton.__version__:
            why = (f"kernels for {name} were tuned with Triton {gpu['triton_version']}, this is "
                   f"Triton {triton.__version__}")
        else:
            return Table({**common, **gpu}, name, sms)
        # The tuned choices may not hold on another GPU or compiler.
        warnings.warn(f"{PACKAGE}: {why}; using the generic default variants", RuntimeWarning,
                      stacklevel=2)
        return Table({**common, **data["generic"]}, f"{name} (generic default variants)", sms)

    def reject(self, mode: str, entry: Entry, shape: Shape, table: Table) -> str | None:
        """A plain entry serves a modified call only with kernels exported for its set."""
        letters = modifier_letters(shape)
        if not letters or entry.get("modifiers"):
            return None
        refused = entry.get("refuses", {}).get(letters)
        if refused is not None:
            return refused
        if letters not in entry.get("modified", {}):
            return f"exported without its kernels for {modifier_names(letters)}"
        return None

    def one_tile_entry(self, e: Entry, shape: Shape, table: Table) -> Entry | None:
        """The one-tile form the export rendered for this call's modifier set."""
        return e.get("one_tile", {}).get(modifier_letters(shape))

    def kernel(self, entry: Entry, role: str, shape: Shape) -> Any:
        letters = modifier_letters(shape)
        modules = (entry["modified"][letters] if letters and not entry.get("modifiers")
                   else entry["kernels"])
        module = importlib.import_module(f"{PACKAGE}.kernels.{modules[role]}")
        base = role.removesuffix("_plain")
        if base in ("fwd", "decode", "decode_combine"):
            return getattr(module, f"attn_{base}")
        return getattr(module, f"attn_bwd_{base}")


def install() -> None:
    """Make the package's dispatcher the one behind its `attention`, and say at import (not
    at the first call) when this GPU or Triton is not a tuned one."""
    serve(PackageDispatcher)
    if torch.cuda.is_available():
        default_dispatcher().table(torch.device("cuda", torch.cuda.current_device()))
    elif os.environ.get("TRITON_INTERPRET") == "1":
        default_dispatcher().table(torch.device("cpu"))
