"""What an export carries: the winners of each GPU, and the default variants for their kinds.

Both export formats (`flashgen.export.package` for Python, `flashgen.export.aot` for
cubins) start here, so they agree on which rows are served.
The rules follow `flashgen.runtime.dispatch`: only current rows (a row whose kernel
hash differs from its variant's rendered now timed a kernel this flashgen no longer renders),
earlier databases win a bucket, then the row of the running torch, then the newest.
One Triton version per GPU, since the exported runtime checks a single version.
A backward winner that is not deterministic carries its key's fastest deterministic trial,
which the package serves under `torch.use_deterministic_algorithms(True)`, as flashgen does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flashgen.kernels.bwd_space import (
    block_owned_longer_than_needed,
    block_streamed_longer_than_needed,
    default_bwd_variant,
)
from flashgen.kernels.bwd_variant import BwdVariant
from flashgen.kernels.decode_space import default_decode_variant
from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.fwd_space import (
    DEFAULTS,
    NoDefaultFits,
    block_m_longer_than_queries,
    block_n_longer_than_keys,
    default_variant,
)
from flashgen.kernels.hardware import CPU_INTERPRETER, INTERPRETER, DeviceInfo
from flashgen.kernels.problem import (
    DTYPES,
    MAX_HEAD_DIM,
    MODIFIER_LETTERS,
    MODIFIERS,
    DecodeProblem,
    Problem,
)
from flashgen.kernels.variant import Variant
from flashgen.runtime.table import modifier_letters, modifier_names
from flashgen.store.current import row_is_current
from flashgen.store.db import TuningDB, WinnerRow
from flashgen.store.keys import Versions

#: Length buckets of the default tables. Tiles are at most 256 long and the tile rules only
#: look at the next power of two (>= 16) of a length, so these five cover every length.
LENGTHS: tuple[int, ...] = (16, 32, 64, 128, 256)
#: Key lengths of the forward's default grids: LENGTHS, then every power of two up to the
#: most keys a default row starts at (`Pick.min_keys`, powers of two), where beyond the
#: tiles the defaults choose by key count. The runtime takes a longer call's keys down to
#: the grid's next length below (`Table.default`).
FWD_KEY_LENGTHS: tuple[int, ...] = LENGTHS + tuple(
    1 << n for n in range(LENGTHS[-1].bit_length(),
                          max(p.min_keys for p in DEFAULTS).bit_length()))

#: The device the generic defaults are chosen for, so they run on any GPU Triton supports:
#: no Hopper-only knobs, and Turing's 64 KiB of shared memory per block, the smallest opt-in.
GENERIC = DeviceInfo("generic", (7, 5), 1, 65536)
#: The generic defaults of fp8 kinds: the least GPU with fp8 tensor cores (Ada, sm89, 99 KB
#: of shared memory a block), since GENERIC's Turing has none.
GENERIC_FP8 = DeviceInfo("generic", (8, 9), 1, 101376)

#: Shared memory one block may opt into, by compute capability (CUDA programming guide,
#: "Technical Specifications per Compute Capability"). Tuning keys do not store it; the
#: defaults chosen for a tuned GPU need it. Unknown capabilities get GENERIC's.
SHARED_MEMORY: dict[tuple[int, int], int] = {
    (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376,
    (9, 0): 232448, (10, 0): 232448, (12, 0): 101376,
}

#: The validity rules that look at lengths, per mode; every other rule holds for a tuned row
#: at any length on the GPU it was tuned on.
LENGTH_RULES = {
    "fwd": (block_m_longer_than_queries, block_n_longer_than_keys),
    "bwd": (block_streamed_longer_than_needed, block_owned_longer_than_needed),
}

Family = tuple[str, bool, int]  # dtype, causal, head dim: what a kernel's source depends on
AnyVariant = Variant | BwdVariant | DecodeVariant


@dataclass(frozen=True)
class Sourced:
    """A winner and the database it came from; `alternate`: its key's fastest deterministic
    trial where the winner is not deterministic (`TuningDB.fastest_deterministic`)."""

    winner: WinnerRow
    path: Path
    alternate: WinnerRow | None = None

    def source(self, row: WinnerRow | None = None) -> str:
        """Where `row` (default: the winner; else its alternate) comes from."""
        row = row or self.winner
        return f"{self.path.name} winners[{self.winner.key.id}] trial {row.trial_id}"


@dataclass(frozen=True)
class GpuWinners:
    """Everything exported for one GPU model."""

    device: DeviceInfo
    device_key: str
    triton_version: str
    fwd: list[Sourced]
    bwd: list[Sourced]
    decode: list[Sourced] = field(default_factory=list)


@dataclass
class Selection:
    gpus: list[GpuWinners] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # rows left out, and why
    #: The modifier sets whose kernels every plain entry and default grid carries, as letters
    #: (`modifier_letters`): those asked for (`--modifiers`).
    modifier_sets: list[str] = field(default_factory=list)
    #: Kinds given default grids though no winner covers them (`--kinds`).
    extra_families: list[Family] = field(default_factory=list)

    def families(self) -> list[Family]:
        """Every (dtype, causal, head dim) with a winner on some GPU, and the extra kinds."""
        found = {(s.winner.key.dtype, s.winner.key.causal, s.winner.key.head_dim)
                 for g in self.gpus for s in (*g.fwd, *g.bwd)}
        return sorted(found | set(self.extra_families))

    def decode_families(self) -> list[Family]:
        """Every (dtype, causal, head dim) with a decode winner, or a forward one: `attention`
        runs the decode family for a few queries against many keys (fp8 has no decode
        kernels: its forward serves every length); and the extra kinds."""
        found = {(s.winner.key.dtype, s.winner.key.causal, s.winner.key.head_dim)
                 for g in self.gpus for s in (*g.fwd, *g.decode) if s.winner.key.dtype != "fp8"}
        return sorted(found | {f for f in self.extra_families if f[0] != "fp8"})


def device_of(gpu_name: str, capability: str, sm_count: int) -> DeviceInfo:
    """The DeviceInfo of a tuning key's GPU (shared memory from `SHARED_MEMORY`)."""
    if gpu_name == CPU_INTERPRETER:
        return INTERPRETER
    major, minor = (int(x) for x in capability.split("."))
    smem = SHARED_MEMORY.get((major, minor), GENERIC.shared_memory)
    return DeviceInfo(gpu_name, (major, minor), sm_count, smem)


