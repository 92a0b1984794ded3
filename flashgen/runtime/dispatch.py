"""Dispatch: which table entry runs a call, decided once per shape and then cached.

A `Dispatcher` reads each device's table once (`table`) and, per call shape, picks the entry
(`Table.lookup`: exact bucket, nearest valid bucket; else the default), prepares its launch and
caches it: after the first call of a shape, a call is one dict lookup, the allocations and the
launch. The forward and the backward pass are served alike.

Under `torch.use_deterministic_algorithms(True)` the backward serves only entries whose
gradients are bitwise equal run to run (`backward.why_nondeterministic`): a nondeterministic
tuned entry gives way to the next entry of its bucket (flashgen's tables follow such a winner
with its key's fastest deterministic trial), the nearest bucket, or the default; an explicit
nondeterministic `bwd_variant=` is an error, as torch's own ops without a deterministic
implementation are (a warning with `warn_only=True`). The flag is part of the backward plan's
key, so turning it on or off between calls is honoured.

What differs between flashgen and an exported package is data and these methods:
- `load_table`: where a device's table comes from (exports: table.json; flashgen: the tuning
  databases, through `flashgen.store.table`);
- `kernel`: how an entry's kernel is obtained (exports: a module of the package's `kernels/`;
  flashgen: the variant rendered for the call and loaded);
- `entry`: the entry that runs a given variant, or the default where the table holds none
  (exports: precomputed defaults, no explicit variants; flashgen: its default variants);
- `reject`: why an entry cannot serve a call beyond the rules the table carries (flashgen: its
  named validity rules; exports: whether the entry was exported with kernels for the call's
  modifier set, or why its variant refuses that set);
- `one_tile_entry`: the one-tile form that runs a persistent fa3 entry's tiles where the
  persistent kernel refuses the call's modifiers (flashgen: renders it; exports: the form
  exported for the set);
- `kernel_is_current`: whether a tuned row still names the kernel it was tuned with, asked
  once per row per process when the row is first considered;
- `portable`: what runs where a chosen kernel fails to build on its first launch (exports:
  their generic defaults; flashgen: its defaults without Gluon kernels).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from .backward import BwdLauncher, prepare_backward, why_nondeterministic
from .forward import Launcher, default_scale, prepare_forward
from .inputs import DTYPE_NAMES, check_inputs, check_options, check_runnable
from .kvcache import (
    DecodeShape,
    check_kvcache,
    debug_checks,
    prepare_decode,
    serves_as_decode,
)
from .modifiers import Mods, kvcache_mods
from .table import Choice, Entry, Shape, Table, bucket, mix_bucket, modifier_key

#: The package this runtime serves ("flashgen", or an exported package's name), which names
#: its logger and its torch.library namespace.
PACKAGE = (__package__ or __name__).rpartition(".")[0]
log = logging.getLogger(PACKAGE)
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}

#: Exact-shape decode plans kept before the dict starts again: a dynamic cache makes a new
#: shape every generated token (each maps to its bucket's plan, which stays).
MAX_DECODE_PLANS = 4096


class Saved(NamedTuple):
    """What a forward keeps for its backward: its inputs, output and log-sum-exp (O(N)
    memory), passed as one value because every backward call takes all five. A named tuple:
    every backward makes one, at a third of a frozen dataclass's cost."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


@dataclass(frozen=True)
class _Plan:
    """What a shape's calls reuse: the prepared launch, the choice, and the default scale."""

    launch: Any  # Launcher or BwdLauncher
    choice: Choice
    scale: float


