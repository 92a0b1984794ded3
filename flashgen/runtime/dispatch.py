"""Tuned dispatch: which variant runs for a call, decided once per shape and then cached.

Winners are read from the tuning databases once per process and device into a dict; the call
path does no SQL. Sources, highest precedence first: a user database ($FLASHGEN_DB or the
default user path) and the database shipped in the package's `tuning_db/`. For a problem:
1. exact: a winner for its (dtype, causal, head dim, GQA ratio, Nq bucket, Nk bucket);
2. nearest: the closest tuned length bucket of the same (dtype, causal, head dim, GQA ratio)
   whose variant is valid for this problem (resources, block vs length);
3. fallback: `default_variant`; if this GPU has no entries at all, one log line says how to
   tune it.
The backward pass is served the same way from the backward winners (mode "bwd", a
`BwdVariant` each; `choose_bwd`), read once per device from the same databases; its fallback
is `default_bwd_variant`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from flashgen.kernels.bwd_space import default_bwd_variant, why_invalid_bwd
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.fwd_space import default_variant, why_invalid
from flashgen.kernels.hardware import DeviceInfo, device_info
from flashgen.kernels.modes import AnyVariant, space_of
from flashgen.kernels.presets import tune_command
from flashgen.kernels.problem import Problem
from flashgen.kernels.resources import data_dir
from flashgen.kernels.variant import Variant
from flashgen.runtime.backward import run_backward
from flashgen.runtime.checks import check_inputs, check_runnable
from flashgen.runtime.forward import Launcher, default_scale, prepare_forward
from flashgen.store.current import row_is_current
from flashgen.store.db import TuningDB, WinnerRow, default_db_path
from flashgen.store.keys import MODES, seq_bucket

log = logging.getLogger("flashgen")

SHIPPED_DB_NAME = "flashgen.db"
How = Literal["explicit", "exact", "nearest", "fallback"]


@dataclass(frozen=True)
class BwdChoice:
    """The backward variant a call runs and how it was found (see `Choice`)."""

    variant: BwdVariant
    how: How
    reason: str
    source: str | None = None

    def __str__(self) -> str:
        where = f"\n  from: {self.source}" if self.source else ""
        return f"{self.variant} ({self.how}): {self.reason}{where}"


@dataclass(frozen=True)
class Choice:
    """The variant a call runs, how it was found, and the database row behind it.
    `explain` also fills in `backward`: what the call's backward pass would run."""

    variant: Variant
    how: How
    reason: str
    source: str | None = None  # "<database path> winners[<key id>] trial <id>"
    backward: BwdChoice | None = None

    def __str__(self) -> str:
        where = f"\n  from: {self.source}" if self.source else ""
        text = f"{self.variant} ({self.how}): {self.reason}{where}"
        return f"{text}\nbackward: {self.backward}" if self.backward else text


@dataclass(frozen=True)
class _Plan:
    """What a shape's calls reuse: the prepared launch, the choice, and the default scale."""

    launch: Launcher
    choice: Choice
    scale: float


@dataclass(frozen=True)
class _Entry:
    winner: WinnerRow
    path: Path

    def source(self) -> str:
        return f"{self.path} winners[{self.winner.key.id}] trial {self.winner.trial_id}"


_Family = tuple[str, bool, int, int]  # dtype, causal, head dim, GQA ratio
#: What `_pick` finds: the variant, how, why, and the row it came from.
_Pick = tuple[AnyVariant, How, str, str | None]


def shipped_db_path() -> Path:
    return Path(str(data_dir("tuning_db") / SHIPPED_DB_NAME))