def _read(paths: Sequence[Path], gpu: str | None,
          notes: list[str]) -> tuple[dict[str, list[Sourced]], set[str]]:
    """The current winners by GPU, and the modifier sets (letters) of the modified ones."""
    found: dict[str, list[Sourced]] = {}
    stale = 0
    modified: set[str] = set()
    for path in paths:
        if not path.is_file() and not path.is_dir():  # a folder: open_readonly names it
            continue
        with TuningDB.open_ours(path) as db:  # not "no winners" for another program's file
            for w in db.all_winners():
                if gpu is not None and w.key.gpu_name != gpu:
                    continue
                if not row_is_current(w):
                    stale += 1
                    continue
                if w.key.modifiers:
                    modified.add(modifier_letters(w.problem))
                found.setdefault(w.key.gpu_name, []).append(
                    Sourced(w, path, db.fastest_deterministic(w)))
    if stale:
        notes.append(f"{stale} winner(s) tuned on other template text left out (re-tune them)")
    return found, modified


def _one_gpu(name: str, rows: list[Sourced], notes: list[str]) -> GpuWinners:
    installed = Versions.current().triton
    versions = {s.winner.key.triton_version for s in rows}
    # Plain rows decide which Triton (and device key) a GPU exports where they can: one row
    # tuned with modifiers on a newer Triton must not push out every plain winner.
    def plain(rows: list[Sourced]) -> list[Sourced]:
        return [s for s in rows if not s.winner.key.modifiers] or rows

    newest = max(plain(rows), key=lambda s: s.winner.updated_at).winner.key.triton_version
    triton = installed if installed in versions else newest
    if len(versions) > 1:
        notes.append(f"{name}: rows of Triton {sorted(versions - {triton})} left out; "
                     f"exporting those of Triton {triton}")
    rows = [s for s in rows if s.winner.key.triton_version == triton]
    keys = {s.winner.key.device_key for s in rows}
    device_key = Counter(s.winner.key.device_key for s in plain(rows)).most_common(1)[0][0]
    if len(keys) > 1:
        notes.append(f"{name}: rows of {sorted(keys - {device_key})} left out; "
                     f"exporting those of {device_key}")
    rows = [s for s in rows if s.winner.key.device_key == device_key]

    torch_now = Versions.current().torch
    chosen: dict[tuple, Sourced] = {}
    for s in rows:  # in database precedence order
        k = s.winner.key
        bucket = (k.mode, k.dtype, k.causal, k.head_dim, k.gqa, k.seq_q_bucket, k.seq_k_bucket,
                  k.page_size, k.bh_bucket, k.modifiers)
        held = chosen.get(bucket)
        rank = lambda x: (x.winner.key.torch_version == torch_now, x.winner.updated_at)
        if held is None or (held.path == s.path and rank(s) > rank(held)):
            chosen[bucket] = s
    key = rows[0].winner.key
    ordered = sorted(chosen.values(), key=lambda s: s.winner.key.id)
    return GpuWinners(
        device=device_of(name, key.capability, key.sm_count),
        device_key=device_key,
        triton_version=triton,
        fwd=[s for s in ordered if s.winner.key.mode == "fwd"],
        bwd=[s for s in ordered if s.winner.key.mode == "bwd"],
        decode=[s for s in ordered if s.winner.key.mode == "decode"],
    )


