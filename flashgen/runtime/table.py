"""The winners table: plain data, and the rule that picks an entry of it for a call.

One device's table is a dict (JSON in an exported package, built from the tuning databases
in flashgen):

    {"fwd": [entry, ...], "bwd": [entry, ...],     tuned entries, highest precedence first
     "fwd_defaults": [...], "bwd_defaults": [...],  optional: defaults per clamped bucket
     "lengths": [16, ..., 256],                     the buckets the defaults are given for
     "fwd_key_lengths": [16, ..., 4096],            optional: the forward's key buckets
     "modifier_sets": {"k": "softcap", ...},        optional: an export's modifier sets
     "no_defaults": [...],                          optional: kinds without defaults, and why
     "preprocess_block_m": 64,                      rows per backward preprocessing program
     "untuned": {"fwd": "...", "bwd": "..."},       optional: logged once if a mode has none
     "unread": ["<path> (<why>)", ...]}             optional: databases that could not be read

An entry holds the bucket it was tuned for ("dtype", "causal", "head_dim", "gqa",
"seq_q_bucket", "seq_k_bucket"; defaults have no "gqa"), "variant" (the knobs, a dict),
"twin" (the knobs of what runs where TMA cannot address the inputs, for variants that use
it), and optionally "kernels" (role -> module, exports), "need" (the smallest power-of-two
query and key lengths its tiles fit), "source" (the database row), "role" (what it is to its
bucket where it is not the winner, such as the fastest deterministic trial that follows a
nondeterministic backward winner) and what a dispatcher's `kernel_is_current` reads (such as
the hash of the kernel the row was tuned with).

For a call: the exact (dtype, causal, head dim, GQA ratio, Nq bucket, Nk bucket) entry (lengths
bucketed by `bucket`'s ladder of 1.5x steps); else the nearest tuned bucket of the same kind
that is valid for the call; else the default.

Entries tuned on modified or packed problems carry "modifiers" (`modifier_key`: "w", "k",
"s", "v4", "wv2", ...; absent or "" for plain ones), part of their kind. A modified call looks
among the entries of its own modifiers first, then among the plain ones, then the default.

"decode" entries (the decode family, `runtime.kvcache`) carry two more fields: "page_size" (0
for contiguous caches), part of their kind, and "bh_bucket", the bucket of batch x Hkv (the
programs a split launches besides its splits), measured in the distance with the lengths.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from .inputs import DTYPE_NAMES

Entry = Mapping[str, Any]
#: Why an entry cannot serve a call (None: it can).
Check = Callable[[Entry], "str | None"]
MODES: tuple[str, ...] = ("fwd", "bwd", "decode")
#: The modifiers and layout a call may ask for beyond causal (flashgen's `Problem` has them).
MODIFIERS: tuple[str, ...] = ("window", "softcap", "sinks", "varlen")
#: Each modifier's letter in an entry's "modifiers" (flashgen's `Problem.modifier_key`).
_LETTERS: dict[str, str] = {"window": "w", "softcap": "k", "sinks": "s", "varlen": "v"}


def mix_bucket(batch: int, longest: int, tokens: int) -> int:
    """The length mix of packed sequences: the power of two nearest max / mean length
    (flashgen's `problem.mix_bucket`, the same rule)."""
    ratio = longest * batch / max(1, tokens)
    return 1 << max(0, round(math.log2(max(1.0, ratio))))


def modifier_letters(shape: Any) -> str:
    """A call's modifiers as kernel structure: `modifier_key` without the length mix (which
    changes no kernel), "" for plain attention."""
    return "".join(_LETTERS[n] for n in MODIFIERS if getattr(shape, n, False))


def modifier_names(letters: str) -> str:
    """The modifiers of `letters` by name, joined by "+" (as `flashgen export --modifiers`
    takes a set)."""
    return "+".join(n for n in MODIFIERS if _LETTERS[n] in letters)


def modifier_key(shape: Any) -> str:
    """A call's modifiers as its entries' "modifiers" field: "" for plain attention, else a
    letter each (window w, softcap k, sinks s, varlen v and its mix bucket), e.g. "wv4"."""
    key = "".join(_LETTERS[n] for n in MODIFIERS if getattr(shape, n, False))
    if getattr(shape, "varlen", False):
        key += str(getattr(shape, "mix", 0) or 1)
    return key


#: flashgen's `Problem` fields, in its order, so that each converts to the other in one call
#: (`Problem(*shape)`); written as one list, not restated field by field.
_SHAPE = NamedTuple("_SHAPE", [  # noqa: UP014
    ("batch", int), ("heads_q", int), ("heads_kv", int), ("seq_q", int), ("seq_k", int),
    ("head_dim", int), ("dtype", str), ("causal", bool), ("window", bool), ("softcap", bool),
    ("sinks", bool), ("varlen", bool), ("mix", int)])
_SHAPE.__new__.__defaults__ = (False, False, False, False, 0)


class Shape(_SHAPE):
    """What a call asks for: q is B x Hq x Nq x D, k and v B x Hkv x Nk x D."""

    __slots__ = ()

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, causal: bool) -> Shape:
        b, hq, nq, d = q.shape
        return cls(b, hq, k.shape[1], nq, k.shape[2], d, DTYPE_NAMES[q.dtype], bool(causal))

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads_q // self.heads_kv

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        mods = "".join(f" {name}" for name in MODIFIERS if getattr(self, name))
        return (f"B{self.batch} Hq{self.heads_q} Hkv{self.heads_kv} Nq{self.seq_q} "
                f"Nk{self.seq_k} D{self.head_dim} {self.dtype} {mask}{mods}")