class Dispatcher:
    """Serves the chosen entry of each call's device table (see the module docstring)."""

    #: By mode, the class an explicit `variant=` / `bwd_variant=` must be (flashgen's variant
    #: dataclasses, which also present table entries in `Choice`s). Empty: a package that runs
    #: its tuned kernels only.
    variant_types: ClassVar[Mapping[str, type]] = {}
    #: Whether `kernel` can give kernels rendered with modifiers (window, softcap, sinks) and
    #: for packed sequences: flashgen renders them on demand, an exported package has those
    #: of the sets it was exported with (and names the others' `--modifiers`).
    renders_modifiers: ClassVar[bool] = False
    #: Whether the decode family's kernels for left-padded caches (`cache_leftpad`) are
    #: there: flashgen renders them, exported packages ship none.
    renders_leftpad: ClassVar[bool] = False

    def __init__(self) -> None:
        self._tables: dict[torch.device, Table] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._bwd_plans: dict[tuple, _Plan] = {}
        self._decode_plans: dict[tuple, _Plan] = {}
        self._decode_buckets: dict[tuple, _Plan] = {}  # by Nk bucket (see _decode_plan)
        self._current: dict[int, str | None] = {}  # id(entry) -> kernel_is_current's answer
        self._decoded: dict[tuple[str, str], Any] = {}
        self._failed: set[tuple] = set()  # kernels whose failure to build was warned of

    # ---- what a package provides -----------------------------------------------------------

    def load_table(self, device: torch.device) -> Table:
        """The table of `device` (read once per device)."""
        raise NotImplementedError

    def kernel(self, entry: Entry, role: str, shape: Shape) -> Any:
        """The JIT function that plays `role` ("fwd", "preprocess", "dkdv", "dq"; with
        "_plain": the twin's; "decode", "decode_combine" for a `DecodeShape`) for `entry`
        on calls of `shape`'s kind."""
        raise NotImplementedError

    def entry(self, mode: str, variant: Any, shape: Shape, table: Table) -> Entry:
        """The entry that runs `variant` (None: the default for `shape`), where the table
        holds no default for it."""
        raise ValueError(f"{table.name} holds no default {mode} variants")

    def reject(self, mode: str, entry: Entry, shape: Shape, table: Table) -> str | None:
        """Why `entry` cannot serve `shape` (None: it can), beyond the table's own rules."""
        return None

    def kernel_is_current(self, mode: str, entry: Entry) -> str | None:
        """Why a tuned entry no longer names the kernel it was tuned with (None: it does).
        Asked once per entry, when it is first considered for a call."""
        return None

    def portable(self, mode: str, shape: Shape, table: Table) -> Entry | None:
        """The entry that runs where the chosen one fails on its first launch (None: the
        failure stands): the table's default, chosen to build on any GPU."""
        try:
            return table.default(mode, shape)
        except ValueError:
            return None

    # ---- variants in and out ---------------------------------------------------------------

    def present(self, mode: str, data: Mapping[str, Any]) -> Any:
        """An entry's variant as `Choice` shows it: a `variant_types` instance, else a dict."""
        cls = self.variant_types.get(mode)
        return cls(**data) if cls is not None else dict(data)

    def check_variant(self, mode: str, variant: Any) -> None:
        """TypeError unless `variant` is None or an explicit variant of `mode` this
        dispatcher runs."""
        if variant is None:
            return
        name = {"bwd": "bwd_variant"}.get(mode, "variant")  # the calls' parameter names
        cls = self.variant_types.get(mode)
        if cls is None:
            raise TypeError(f"{name}= is not supported here: {PACKAGE} runs its tuned "
                            "kernels only")
        if not isinstance(variant, cls):
            owner = cls.__module__.partition(".")[0]
            raise TypeError(f"{name} must be a {owner}.{cls.__name__}, got "
                            f"{type(variant).__name__}")

    def encode(self, mode: str, variant: Any) -> str:
        """`variant` as the text the torch.library op carries ("" for None)."""
        self.check_variant(mode, variant)
        if variant is None:
            return ""
        return json.dumps(dataclasses.asdict(variant), sort_keys=True)

    def decode(self, mode: str, text: str) -> Any:
        """The explicit variant `encode` gave `text` for (None for ""); cached."""
        if not text:
            return None
        variant = self._decoded.get((mode, text))
        if variant is None:
            variant = self._decoded[(mode, text)] = self.present(mode, json.loads(text))
        return variant

    # ---- choosing --------------------------------------------------------------------------

    def table(self, device: torch.device) -> Table:
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = self.load_table(device)
        return table

    def lookup(self, table: Table, mode: str, shape: Shape) -> tuple[Choice, Entry]:
        """The entry `shape` runs in `mode` when no variant is given, and how it was found."""
        if not table.tuned[mode] and not table.noticed:
            table.noticed = True  # one notice per table: the first mode found untuned
            notice = table.data.get("untuned", {}).get(mode)
            if notice:
                log.warning(notice)
        deterministic = mode == "bwd" and torch.are_deterministic_algorithms_enabled()

        def check(e: Entry) -> str | None:
            if deterministic and (why := why_nondeterministic(e)):
                return f"{why} (deterministic algorithms are on)"
            return self.reject(mode, e, shape, table) or self._stale(mode, e)

        entry, how, reason = table.lookup(mode, shape, check)
        if entry is None and mode == "fwd" and modifier_key(shape):
            entry, how, reason = self._one_tile_form(table, shape) or (entry, how, reason)
        if entry is None:
            entry = table.default(mode, shape) or self.entry(mode, None, shape, table)
            if deterministic:
                self._refuse_nondeterministic(entry, f"{table.name}'s default for {shape}")
        return Choice(self.present(mode, entry["variant"]), how, reason,
                      entry.get("source")), entry

    def _one_tile_form(self, table: Table, shape: Shape) -> tuple[Entry, str, str] | None:
        """A modified or packed forward that no row serves, because the plain winners near
        it are persistent fa3 kernels (whose tile walk takes no window, and whose modifiers
        and packing serve only where tuned with them, `table.modified_untuned`): the
        nearest of them runs as the one-tile fa3 kernel of the same tiles, warps and stages,
        which takes every modifier. It comes closer to the tuned kernel than the untuned
        default does (docs/varlen-and-modifiers.md)."""
        made: dict[int, Entry] = {}

        def check(e: Entry) -> str | None:
            data = e["variant"]
            if not (data.get("loop_order") == "fa3" and data.get("programs_per_sm")):
                return "not a persistent fa3 kernel"
            one = self.one_tile_entry(e, shape, table)
            if one is None:
                return "no one-tile form here"
            if "source" in e:  # `explain` names the row whose tiles these are
                one = {**one, "source": e["source"]}
            made[id(e)] = one
            return self._stale("fwd", e) or self.reject("fwd", one, shape, table)

        found = table.nearest_plain("fwd", shape, check)
        if found is None:
            return None
        e, got = found
        return made[id(e)], "nearest", (
            f"nothing tuned with modifiers {modifier_key(shape)!r}; the persistent fa3 "
            f"winner of plain attention, bucket {got}, run as the one-tile fa3 kernel of its "
            f"tiles, warps and stages")

    def one_tile_entry(self, e: Entry, shape: Shape, table: Table) -> Entry | None:
        """The entry of persistent fa3 winner `e`'s one-tile form (its tiles, warps and
        stages on the one-tile kernel) for `shape` (None: this dispatcher has none)."""
        if self.variant_types.get("fwd") is None:
            return None
        return self.entry("fwd", self.present("fwd", {
            **e["variant"], "programs_per_sm": 0, "pingpong": False, "head_units": False}),
            shape, table)

    def _refuse_nondeterministic(self, entry: Entry, what: str) -> None:
        """Under deterministic algorithms, a RuntimeError (a warning with warn_only) where
        `entry`'s backward is not deterministic, worded as torch words its own."""
        why = why_nondeterministic(entry)
        if why is None:
            return
        message = (f"{PACKAGE}: backward variant {self.present('bwd', entry['variant'])} "
                   f"({what}) does not have a deterministic implementation: {why}; but you "
                   "set torch.use_deterministic_algorithms(True). Pass a bwd_variant with "
                   "dq_mode='separate', or turn determinism off for this call.")
        if torch.is_deterministic_algorithms_warn_only_enabled():
            warnings.warn(message, UserWarning, stacklevel=4)
        else:
            raise RuntimeError(message)

    def _stale(self, mode: str, entry: Entry) -> str | None:
        key = id(entry)  # entries live as long as their table, which this dispatcher keeps
        if key not in self._current:
            self._current[key] = self.kernel_is_current(mode, entry)
        return self._current[key]

    def _explicit(self, mode: str, variant: Any, shape: Shape, table: Table) -> Entry:
        """The entry of an explicit variant; an invalid one is an error, never a fallback."""
        self.check_variant(mode, variant)
        entry = self.entry(mode, variant, shape, table)
        reason = self.reject(mode, entry, shape, table)
        if reason:
            what = {"fwd": "variant", "bwd": "backward variant"}.get(mode, f"{mode} variant")
            raise ValueError(f"{what} {variant} is invalid for {shape}: {reason}")
        if mode == "bwd" and torch.are_deterministic_algorithms_enabled():
            self._refuse_nondeterministic(entry, "given as bwd_variant=")
        return entry

    def _choose(self, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool, variant: Any, mods: Mods | None = None,
                ) -> tuple[Choice, Entry, Shape]:
        check_options(causal, None)
        if mods is not None and mods.varlen is not None:
            # Packed: the public call checked the tensors; lengths are the longest sequence's.
            lens = mods.varlen
            shape = Shape(lens.batch, q.shape[1], k.shape[1], lens.max_q, lens.max_k,
                          q.shape[2], DTYPE_NAMES[q.dtype], bool(causal),
                          mix=mix_bucket(lens.batch, lens.max_q, q.shape[0]))
        elif mods is not None and mods.fp8 is not None:
            check_inputs(q, k, v, fp8=True)  # the public call checked dtypes and descales
            b, hq, nq, d = q.shape
            shape = Shape(b, hq, k.shape[1], nq, k.shape[2], d, "fp8", bool(causal))
        else:
            check_inputs(q, k, v)
            shape = Shape.of(q, k, causal)
        if mods is not None:
            # fp8 kernels ship like any other (their dtype is the entry's); modifiers need
            # kernels rendered with them (`renders_modifiers`).
            if not self.renders_modifiers and any(mods.flags):
                raise ValueError(f"{PACKAGE} ships plain attention kernels only: window, "
                                 "softcap, sinks and attention_varlen need flashgen itself")
            window, softcap, sinks, varlen = mods.flags
            shape = shape._replace(window=window, softcap=softcap, sinks=sinks, varlen=varlen)
        # Before the lookup: its notice of an untuned device would suggest tuning a call
        # that cannot run here (bf16 on the CPU).
        check_runnable(q.device, q.dtype)
        table = self.table(q.device)
        if variant is None:
            choice, entry = self.lookup(table, mode, shape)
        else:
            entry = self._explicit(mode, variant, shape, table)
            choice = Choice(variant, "explicit", f"{'bwd_' if mode == 'bwd' else ''}variant= "
                            "was given")
        return choice, entry, shape

    def _kernels(self, entry: Entry, shape: Shape) -> Callable[[str], Any]:
        return lambda role: self.kernel(entry, role, shape)

    # ---- running ---------------------------------------------------------------------------

    def _plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              variant: Any, mods: Mods | None = None) -> _Plan:
        try:
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
                   v.device, causal, variant)  # fmt: skip
            if mods is not None:
                key = (*key, mods.plan_key)
            plan = self._plans.get(key)
        except (AttributeError, TypeError):  # not tensors, or an unhashable variant
            key, plan = None, None
        if plan is None and variant is None and mods is None:
            check_inputs(q, k, v)
            if serves_as_decode(q.shape[2], k.shape[2]):
                plan = self._decode_as_forward(q, k, v, causal)
                if key is not None:
                    self._plans[key] = plan
                return plan
        if plan is None:
            choice, entry, shape = self._choose("fwd", q, k, v, causal, variant, mods)

            def make(found: Entry) -> Launcher:
                return prepare_forward(found, shape, self._kernels(found, shape),
                                       strict=variant is not None)

            plan = _Plan(make(entry), choice, default_scale(shape.head_dim))
            if variant is None:
                plan = self._guard("fwd", plan, entry, shape, self.table(q.device), make,
                                   self._plans, key)
            if key is not None:
                self._plans[key] = plan
        return plan

    def _decode_as_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           causal: bool) -> _Plan:
        """A forward plan that runs the decode family (`kvcache.serves_as_decode`) on checked
        q, k, v: k and v are a contiguous cache every sequence of which is full, which the
        kernel is told by a missing length tensor (no tensor is made for it: a plan first
        made under CUDA graph capture would hold one that only the graph fills)."""
        check_options(causal, None)
        b, hq, nq, d = q.shape
        shape = DecodeShape(b, hq, k.shape[1], nq, k.shape[2], d, DTYPE_NAMES[q.dtype],
                            causal, 0)
        plan = self._decode_prepared(shape, q.device, None)

        def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
            return plan.launch(q, k, v, None, None, scale)

        reason = (f"decode family: Nq {nq} against Nk {k.shape[2]}; "
                  f"{plan.choice.how}: {plan.choice.reason}")
        return _Plan(launch, dataclasses.replace(plan.choice, reason=reason), plan.scale)

    def _decode_prepared(self, shape: DecodeShape, device: torch.device,
                         variant: Any) -> _Plan:
        """The chosen decode entry for `shape`, its launch prepared."""
        table = self.table(device)
        if variant is None:
            choice, entry = self.lookup(table, "decode", shape)  # type: ignore[arg-type]
        else:
            entry = self._explicit("decode", variant, shape, table)  # type: ignore[arg-type]
            choice = Choice(variant, "explicit", "decode_variant= was given")
        check_runnable(device, _DTYPES[shape.dtype])
        kernels = self._kernels(entry, shape)  # type: ignore[arg-type]
        return _Plan(prepare_decode(entry, shape, kernels), choice,
                     default_scale(shape.head_dim))

    def _decode_plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     seqlens: torch.Tensor | None, block_table: torch.Tensor | None,
                     causal: bool,
                     variant: Any, mods: Mods | None = None,
                     leftpad: torch.Tensor | None = None) -> _Plan:
        """The decode plan of a call's shape (`runtime.kvcache`), checked and chosen on the
        first call of its shape (a contiguous cache's: of its Nmax bucket); later calls are a
        dict lookup (the value checks run again where they need no GPU sync: CPU tensors, or
        FLASHGEN_DEBUG=1)."""
        try:
            table_kind = (None if block_table is None
                          else (block_table.shape, block_table.dtype, block_table.device))
            pads = None if leftpad is None else (leftpad.shape, leftpad.dtype, leftpad.device)
            if block_table is None and variant is None:
                # A dynamic cache grows Nmax a step. Every check passes alike for any Nmax of
                # one bucket (0, an empty cache, apart), and the plan is the bucket's: so the
                # key holds the bucket, and a generated token pays neither checks nor miss.
                n = k.shape[2]
                caches: tuple = (k.shape[:2], k.shape[3], bucket(n) if n else 0,
                                 k.shape == v.shape)
            else:
                caches = (k.shape, v.shape)
            lengths = (None if seqlens is None
                       else (seqlens.shape, seqlens.dtype, seqlens.device))
            key = (q.shape, caches, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                   lengths, table_kind, causal, variant,
                   None if mods is None else mods.plan_key, pads)  # fmt: skip
            plan = self._decode_plans.get(key)
        except (AttributeError, TypeError, IndexError):  # not 4-D tensors, unhashable variant
            key, plan = None, None
        if plan is not None:
            if (seqlens if seqlens is not None else q).device.type == "cpu" or debug_checks():
                check_kvcache(q, k, v, seqlens, block_table, causal, leftpad)
            return plan
        check_options(causal, None)
        shape = check_kvcache(q, k, v, seqlens, block_table, causal, leftpad)
        if shape.leftpad and not self.renders_leftpad:
            # Before the lookup, whose errors would suggest an export that cannot help.
            raise ValueError(f"{PACKAGE} ships no cache_leftpad kernels: left-padded caches "
                             "need flashgen itself")
        if mods is not None:  # the structure its kernels render
            window, softcap, sinks, _ = mods.flags
            shape = shape._replace(window=window, softcap=softcap, sinks=sinks)
        if variant is None:
            # A dynamic cache grows a key a step, so each step is a new shape: its plan is the
            # one of its Nk bucket, chosen for the bucket's longest cache (the launcher reads
            # the length from the tensors; every variant computes the same function at any
            # length, and a choice made for the first length seen would depend on the call
            # order). Otherwise every generated token paid the lookup and preparation again.
            top = shape._replace(seq_k=bucket(shape.seq_k))
            plan = self._decode_buckets.get((top, q.device))
            if plan is None:
                plan = self._decode_buckets[(top, q.device)] = self._decode_prepared(
                    top, q.device, None)
        else:  # an explicit variant is checked against the call's own shape
            plan = self._decode_prepared(shape, q.device, variant)
        if key is not None:
            if len(self._decode_plans) >= MAX_DECODE_PLANS:  # a long generation's steps
                self._decode_plans.clear()
            self._decode_plans[key] = plan
        return plan

    def kvcache(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None = None,
                causal: bool = True, scale: float | None = None,
                variant: Any = None, mods: Mods | None = None,
                leftpad: torch.Tensor | None = None,
                keep_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, log-sum-exp) of the decode family on a KV cache (`attention_with_kvcache`);
        `mods`: its window, softcap and sinks (checked), None for none; `leftpad`: the
        call's `cache_leftpad`; `keep_lse` False: the caller drops the log-sum-exp, which
        then lives in a scratch buffer the next call on the stream overwrites."""
        plan = self._decode_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal,
                                 variant, mods, leftpad)
        return plan.launch(q, k_cache, v_cache, cache_seqlens, block_table,
                           plan.scale if scale is None else scale, mods, leftpad, keep_lse)

    def explain_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cache_seqlens: torch.Tensor | None,
                        block_table: torch.Tensor | None = None,
                        causal: bool = True, variant: Any = None, *,
                        window: tuple[int, int] | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None,
                        cache_leftpad: torch.Tensor | None = None) -> Choice:
        """Which decode variant `attention_with_kvcache` runs for these inputs (and
        modifiers, which render kernels of their own), and why."""
        return self._decode_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal,
                                 variant, kvcache_mods(q, window, softcap, sinks),
                                 cache_leftpad).choice

    def _bwd_plan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  variant: Any, mods: Mods | None = None) -> _Plan:
        try:
            key = (q.shape, k.shape, v.shape, q.dtype, q.device, causal, variant,
                   torch.are_deterministic_algorithms_enabled())
            if mods is not None:
                key = (*key, mods.plan_key)
            plan = self._bwd_plans.get(key)
        except (AttributeError, TypeError):
            key, plan = None, None
        if plan is None:
            choice, entry, shape = self._choose("bwd", q, k, v, causal, variant, mods)
            table = self.table(q.device)

            def make(found: Entry) -> BwdLauncher:
                return prepare_backward(found, shape, self._kernels(found, shape),
                                        table.preprocess_block_m)

            plan = _Plan(make(entry), choice, default_scale(shape.head_dim))
            if variant is None:
                plan = self._guard("bwd", plan, entry, shape, table, make, self._bwd_plans,
                                   key)
            if key is not None:
                self._bwd_plans[key] = plan
        return plan

    def _guard(self, mode: str, plan: _Plan, entry: Entry, shape: Shape, table: Table,
               make: Callable[[Entry], Any], plans: dict[tuple, _Plan],
               key: tuple | None) -> _Plan:
        """`plan` whose first launch, where Triton compiles the kernel, gives way if the
        chosen kernel fails there: a GPU nobody tuned may not build its default, and a call
        must not fail over a choice its caller never made. The `portable` entry runs instead,
        with one warning per kernel; where it is the failing one, the error stands (so does
        an explicit variant's: it is never guarded). After the first launch `plans` holds the
        plan that worked, so later calls pay nothing for the guard."""

        def first(*args: Any) -> Any:
            try:
                result = plan.launch(*args)
            except Exception as exc:
                fallback = self.portable(mode, shape, table)
                if (fallback is None or fallback["variant"] == entry["variant"]
                        or isinstance(exc, torch.cuda.OutOfMemoryError)
                        or (mode == "bwd" and torch.are_deterministic_algorithms_enabled()
                            and why_nondeterministic(fallback))):
                    raise
                why = self._gave_way(mode, entry, fallback, shape, table, exc)
                chosen = _Plan(make(fallback), Choice(self.present(mode, fallback["variant"]),
                                                      "fallback", why), plan.scale)
                if key is not None:
                    plans[key] = chosen
                return chosen.launch(*args)
            if key is not None:
                plans[key] = plan
            return result

        return dataclasses.replace(plan, launch=first)

    def _gave_way(self, mode: str, entry: Entry, fallback: Entry, shape: Shape, table: Table,
                  exc: Exception) -> str:
        """Why `fallback` runs instead of `entry`; logged once per kernel (other lengths and
        batches of the kind build the same one)."""
        error = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        failed = self.present(mode, entry["variant"])
        why = f"{failed} failed on {table.name} ({type(exc).__name__}: {error})"
        kernel = (table.name, mode, json.dumps(entry["variant"], sort_keys=True), shape.dtype,
                  shape.causal, shape.head_dim)
        if kernel not in self._failed:
            self._failed.add(kernel)
            log.warning("%s: %s for %s; running the portable default %s instead", PACKAGE,
                        why, shape, self.present(mode, fallback["variant"]))
        return why

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        scale: float | None = None,
        variant: Any = None,
        mods: Mods | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, log-sum-exp) of the chosen variant. The fast path: after the first call of
        a shape, a call is one dict lookup, two allocations and the kernel launch. `mods`:
        the call's modifiers and packed layout (`flashgen.runtime.modifiers`), checked."""
        if mods is not None:
            plan = self._plan(q, k, v, causal, variant, mods)
            return plan.launch(q, k, v, plan.scale if scale is None else scale, mods)
        try:
            plan = self._plans.get((q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
                                    q.device, k.device, v.device, causal, variant))
        except (AttributeError, TypeError):
            plan = None
        if plan is None:
            plan = self._plan(q, k, v, causal, variant)
        return plan.launch(q, k, v, plan.scale if scale is None else scale)

    def backward(self, grad_out: torch.Tensor, saved: Saved, causal: bool = False,
                 scale: float | None = None, variant: Any = None, mods: Mods | None = None,
                 ) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv) for the forward's saved tensors, with the chosen backward variant
        (a deterministic one under `torch.use_deterministic_algorithms(True)`); with sinks
        among `mods`, also dsinks (float32)."""
        q, k, v = saved.q, saved.k, saved.v
        plan = self._bwd_plan(q, k, v, causal, variant, mods)
        scale = plan.scale if scale is None else scale
        if mods is not None:
            return plan.launch(grad_out, q, k, v, saved.out, saved.lse, scale, mods)
        return plan.launch(grad_out, q, k, v, saved.out, saved.lse, scale)

    def explain(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        variant: Any = None,
        bwd_variant: Any = None,
        mods: Mods | None = None,
    ) -> Choice:
        """Which variant `attention(q, k, v, causal=...)` runs, why, and from which row; its
        `backward` says the same of the backward pass (`bwd_variant`: an explicit one).
        `mods`: the call's modifiers (see `forward`)."""
        choice = self._plan(q, k, v, causal, variant, mods).choice
        if mods is not None and mods.fp8 is not None:
            return choice  # fp8 is forward only
        return dataclasses.replace(
            choice, backward=self._bwd_plan(q, k, v, causal, bwd_variant, mods).choice)


# ---- the package's default dispatcher -------------------------------------------------------

_factory: Callable[[], Dispatcher] | None = None
_default: Dispatcher | None = None


def serve(factory: Callable[[], Dispatcher]) -> None:
    """Make `factory()` the dispatcher behind this package's `attention` (and its
    torch.library op), built on first use."""
    global _factory, _default
    _factory, _default = factory, None


def default_dispatcher() -> Dispatcher:
    """The shared dispatcher behind `attention` (tables read on first use)."""
    global _default
    if _default is None:
        if _factory is None:
            raise RuntimeError(f"{PACKAGE}'s runtime has no dispatcher: import {PACKAGE}")
        _default = _factory()
    return _default