def select_winners(paths: Sequence[Path], gpu: str | None = None,
                   modifiers: Sequence[str] = (), kinds: Sequence[Family] = ()) -> Selection:
    """The winners to export from `paths` (highest precedence first), for GPU model `gpu`
    (None: every GPU in the databases), with kernels for the modifier sets `modifiers`
    (letters, `parse_modifier_sets`) in every plain entry and default grid (winners tuned
    with modifiers ship as entries of their own either way), and default grids for `kinds`
    beside those of the winners' kinds."""
    selection = Selection(extra_families=list(kinds))
    found, modified = _read(paths, gpu, selection.notes)
    for name, rows in sorted(found.items()):
        selection.gpus.append(_one_gpu(name, rows, selection.notes))
    selection.modifier_sets = sorted(set(modifiers), key=lambda m: (len(m), m))
    if modified - set(modifiers):
        # Each such winner ships and serves its own bucket; other calls with its modifiers
        # need their kernels rendered into every entry and default grid.
        names = ", ".join(modifier_names(m) for m in sorted(modified - set(modifiers)))
        selection.notes.append(f"winners tuned with modifiers ({names}) ship as their own "
                               "entries; --modifiers ships kernels for all other calls with "
                               "them (but fp8 ones)")
    if modifiers and any(f[0] == "fp8" for f in selection.families()):
        selection.notes.append("--modifiers sets are not rendered into fp8 kernels: fp8 calls "
                               "with modifiers run only where fp8 winners were tuned with them")
    return selection


def parse_modifier_sets(text: str) -> list[str]:
    """`--modifiers`' sets as letters: comma-separated, each a modifier or several joined by
    "+" (window, softcap, sinks, varlen), e.g. "softcap,window+softcap" -> ["k", "wk"]."""
    sets: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        names = {n.strip() for n in item.split("+")}
        unknown = sorted(names - set(MODIFIERS))
        if unknown:
            raise ValueError(f"unknown modifier {unknown[0]!r} in --modifiers {text!r}; "
                             f"use {', '.join(MODIFIERS)}, several joined by '+'")
        letters = "".join(MODIFIER_LETTERS[n] for n in MODIFIERS if n in names)
        if letters not in sets:
            sets.append(letters)
    return sets


def parse_kinds(text: str) -> list[Family]:
    """`--kinds`: comma-separated DTYPE:HEAD_DIM items (e.g. "bf16:128,fp16:80"), each a
    kind causal and not."""
    kinds: list[Family] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        dtype, _, dim = item.partition(":")
        if dtype not in DTYPES or not dim.isdigit() or not 1 <= int(dim) <= MAX_HEAD_DIM:
            raise ValueError(f"--kinds item {item!r} is not DTYPE:HEAD_DIM with a dtype of "
                             f"{', '.join(DTYPES)} and a head dim of 1 to {MAX_HEAD_DIM}")
        kinds += [(dtype, causal, int(dim)) for causal in (False, True)]
    return sorted(set(kinds))