@dataclass(frozen=True)
class Choice:
    """The variant a call runs, how it was found ("explicit", "exact", "nearest" or
    "fallback"), why, and the database row behind it. `explain` also fills in `backward`:
    what the call's backward pass runs."""

    variant: Any
    how: str
    reason: str
    source: str | None = None  # "<database> winners[<key id>] trial <id>"
    backward: Choice | None = None

    def __str__(self) -> str:
        # The row's line stays whole: its key id holds the GPU's name, spaces and all, and
        # a folded id cannot be copied back.
        return "\n".join(line if line.startswith(FROM) else _fold(line)
                         for line in self._lines())

    def _lines(self) -> list[str]:
        """The text's lines before folding: the choice, its row, then the backward's."""
        # A dict where no variant class is at hand (an exported package): one line of knobs.
        variant = (" ".join(f"{k}={v}" for k, v in self.variant.items())
                   if isinstance(self.variant, dict) else self.variant)
        lines = [f"{variant} ({self.how}): {self.reason}"]
        if self.source:
            lines.append(f"{FROM}{self.source}")
        if self.backward is not None:
            first, *rest = self.backward._lines()
            lines += [f"backward: {first}", *rest]
        return lines


#: `Choice`'s text is folded to this width (what a terminal of 80 columns shows whole).
TEXT_WIDTH = 80
#: How `Choice`'s text begins the line naming its database row.
FROM = "  from: "


def _fold(line: str) -> str:
    """`line` folded at `TEXT_WIDTH` on spaces, continued 4 spaces in; a word longer than
    the width (a file path) stays whole on its own line."""
    if len(line) <= TEXT_WIDTH:
        return line
    return textwrap.fill(line, TEXT_WIDTH, subsequent_indent="    ", break_long_words=False,
                         break_on_hyphens=False)


def source_file(e: Entry) -> str | None:
    """The name of the database file an entry's row comes from (its "source" reads "<path>
    winners[<key>] trial <id>"), or None for an entry without one (a default)."""
    source = e.get("source")
    if not source or " winners[" not in source:
        return None
    return source.split(" winners[", 1)[0].rsplit("/", 1)[-1]


def pow2(n: int) -> int:
    """The next power of two of `n` (n itself if it is one): the batch x Hkv bucket, and the
    lengths the tile rule and the default grids are given for."""
    return 1 << (n - 1).bit_length()


def bucket(n: int) -> int:
    """The length bucket of `n`: the smallest step of the ladder 1, 2, 3, 4, 6, 8, 12, 16,
    24, ... (powers of two and three quarters of each from 4 on) at or above `n` (flashgen's
    `store.keys.seq_bucket`, the same rule)."""
    top = pow2(n)
    three_quarters = top // 4 * 3
    return three_quarters if top >= 4 and n <= three_quarters else top


def knobs(data: Mapping[str, Any]) -> SimpleNamespace:
    """A variant's knobs as attributes, as flashgen's variant classes have them: the launch
    code reads either."""
    return SimpleNamespace(**data)


def modified_untuned(v: Any) -> str | None:
    """Why a forward winner tuned on plain attention may not serve a modified call with the
    modifiers rendered in (None: it may). A dispatch rule: the persistent fa3 kernel's
    modifiers serve only where a key tuned with them put them through its gate."""
    if getattr(v, "loop_order", "") == "fa3" and getattr(v, "programs_per_sm", 0):
        return ("the persistent fa3 kernel runs softcap, sinks and packed sequences only where "
                "tuned with them")
    return None


