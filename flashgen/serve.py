"""flashgen's dispatcher: the one runtime, served from the tuning databases.

`flashgen.runtime` is shared with exported packages and knows no database, template or rule
of flashgen's; this module plugs them in (`flashgen.runtime.dispatch` says what can be):
tables read from the databases (`flashgen.store.table`), kernels rendered for the call's kind
of problem, `default_variant` / `default_bwd_variant` where nothing tuned fits, and the named
validity rules for tuned and explicit variants alike. The tuner's benches launch single
variants through the same launch code (`run_forward`, `run_backward`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from flashgen.kernels.bwd_render import PREPROCESS_BLOCK_M, load_bwd_kernel
from flashgen.kernels.bwd_space import default_bwd_variant
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.decode_render import load_decode_kernel
from flashgen.kernels.decode_space import default_decode_variant
from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.fwd_space import default_variant
from flashgen.kernels.hardware import DeviceInfo, device_info
from flashgen.kernels.modes import space_of
from flashgen.kernels.presets import tune_command
from flashgen.kernels.problem import DecodeProblem, Problem
from flashgen.kernels.render import load_kernel
from flashgen.kernels.variant import Variant
from flashgen.runtime import dispatch
from flashgen.runtime.backward import BwdLauncher, prepare_backward
from flashgen.runtime.forward import Launcher, default_scale
from flashgen.runtime.forward import prepare_forward as _prepare_entry
from flashgen.runtime.kvcache import DecodeLauncher, DecodeShape, prepare_decode
from flashgen.runtime.modifiers import Mods
from flashgen.runtime.table import Choice, Entry, Shape, Table
from flashgen.store.table import default_paths, device_table, entry, entry_is_current


def shape_of(problem: Problem) -> Shape:
    """The runtime's view of `problem` (the same fields, in the same order)."""
    if isinstance(problem, DecodeProblem):
        # By name: a DecodeProblem also has the modifier flags, which decode calls never set.
        return DecodeShape(*(getattr(problem, f) for f in DecodeShape._fields))  # type: ignore[return-value]
    return Shape(*dataclasses.astuple(problem))


def problem_of(shape: Shape | DecodeShape) -> Problem:
    """flashgen's problem of a runtime shape: a `DecodeProblem` for a decode call's."""
    if isinstance(shape, DecodeShape):
        return DecodeProblem(**shape._asdict())
    return Problem(*shape)


def load_role(found: Entry, role: str, problem: Problem) -> Any:
    """The kernel of `role` for entry `found` (see `Dispatcher.kernel`), rendered for
    `problem`'s kind and loaded (both cached by content)."""
    base = role.removesuffix("_plain")
    knobs = found["twin"] if role.endswith("_plain") else found["variant"]
    if base == "fwd":
        return load_kernel(Variant.from_dict(knobs), problem)
    if base in ("decode", "decode_combine"):
        return load_decode_kernel(base, DecodeVariant.from_dict(knobs), problem)  # type: ignore[arg-type]
    return load_bwd_kernel(base, BwdVariant.from_dict(knobs), problem)  # type: ignore[arg-type]