class Dispatcher:
    """Serves the best cached variant for each call.

    `db` names the databases to read, highest precedence first (default: the user database,
    then the shipped one). Instances are cheap until first used on a device; the module-level
    `flashgen.attention` uses one shared default instance.
    """

    def __init__(self, db: str | Path | Sequence[str | Path] | None = None) -> None:
        if db is None:
            self.paths = [default_db_path(), shipped_db_path()]
        elif isinstance(db, (str, Path)):
            self.paths = [Path(db)]
        else:
            self.paths = [Path(p) for p in db]
        self._tables: dict[str, dict[str, dict[_Family, list[_Entry]]]] = {}  # device, mode
        self._plans: dict[tuple, _Plan] = {}
        self._bwd_choices: dict[tuple[Problem, str], BwdChoice] = {}
        self._warned: set[str] = set()
        self._failed: set[tuple] = set()  # kernels whose failure was warned of

    # ---- choosing ------------------------------------------------------------------------

    def _table(self, device: DeviceInfo, mode: str,
               problem: Problem) -> dict[_Family, list[_Entry]]:
        tables = self._tables.get(device.key)
        if tables is None:
            tables = self._tables[device.key] = self._load(device)
        table = tables[mode]
        if not table and device.key not in self._warned:
            self._warned.add(device.key)
            self._warn_untuned(device, mode, tuned_fwd=bool(tables["fwd"]), problem=problem)
        return table

    def _load(self, device: DeviceInfo) -> dict[str, dict[_Family, list[_Entry]]]:
        """Both modes' winners for `device`, from every database at once (one open each)."""
        tables: dict[str, dict[_Family, list[_Entry]]] = {mode: {} for mode in MODES}
        for path in self.paths:
            if not path.is_file():
                continue
            with TuningDB.open_readonly(path) as db:
                rows = [row for mode in MODES for row in db.load_winners(device.key, mode=mode)]
            for row in rows:
                k = row.key
                # Every database's row of a bucket, in precedence order (`_pick`'s sort keeps
                # it): a row whose kernel has changed gives way to the next one.
                family = (k.dtype, k.causal, k.head_dim, k.gqa)
                tables[k.mode].setdefault(family, []).append(_Entry(row, path))
        return tables

    def _warn_untuned(self, device: DeviceInfo, mode: str, tuned_fwd: bool,
                      problem: Problem) -> None:
        """One log line per device on how to tune it (the whole GPU, or only the backward
        where the forward has winners), with the command that fits the device: the CPU
        interpreter is tuned with `--device cpu`, and a preset is for GPUs only."""
        where = ", ".join(str(p) for p in self.paths)
        only_bwd = mode == "bwd" and tuned_fwd
        command = tune_command(device, problem, "bwd" if only_bwd else "both")
        more = "" if device.is_interpreter else " (or --preset fa-bench for a whole grid)"
        log.warning(
            "flashgen: no tuned %skernels for %s in %s; using default %svariants. Run `%s`%s "
            "to tune %s.",
            "backward " if only_bwd else "", device.name, where,
            "backward " if only_bwd else "", command, more,
            "them" if only_bwd else "this device",
        )  # fmt: skip

    def choose(self, problem: Problem, device: DeviceInfo | str | None = None) -> Choice:
        """Pick the variant for `problem` on `device`: exact hit, nearest bucket, or default."""
        variant, how, reason, source = self._pick(problem, device_info(device), "fwd")
        assert isinstance(variant, Variant)
        return Choice(variant, how, reason, source)

    def choose_bwd(self, problem: Problem, device: DeviceInfo | str | None = None) -> BwdChoice:
        """Pick the backward variant for `problem` on `device`, exactly as `choose` does for
        the forward: exact hit, nearest valid bucket, or `default_bwd_variant`."""
        dev = device_info(device)
        cached = self._bwd_choices.get((problem, dev.key))
        if cached is None:
            variant, how, reason, source = self._pick(problem, dev, "bwd")
            assert isinstance(variant, BwdVariant)
            cached = self._bwd_choices[(problem, dev.key)] = BwdChoice(variant, how, reason,
                                                                        source)
        return cached

    def _pick(self, problem: Problem, dev: DeviceInfo, mode: str) -> _Pick:
        space = space_of(mode)
        family = (problem.dtype, problem.causal, problem.head_dim, problem.group)
        entries = self._table(dev, mode, problem).get(family, [])
        want_q, want_k = seq_bucket(problem.seq_q), seq_bucket(problem.seq_k)

        def distance(e: _Entry) -> tuple[float, int]:
            k = e.winner.key
            d = abs(math.log2(k.seq_q_bucket / want_q)) + abs(math.log2(k.seq_k_bucket / want_k))
            return d, -k.seq_q_bucket  # ties: the longer bucket (better tuned for big work)

        skipped: list[str] = []
        for entry in sorted(entries, key=distance):
            key = entry.winner.key
            reason = (space.why_invalid(entry.winner.variant, problem, dev)
                      or space.veto(entry.winner.variant, problem, dev)
                      or (None if row_is_current(entry.winner) else "its kernel has changed "
                          "since it was tuned (re-tune)"))
            if reason:
                skipped.append(f"bucket Nq{key.seq_q_bucket}/Nk{key.seq_k_bucket}: {reason}")
                continue
            if (key.seq_q_bucket, key.seq_k_bucket) == (want_q, want_k):
                return (
                    entry.winner.variant,
                    "exact",
                    f"tuned winner for this bucket ({key.seq_q_bucket}, {key.seq_k_bucket})",
                    entry.source(),
                )
            return (
                entry.winner.variant,
                "nearest",
                f"no winner for bucket ({want_q}, {want_k}); nearest tuned bucket "
                f"({key.seq_q_bucket}, {key.seq_k_bucket}) is valid here",
                entry.source(),
            )
        why = (
            "tuned buckets of this kind are invalid here: " + "; ".join(skipped)
            if skipped
            else f"nothing tuned ({mode}) for {problem.dtype} causal={problem.causal} "
            f"D={problem.head_dim} GQA={problem.group} on {dev.name}"
        )
        return space.default(problem, dev), "fallback", why, None

    # ---- running -------------------------------------------------------------------------

    def _plan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        variant: Variant | None,
    ) -> _Plan:
        check_inputs(q, k, v)
        problem = Problem.from_tensors(q, k, v, causal)
        dev = device_info(q.device)
        if variant is None:
            choice = self.choose(problem, dev)
        else:
            reason = why_invalid(variant, problem, dev)
            if reason:
                raise ValueError(f"variant {variant} is invalid for {problem}: {reason}")
            choice = Choice(variant, "explicit", "variant= was given")
        check_runnable(q.device)
        launch = prepare_forward(choice.variant, problem, strict=choice.how == "explicit")
        return _Plan(launch, choice, default_scale(problem.head_dim))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        scale: float | None = None,
        variant: Variant | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, log-sum-exp) of the chosen variant. The fast path: after the first call of
        a shape, a call is one dict lookup, two allocations and the kernel launch."""
        try:
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
                   v.device, causal, variant)  # fmt: skip
            plan = self._plans.get(key)
        except (AttributeError, TypeError):  # not tensors, or not a Variant: _plan says which
            key, plan = None, None
        if plan is None:
            _check_variant_type(variant)
            plan = self._plan(q, k, v, causal, variant)
            try:  # the first launch compiles the kernel
                result = plan.launch(q, k, v, plan.scale if scale is None else scale)
            except Exception as exc:
                problem = Problem.from_tensors(q, k, v, causal)
                portable = default_variant(problem, device_info(q.device), fa3=False)
                why = self._give_way(plan.choice, portable, problem, q.device, exc)
                plan = _Plan(prepare_forward(portable, problem, strict=False),
                             Choice(portable, "fallback", why), plan.scale)
                result = plan.launch(q, k, v, plan.scale if scale is None else scale)
            if key is not None:
                self._plans[key] = plan
            return result
        return plan.launch(q, k, v, plan.scale if scale is None else scale)

    def _give_way(self, failed: Choice | BwdChoice, portable: AnyVariant, problem: Problem,
                  device: torch.device, exc: Exception) -> str:
        """Why `portable` replaces a chosen kernel that failed on its first launch (where
        Triton compiles it): a GPU nobody tuned may not build its default, and an attention
        call must not fail over a choice the caller never made. One warning per kernel;
        explicitly requested variants, out-of-memory and a failing portable default raise."""
        if (failed.how == "explicit" or failed.variant == portable
                or isinstance(exc, torch.cuda.OutOfMemoryError)):
            raise exc
        dev = device_info(device)
        error = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        why = f"{failed.variant} failed on {dev.name} ({type(exc).__name__}: {error})"
        kernel = (dev.key, str(failed.variant), problem.dtype, problem.causal, problem.head_dim)
        if kernel not in self._failed:  # other lengths and batches build the same source
            self._failed.add(kernel)
            log.warning("flashgen: %s for %s; running the portable default %s instead",
                        why, problem, portable)
        return why

    def backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool = False,
        scale: float | None = None,
        variant: BwdVariant | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) for the forward's saved tensors, with the chosen backward variant."""
        problem = Problem.from_tensors(q, k, v, causal)
        dev = device_info(q.device)
        if variant is not None:
            reason = why_invalid_bwd(variant, problem, dev)
            if reason:
                raise ValueError(f"backward variant {variant} is invalid for {problem}: {reason}")
            return run_backward(grad_out, q, k, v, out, lse, variant, problem, scale)
        choice = self.choose_bwd(problem, dev)
        try:
            return run_backward(grad_out, q, k, v, out, lse, choice.variant, problem, scale)
        except Exception as exc:
            portable = default_bwd_variant(problem, dev, fa3=False)
            why = self._give_way(choice, portable, problem, q.device, exc)
            self._bwd_choices[(problem, dev.key)] = BwdChoice(portable, "fallback", why)
            return run_backward(grad_out, q, k, v, out, lse, portable, problem, scale)

    def explain(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        variant: Variant | None = None,
        bwd_variant: BwdVariant | None = None,
    ) -> Choice:
        """Which variant `attention(q, k, v, causal=...)` would run, why, and from which row;
        its `backward` says the same of the backward pass (`bwd_variant`: an explicit one)."""
        _check_variant_type(variant)
        choice = self._plan(q, k, v, causal, variant).choice
        problem = Problem.from_tensors(q, k, v, causal)
        if bwd_variant is None:
            backward = self.choose_bwd(problem, q.device)
        else:
            reason = why_invalid_bwd(bwd_variant, problem, q.device)
            if reason:
                raise ValueError(f"backward variant {bwd_variant} is invalid for {problem}: "
                                 f"{reason}")
            backward = BwdChoice(bwd_variant, "explicit", "bwd_variant= was given")
        return replace(choice, backward=backward)


def _check_variant_type(variant: object) -> None:
    if variant is not None and not isinstance(variant, Variant):
        raise TypeError(f"variant must be a flashgen.Variant, got {type(variant).__name__}")


_default: Dispatcher | None = None


def default_dispatcher() -> Dispatcher:
    """The shared dispatcher behind `flashgen.attention` (databases read on first use)."""
    global _default
    if _default is None:
        _default = Dispatcher()
    return _default