def head_units_leave_programs_idle(v: Any, p: Any, sm_count: int) -> str | None:
    """Why a whole-heads (head_units) winner should not serve call `p` (a `Shape` or a
    `Problem`): given too few heads, whole heads keep fewer of its programs busy than tile
    pairs would (8 heads of 4 Q tiles keep 8 programs busy, pairs 16).

    A dispatch rule, not a validity one: the kernel computes the same answer at any batch, so
    explicit variants, checks and the tuner run it. A program per SM (at most one per tile);
    a head costs its busiest program num_m (num_m + 1) / 2 K/V tiles, a pair num_m + 1.
    """
    if not (getattr(v, "head_units", False) and p.causal):
        return None
    num_m, heads = -(-p.seq_q // v.block_m), p.batch * p.heads_q
    programs = min(num_m * heads, sm_count)
    pairs = -(-num_m // 2)
    if (-(-heads // programs) * num_m * (num_m + 1) // 2
            > -(-heads * pairs // programs) * (num_m + 1)):
        return (f"head_units: {heads} heads of {num_m} Q tiles would keep fewer of the "
                f"{programs} programs busy than tile pairs")
    return None


def _family(e: Entry) -> tuple[str, bool, int]:
    return e["dtype"], e["causal"], e["head_dim"]


def _kind(mode: str, e: Entry) -> tuple:
    """What a tuned entry must share with a call to serve it (decode adds the page size;
    entries of modified problems their "modifiers", absent or "" for plain ones)."""
    extra = (e["page_size"],) if mode == "decode" else ()
    return (*_family(e), e["gqa"], *extra, e.get("modifiers", ""))


def _call_kind(mode: str, shape: Any, modifiers: str = "") -> tuple:
    extra = (shape.page_size,) if mode == "decode" else ()
    return (shape.dtype, shape.causal, shape.head_dim, shape.group, *extra, modifiers)


class Table:
    """One device's table (see the module docstring), indexed for lookup.

    `device` is whatever the owner's rules judge entries against (flashgen: its DeviceInfo);
    `name` says which table this is in messages; `sm_count` sizes the whole-heads rule.
    """

    def __init__(self, data: Mapping[str, Any], name: str, sm_count: int,
                 device: Any = None) -> None:
        self.data, self.name, self.sm_count, self.device = data, name, sm_count, device
        self.lengths: list[int] = list(data.get("lengths", ()))
        #: The forward default grids' key lengths: `lengths`, then powers of two up to where
        #: flashgen's defaults stop choosing by key count.
        self.fwd_key_lengths: list[int] = list(data.get("fwd_key_lengths", self.lengths))
        self.preprocess_block_m: int = data["preprocess_block_m"]
        self.tuned: dict[str, dict[tuple, list[Entry]]] = {m: {} for m in MODES}
        self.defaults: dict[str, dict[tuple, dict[tuple[int, int], Entry]]] = {}
        for mode in MODES:
            for e in data.get(mode, ()):
                self.tuned[mode].setdefault(_kind(mode, e), []).append(e)
            # Default grids by family and modifier set (an exported package's grids with
            # the modifiers rendered in carry the set's letters, `modifier_letters`).
            if mode == "decode":
                if "decode_defaults" in data:
                    grid = self.defaults.setdefault(mode, {})
                    for e in data["decode_defaults"]:
                        grid.setdefault((*_family(e), e.get("modifiers", "")), {})[
                            (e["rows"], e["page_size"])] = e
            elif f"{mode}_defaults" in data:
                grid = self.defaults.setdefault(mode, {})
                for e in data[f"{mode}_defaults"]:
                    grid.setdefault((*_family(e), e.get("modifiers", "")), {})[
                        (e["seq_q_bucket"], e["seq_k_bucket"])] = e
        self.noticed = False  # whether the untuned notice was given
        #: An exported package's modifier sets (letters -> names; None: not recorded, as in
        #: flashgen's own tables), and the kinds its export found no default for, with why.
        self.exported_sets: Mapping[str, str] | None = data.get("modifier_sets")
        self.no_defaults: dict[tuple, str] = {
            (e["mode"], e["dtype"], e["causal"], e["head_dim"], e.get("modifiers", "")):
            e["reason"] for e in data.get("no_defaults", ())}

    def lookup(self, mode: str, shape: Shape, check: Check) -> tuple[Entry | None, str, str]:
        """(entry, how, reason): the exact or nearest tuned entry that `check` and the tile
        and whole-heads rules let serve `shape`, or (None, "fallback", why) if none does.
        A modified call looks among the entries tuned with its own modifiers first, then
        among the plain ones (their variants run with the modifiers rendered in)."""
        mods = modifier_key(shape) if mode != "decode" else ""
        skipped: list[str] = []
        if mods:
            found = self._search(mode, shape, check, mods, skipped)
            if found is not None:
                e, got, want = found
                passed = f" (passed over: {'; '.join(skipped)})" if skipped else ""
                what = f"tuned winner with modifiers {mods!r}"
                if got == want:
                    return e, "exact", f"{e.get('role', what)} for this bucket {got}{passed}"
                return e, "nearest", (f"no {what} for bucket {want}; nearest bucket {got} "
                                      f"is valid here{passed}")
        plain_check = check
        if mods and mode == "fwd":
            def plain_check(e: Entry) -> str | None:
                return modified_untuned(knobs(e["variant"])) or check(e)
        found = self._search(mode, shape, check=plain_check, mods="", skipped=skipped)
        passed = f" (passed over: {'; '.join(skipped)})" if skipped else ""
        if found is not None:
            e, got, want = found
            if mods:
                # Rows tuned on plain attention; a valid one's variant serves the call with
                # the modifiers rendered in (the validity rules judged it with them).
                names = ", ".join(n for n in MODIFIERS if getattr(shape, n, False))
                none = f"nothing tuned with modifiers {mods!r}; "
                return e, "nearest", (f"{none}tuned winner of plain attention, bucket {got}, "
                                      f"run with {names}{passed}")
            if got == want:
                role = e.get("role", "tuned winner")
                return e, "exact", f"{role} for this bucket {got}{passed}"
            return e, "nearest", (f"no winner for bucket {want}; nearest tuned "
                                  f"bucket {got} is valid here{passed}")
        if skipped:
            return None, "fallback", "tuned buckets of this kind are invalid here: " + "; ".join(
                skipped)
        unread = self.data.get("unread")
        unread = f"; not read: {'; '.join(unread)}" if unread else ""
        return None, "fallback", (f"nothing tuned ({mode}) for {shape.dtype} causal="
                                  f"{shape.causal} D={shape.head_dim} GQA={shape.group} on "
                                  f"{self.name}{unread}")

    def nearest_plain(self, mode: str, shape: Shape,
                      check: Check) -> tuple[Entry, tuple] | None:
        """The nearest entry tuned on plain attention of `shape`'s kind that `check` lets
        serve it, and its bucket (None: none does). The whole-heads rule is left to
        `check`: a caller that runs another form of the row (without whole heads) asks."""
        found = self._search(mode, shape, check, "", [], whole_heads=False)
        return None if found is None else found[:2]

    def _search(self, mode: str, shape: Shape, check: Check, mods: str, skipped: list[str],
                whole_heads: bool = True) -> tuple[Entry, tuple, tuple] | None:
        """The nearest entry of `shape`'s kind tuned with modifiers `mods` that may serve
        it, with its bucket and the call's; each passed over is added to `skipped`.
        `whole_heads`: apply the whole-heads dispatch rule to each entry's variant."""
        want_q, want_k = bucket(shape.seq_q), bucket(shape.seq_k)
        want_bh = pow2(shape.batch * shape.heads_kv)

        def distance(e: Entry) -> tuple[float, int]:
            d = (abs(math.log2(e["seq_q_bucket"] / want_q))
                 + abs(math.log2(e["seq_k_bucket"] / want_k)))
            if "bh_bucket" in e:
                d += abs(math.log2(e["bh_bucket"] / want_bh))
            return d, -e["seq_q_bucket"]  # ties: the longer bucket (better tuned for big work)

        label = f" {mods}" if mods else ""
        entries = self.tuned[mode].get(_call_kind(mode, shape, mods), ())
        for e in sorted(entries, key=distance):  # stable: precedence
            got = (e["seq_q_bucket"], e["seq_k_bucket"])
            if "bh_bucket" in e:  # decode: batch x Hkv is part of the bucket
                got, want = (*got, e["bh_bucket"]), (want_q, want_k, want_bh)
            else:
                want = (want_q, want_k)
            idle = head_units_leave_programs_idle(knobs(e["variant"]), shape,
                                                  self.sm_count) if whole_heads else None
            reason = self._too_short(e, shape) or idle or check(e)
            if reason:
                # The row's file: a bucket stale in both databases reads alike otherwise.
                where = source_file(e)
                where = f" of {where}" if where else ""
                skipped.append(f"bucket{label} Nq{got[0]}/Nk{got[1]}{where}: {reason}")
            else:
                return e, got, want
        return None

    @staticmethod
    def _too_short(e: Entry, shape: Shape) -> str | None:
        """The tile rule where an entry carries it precomputed (`need`): a block may not be
        longer than the next power of two (>= 16) of the length it tiles."""
        if "need" not in e:
            return None
        need_q, need_k = e["need"]
        if max(16, pow2(shape.seq_q)) >= need_q and max(16, pow2(shape.seq_k)) >= need_k:
            return None
        return f"its tiles need Nq and Nk buckets of at least {need_q} and {need_k}"

    def default(self, mode: str, shape: Shape) -> Entry | None:
        """The precomputed default entry for `shape` (None where the table has no defaults;
        a ValueError where it has some, but not for this kind of problem)."""
        grids = self.defaults.get(mode)
        if grids is None:
            return None
        letters = modifier_letters(shape)
        grid = grids.get((shape.dtype, shape.causal, shape.head_dim, letters))
        if grid is None:
            raise ValueError(self._no_default(mode, shape, letters, grids))
        if mode == "decode":
            return grid[decode_default_key(shape)]
        low, high = self.lengths[0], self.lengths[-1]
        clamp = lambda n: min(high, max(low, pow2(n)))
        keys = clamp(shape.seq_k)
        if mode == "fwd" and shape.seq_k > high:
            # Past the tiles' lengths the defaults choose by key counts (powers of two): the
            # grid's length at or below the call's keys.
            keys = min(self.fwd_key_lengths[-1], 1 << (shape.seq_k.bit_length() - 1))
        return grid[(clamp(shape.seq_q), keys)]

    def _no_default(self, mode: str, shape: Shape, letters: str,
                    grids: Mapping[tuple, Any]) -> str:
        """Why an exported package has no default for this call, and what export would
        ship one."""
        kind = f"{shape.dtype} causal={shape.causal} head dim {shape.head_dim}"
        why = self.no_defaults.get((mode, shape.dtype, shape.causal, shape.head_dim, letters))
        if why is not None:
            return (f"no {mode} kernel for {kind} in {self.name}: its export found no default "
                    f"variant for this kind ({why})")
        names = modifier_names(letters)
        with_mods = f"no {mode} kernel with {names.replace('+', ', ')} for {kind} in {self.name}"
        if letters and shape.dtype == "fp8":
            return (f"{with_mods}: exported packages render modifiers into no fp8 kernel (only "
                    "fp8 winners tuned with them ship them); run this call with flashgen")
        # The sets the package was exported with (older packages: guessed from the grids).
        exported = (letters in self.exported_sets if self.exported_sets is not None
                    else any(k[3] == letters for k in grids))
        if letters and (shape.dtype, shape.causal, shape.head_dim, "") in grids:
            if exported:
                return f"{with_mods}: the package has them for other calls only"
            return (f"{with_mods}: it was exported without them. Export again with "
                    f"--modifiers {names}.")
        kinds = sorted(f"{k[0]} causal={k[1]} D={k[2]}" + (f" {modifier_names(k[3])}"
                                                          if k[3] else "") for k in grids)
        have = ", ".join(kinds[:KINDS_NAMED]) + (
            f" and {len(kinds) - KINDS_NAMED} more" if len(kinds) > KINDS_NAMED else "")
        fix = f"--kinds {shape.dtype}:{shape.head_dim}" + (
            f" --modifiers {names}" if letters and not exported else "")
        return (f"no {mode} kernel for {kind}{f' {names}' if letters else ''} in {self.name}; "
                f"it holds: {have}. Export again from a database tuned for this kind of "
                f"problem, or with {fix} for its default kernels.")


#: Kinds of problem a "no kernel" error lists before it says how many more there are.
KINDS_NAMED = 6


def decode_default_key(shape: Any) -> tuple[int, int]:
    """Where a decode call finds its default in a precomputed grid ("decode_defaults":
    packed rows 16, 32, 64 x page size 0, 16, 32, 64): its packed query rows (GQA group x
    Nq) and page size, rounded into the grid. The defaults' tiles are at most 64 rows and 64
    keys, so larger calls share the largest cell."""
    rows = min(64, max(16, pow2(shape.group * shape.seq_q)))
    page = min(64, max(16, shape.page_size)) if shape.page_size else 0
    return rows, page