class Dispatcher(dispatch.Dispatcher):
    """Serves the best tuned variant for each call.

    `db` names the databases to read, highest precedence first (default: the user database,
    then the shipped one). Instances are cheap until first used on a device; `flashgen.attention`
    uses one shared default instance.
    """

    variant_types: ClassVar[Mapping[str, type]] = {"fwd": Variant, "bwd": BwdVariant,
                                                    "decode": DecodeVariant}
    renders_modifiers: ClassVar[bool] = True
    renders_leftpad: ClassVar[bool] = True

    def __init__(self, db: str | Path | Sequence[str | Path] | None = None) -> None:
        super().__init__()
        if db is None:
            self.paths = default_paths()
        elif isinstance(db, (str, Path)):
            self.paths = [Path(db)]
        else:
            self.paths = [Path(p) for p in db]
        self._by_key: dict[str, Table] = {}

    # ---- the runtime's hooks ---------------------------------------------------------------

    def load_table(self, device: torch.device) -> Table:
        return self.table_for(device_info(device))

    def table_for(self, dev: DeviceInfo) -> Table:
        """`dev`'s table: its winners in every database, read once per device."""
        table = self._by_key.get(dev.key)
        if table is None:
            data = device_table(self.paths, dev)
            table = self._by_key[dev.key] = Table(data, dev.name, dev.sm_count, dev)
        return table

    def lookup(self, table: Table, mode: str, shape: Shape) -> tuple[Choice, Entry]:
        """The runtime's lookup; where it is about to log how to tune the device, the notice
        is written first, for this call's shape (the table alone knows no problem)."""
        if not table.tuned[mode] and not table.noticed:
            notices = self._notices(table.device, problem_of(shape), bool(table.tuned["fwd"]))
            table.data = {**table.data, "untuned": notices}
        return super().lookup(table, mode, shape)

    def _notices(self, dev: DeviceInfo, problem: Problem, tuned_fwd: bool) -> dict[str, str]:
        """How to tune `dev`, logged once when a mode has no winners (the whole GPU, or only
        the backward where the forward has winners), with the command that fits the device:
        the CPU interpreter is tuned with `--device cpu` and the call's own shape (a preset
        would take it hours), a GPU by its index."""
        where = ", ".join(str(p) for p in self.paths)
        more = "" if dev.is_interpreter else "\n  (or --preset fa-bench for a whole grid)"

        def notice(what: str, mode: str, whom: str) -> str:
            # Lines of their own for the places and the command, each whole: a terminal
            # folds them anywhere, and the command is meant to be copied as it stands.
            return (f"flashgen: no tuned {what}kernels for {dev.name} in\n  {where};\n"
                    f"  using default {what}variants. To tune {whom}, run\n"
                    f"  `{tune_command(dev, problem, mode)}`{more}\n"
                    f"  (a process reads the winners once: flashgen.reload() reads them "
                    f"again)")

        whole = notice("", "both", "this device")
        return {"fwd": whole, "bwd": notice("backward ", "bwd", "them") if tuned_fwd else whole,
                "decode": notice("decode ", "decode", "them")}

    def kernel(self, entry: Entry, role: str, shape: Shape) -> Any:
        return load_role(entry, role, problem_of(shape))

    def entry(self, mode: str, variant: Any, shape: Shape, table: Table) -> Entry:
        problem = problem_of(shape)
        if variant is None:
            variant = space_of(mode).default(problem, table.device)
        return entry(variant, problem, table.device)

    def reject(self, mode: str, entry: Entry, shape: Shape, table: Table) -> str | None:
        space = space_of(mode)
        return space.why_invalid(space.variant_type.from_dict(entry["variant"]),
                                 problem_of(shape), table.device)

    def portable(self, mode: str, shape: Shape, table: Table) -> Entry | None:
        """flashgen's default without Gluon (fa3) kernels: portable Triton, for a chosen
        kernel that fails to build (see the runtime's `portable`)."""
        problem = problem_of(shape)
        if mode == "decode":
            return entry(default_decode_variant(problem, table.device), problem, table.device)
        variant: Variant | BwdVariant = (
            default_variant(problem, table.device, fa3=False) if mode == "fwd"
            else default_bwd_variant(problem, table.device, fa3=False))
        return entry(variant, problem, table.device)

    def kernel_is_current(self, mode: str, entry: Entry) -> str | None:
        """A row whose kernel a template edit has changed since it was tuned gives way (to
        the next row of its bucket, the nearest bucket, or the default): it timed another
        kernel. The check renders the variant, so the runtime asks it once per row."""
        return None if entry_is_current(mode, entry) else (
            "its kernel has changed since it was tuned (re-tune)")

    # ---- flashgen's own questions ----------------------------------------------------------

    def choose(self, problem: Problem, device: DeviceInfo | str | None = None) -> Choice:
        """The forward variant for `problem` on `device`: exact hit, nearest valid bucket, or
        `default_variant`."""
        return self.lookup(self.table_for(device_info(device)), "fwd", shape_of(problem))[0]

    def choose_bwd(self, problem: Problem, device: DeviceInfo | str | None = None) -> Choice:
        """The backward variant for `problem` on `device`, as `choose` finds the forward's."""
        return self.lookup(self.table_for(device_info(device)), "bwd", shape_of(problem))[0]