def with_modifiers(problem: Problem, letters: str) -> Problem:
    """`problem` asking for the modifiers of `letters` (see `modifier_letters`)."""
    return problem.with_(**{n: MODIFIER_LETTERS[n] in letters for n in MODIFIERS})


def tile_needs(mode: str, variant: AnyVariant, problem: Problem) -> tuple[int, int]:
    """The smallest power-of-two (>= 16) query and key lengths `variant`'s tiles are valid
    for, by flashgen's own length rules; the exported runtime compares lengths with these."""
    rules = LENGTH_RULES[mode]
    longest = LENGTHS[-1]

    def smallest(side: str) -> int:
        for n in LENGTHS:
            p = problem.with_(seq_q=n, seq_k=longest) if side == "q" else problem.with_(
                seq_q=longest, seq_k=n)
            if all(rule(variant, p, GENERIC) is None for rule in rules):  # type: ignore[arg-type]
                return n
        raise ValueError(f"{variant} fits no length up to {longest}")

    return smallest("q"), smallest("k")


#: The decode defaults' grid: packed query rows (GQA group x Nq, as the tile's rows) and the
#: page size a default is chosen for (0: contiguous); the runtime's `Table.default` rounds a
#: call to these (`decode_default_key`).
DECODE_ROWS = (16, 32, 64)
DECODE_PAGES = (0, 16, 32, 64)


def decode_default_grid(family: Family, device: DeviceInfo, letters: str = "",
                        ) -> list[tuple[int, int, DecodeVariant, DecodeProblem]]:
    """flashgen's default decode variant of `family` on `device` at every (rows, page) of
    the grid, with the modifiers of `letters`: what `default_decode_variant` picks,
    evaluated ahead of time."""
    dtype, causal, head_dim = family
    grid = []
    for rows in DECODE_ROWS:
        for page in DECODE_PAGES:
            problem = DecodeProblem(1, rows, 1, 1, 4096, head_dim, dtype, causal,
                                    page_size=page)
            problem = with_modifiers(problem, letters)  # type: ignore[assignment]
            grid.append((rows, page, default_decode_variant(problem, device), problem))
    return grid


class NoDefault(ValueError):
    """flashgen has no default variant for a kind of problem on a device (fp8 below sm89,
    or no tile of the defaults fits its shared memory): the kind gets no default grid."""


def default_grid(mode: str, family: Family, device: DeviceInfo, letters: str = "",
                 key_lengths: Sequence[int] = LENGTHS,
                 ) -> list[tuple[int, int, AnyVariant, Problem]]:
    """flashgen's default variant of `family` on `device` for every query length of
    `LENGTHS` and key length of `key_lengths`, with the modifiers of `letters`: the
    `default_variant` logic, evaluated ahead of time so the runtime only looks it up.
    NoDefault where that logic has none for the kind."""
    dtype, causal, head_dim = family
    choose = default_variant if mode == "fwd" else default_bwd_variant
    if dtype == "fp8" and device == GENERIC:
        device = GENERIC_FP8
    if dtype == "fp8" and not device.is_interpreter and device.capability < (8, 9):
        major, minor = device.capability
        raise NoDefault(f"{device.name} (compute capability {major}.{minor}) has no fp8 "
                        "tensor cores")
    grid: list[tuple[int, int, AnyVariant, Problem]] = []
    for nq in LENGTHS:
        for nk in key_lengths:
            problem = with_modifiers(Problem(1, 1, 1, nq, nk, head_dim, dtype, causal), letters)
            try:
                variant = choose(problem, device)
            except NoDefaultFits:
                raise NoDefault(f"none of flashgen's default {mode} variants is valid for "
                                f"it on {device.name} ({device.shared_memory // 1024} KiB of "
                                "shared memory a block)") from None
            grid.append((nq, nk, variant, problem))
    return grid