dispatch.serve(Dispatcher)


def reload() -> None:
    """Read the tuning databases again at the next call. Dispatch reads the winners once per
    process, at its first call, and then serves from memory; winners tuned since then (by
    another process's `flashgen tune`) are served after this, or in a new process. Kernels
    already built stay built: only the tables are read again."""
    dispatch.serve(Dispatcher)


def default_dispatcher() -> Dispatcher:
    """The shared dispatcher behind `flashgen.attention` (databases read on first use)."""
    found = dispatch.default_dispatcher()
    assert isinstance(found, Dispatcher)
    return found


# ---- single variants, as the tuner's benches launch them ------------------------------------


def prepare_forward(variant: Variant, problem: Problem, strict: bool = True,
                    kernel: Any = None) -> Launcher:
    """A launcher of `variant` on inputs of `problem`'s kind (see the runtime's
    `prepare_forward`). Strict: inputs TMA cannot address raise instead of running the
    pointer twin. `kernel` replaces the rendered one (a JIT function with the same arguments):
    how `scripts/ab_templates.py` times another revision's template beside the current one."""
    found = entry(variant, problem, None)

    def load(role: str) -> Any:
        return kernel if kernel is not None and role == "fwd" else load_role(found, role, problem)

    return _prepare_entry(found, shape_of(problem), load, strict)


@functools.lru_cache(maxsize=256)
def _forward(variant: Variant, problem: Problem) -> Launcher:
    return prepare_forward(variant, problem)


def run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
                problem: Problem, scale: float | None = None,
                mods: Mods | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `variant` on checked inputs; returns (output like q, log-sum-exp (B, Hq, Nq) fp32;
    packed, (Hq, total_q)). `mods`: the values of `problem`'s modifiers."""
    scale = default_scale(problem.head_dim) if scale is None else float(scale)
    if mods is None:
        return _forward(variant, problem)(q, k, v, scale)
    return _forward(variant, problem)(q, k, v, scale, mods)


@functools.lru_cache(maxsize=256)
def _backward(variant: BwdVariant, problem: Problem, dev: DeviceInfo) -> BwdLauncher:
    found = entry(variant, problem, dev)
    return prepare_backward(found, shape_of(problem),
                            lambda role: load_role(found, role, problem), PREPROCESS_BLOCK_M)


def run_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, variant: BwdVariant, problem: Problem,
                 scale: float | None = None,
                 mods: Mods | None = None) -> tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv; dsinks after them where `mods` has sinks) of `variant` given
    the upstream gradient `do` and the forward's `out` and `lse` (see the runtime's
    `prepare_backward`). A variant with Gluon kernels runs its all-Triton twin on inputs TMA
    cannot address. Inputs are not validated here."""
    scale = default_scale(problem.head_dim) if scale is None else float(scale)
    run = _backward(variant, problem, device_info(q.device))
    if mods is None:
        return run(do, q, k, v, out, lse, scale)
    return run(do, q, k, v, out, lse, scale, mods)


@functools.lru_cache(maxsize=256)
def _decode(variant: DecodeVariant, problem: DecodeProblem) -> DecodeLauncher:
    found = entry(variant, problem, None)
    return prepare_decode(found, shape_of(problem),  # type: ignore[arg-type]
                          lambda role: load_role(found, role, problem))


def run_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
               variant: DecodeVariant, problem: DecodeProblem,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run decode `variant` on a KV cache of `problem`'s kind (see the runtime's
    `prepare_decode`); returns (output like q, log-sum-exp). Inputs are not validated here."""
    scale = default_scale(problem.head_dim) if scale is None else float(scale)
    return _decode(variant, problem)(q, k_cache, v_cache, cache_seqlens, block_table, scale)
