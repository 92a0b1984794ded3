"""Winner rows -> the runtime's table: the plain dicts `flashgen.runtime.table` looks up.

The runtime never reads a database; flashgen's dispatcher (`flashgen.serve`) asks this layer
for a device's table once, and `flashgen export` writes the same kind of entries to
table.json. Databases are read highest precedence first (the user's, then the shipped one)
and every row is kept in that order: where the first row of a bucket cannot serve a call, the
next one of the same bucket may. A backward winner that is not deterministic (atomic dQ) is
followed by its key's fastest deterministic trial (`TuningDB.fastest_deterministic`), which
dispatch serves under `torch.use_deterministic_algorithms(True)`.
"""

from __future__ import annotations

import sqlite3
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashgen.kernels.bwd_render import PREPROCESS_BLOCK_M
from flashgen.kernels.bwd_space import bwd_pointer_twin
from flashgen.kernels.decode_variant import DecodeVariant
from flashgen.kernels.hardware import DeviceInfo
from flashgen.kernels.modes import AnyVariant, space_of
from flashgen.kernels.problem import Problem
from flashgen.kernels.resources import data_dir
from flashgen.kernels.variant import Variant
from flashgen.store.current import hash_is_current
from flashgen.store.db import (
    SCHEMA_VERSION,
    TuningDB,
    WinnerRow,
    _migration_names,
    default_db_path,
)
from flashgen.store.guard import NewerDatabase, StoreError, busy_timeout_s, check_writable
from flashgen.store.keys import MODES, seq_bucket

SHIPPED_DB_NAME = "flashgen.db"
#: The `role` of an entry that follows a nondeterministic winner in its bucket.
DETERMINISTIC_ROLE = "fastest deterministic trial"


def shipped_db_path() -> Path:
    """The database shipped in the package's `tuning_db/`."""
    return Path(str(data_dir("tuning_db") / SHIPPED_DB_NAME))


def default_paths() -> list[Path]:
    """The databases dispatch reads by default, highest precedence first."""
    return [default_db_path(), shipped_db_path()]


def twin(variant: AnyVariant, problem: Problem, device: DeviceInfo | None) -> AnyVariant | None:
    """What runs where TMA cannot address the inputs (16-byte aligned rows), computing the
    same: a use_tma or fa3 forward's pointer twin, an fa3 backward's Triton twin. None for
    variants that need no TMA."""
    if isinstance(variant, Variant):
        return variant.pointer_twin() if variant.needs_tma else None
    if isinstance(variant, DecodeVariant):
        return None  # pointer loads only
    return bwd_pointer_twin(variant, problem, device) if variant.fa3 != "none" else None


def entry(variant: AnyVariant, problem: Problem, device: DeviceInfo | None) -> dict[str, Any]:
    """The table entry that runs `variant` on problems of `problem`'s kind: its knobs, and its
    twin's where it has one (the twin's own tiles and warps: an fa3 forward's twin is a plain
    fa2 grid of at most 128 rows, an fa3 backward's may take 8 warps)."""
    found = {"variant": variant.to_dict()}
    other = twin(variant, problem, device)
    if other is not None:
        found["twin"] = other.to_dict()
    return found


def tuned_buckets(problem: Problem) -> tuple[int, int]:
    """The (Nq, Nk) buckets a row tuned on `problem` serves: those of its tuned lengths, as
    its key's are once migrated (a file read before m014, read only, still keys them by
    powers of two)."""
    return seq_bucket(problem.seq_q), seq_bucket(problem.seq_k)


def winner_entry(winner: WinnerRow, source: str, device: DeviceInfo,
                 role: str | None = None, of: WinnerRow | None = None) -> dict[str, Any]:
    """A winner row as a tuned entry: its bucket, the entry of its variant, its row, and
    what `entry_is_current` reads (the problem it was tuned on, its kernel's hash); `role`
    where it is not the bucket's winner (see the runtime table's entries), and `of` the
    winner whose bucket it takes. The length buckets are `tuned_buckets`."""
    k = winner.key
    nq, nk = tuned_buckets((of or winner).problem)
    return {**({"role": role} if role else {}),
        "dtype": k.dtype, "causal": k.causal, "head_dim": k.head_dim, "gqa": k.gqa,
        "seq_q_bucket": nq, "seq_k_bucket": nk,
        **({"page_size": k.page_size, "bh_bucket": k.bh_bucket} if k.mode == "decode" else {}),
        **({"modifiers": k.modifiers} if k.modifiers else {}),
        **entry(winner.variant, winner.problem, device),
        "tflops": winner.tflops, "source": source,
        "problem": winner.problem.to_dict(), "kernel_hash": winner.kernel_hash,
    }


def entry_is_current(mode: str, found: Mapping[str, Any]) -> bool:
    """Whether tuned entry `found` still names the kernel its row was tuned with (its
    variant rendered now hashes as it did; `current.hash_is_current`, cached per process)."""
    variant = space_of(mode).variant_type.from_dict(found["variant"])
    return hash_is_current(mode, variant, Problem.from_dict(found["problem"]),
                           found.get("kernel_hash"))


class DatabaseWarning(UserWarning):
    """A tuning database could not be read; dispatch goes on without its winners."""


#: The files dispatch has warned about in this process (each is named once, not per device).
_warned: set[str] = set()

#: Seconds dispatch waits out another process's write lock on a database before going on
#: without it: a tuner's writes hold it for milliseconds, so a lock held longer is a long
#: transaction elsewhere, which the first `attention` call must not wait a minute for (the
#: writers' wait, `BUSY_TIMEOUT_S`).
DISPATCH_BUSY_TIMEOUT_S = 5.0


def _winners(path: Path, device: DeviceInfo) -> list[tuple[WinnerRow, WinnerRow | None]]:
    """Every mode's winners for `device` in `path`, each with its key's fastest deterministic
    trial where the winner is not deterministic. Another program's file is refused before
    its tables are read (a table named `winners` there is not ours); a newer flashgen's file
    is read as far as it is compatible, and where it is not, the error says why."""
    try:
        check_writable(path, _migration_names(), SCHEMA_VERSION,
                       busy_timeout_s(DISPATCH_BUSY_TIMEOUT_S))
        newer = False
    except NewerDatabase:
        newer = True
    try:
        with TuningDB.open_readonly(path, DISPATCH_BUSY_TIMEOUT_S) as db:
            return [(row, db.fastest_deterministic(row)) for mode in MODES
                    for row in db.load_winners(device.key, mode=mode)]
    except sqlite3.DatabaseError as exc:
        if newer:
            raise StoreError(f"it was written by a newer flashgen and this one cannot read it "
                             f"({exc}); upgrade flashgen") from exc
        raise


def _warn_unreadable(path: Path, exc: BaseException) -> None:
    """Name a database dispatch cannot read and why, once per file per process: a call to
    `attention` must not fail over a damaged or foreign file, nor repeat the news each call."""
    where = str(path)
    if where in _warned:
        return
    _warned.add(where)
    problem = str(exc) or type(exc).__name__
    if isinstance(exc, sqlite3.OperationalError) and "locked" in problem:
        # A lock is not the file's fault: the advice to move it would be wrong.
        warnings.warn(f"flashgen: the tuning database {where} is locked by another process "
                      f"(a long write: an open sqlite3 shell, a copy?) and was not read. Going "
                      f"on without it in this process (the other databases' winners, if any, "
                      f"and the defaults); winners are read once per process, so "
                      f"flashgen.reload() (or a new process) reads it again.", DatabaseWarning,
                      stacklevel=2)
        return
    warnings.warn(f"flashgen: cannot read the tuning database {where}: {problem}. Going on "
                  f"without it (the other databases' winners, if any, and the defaults); move "
                  f"or delete that file, or point FLASHGEN_DB elsewhere.", DatabaseWarning,
                  stacklevel=2)


def device_table(paths: Sequence[Path], device: DeviceInfo) -> dict[str, Any]:
    """The runtime's table of `device` from the winners of `paths` (each opened once,
    read-only; missing files are skipped, and unreadable ones are named in one
    `DatabaseWarning` and skipped, so that attention still runs on the others' winners and
    the defaults)."""
    table: dict[str, Any] = {mode: [] for mode in MODES}
    table["preprocess_block_m"] = PREPROCESS_BLOCK_M
    unread: list[str] = []  # `explain` names them where nothing tuned serves a call
    for path in paths:
        try:
            if not path.is_file() and not path.is_dir():  # a folder: warned of, as unreadable
                if path.is_symlink() or path.exists():  # /dev/null, a pipe, a link to nothing
                    raise OSError(
                        "it is not a regular file (a device, a pipe, or a link to nothing)")
                continue
            rows = _winners(path, device)
        except (sqlite3.DatabaseError, OSError) as exc:
            _warn_unreadable(path, exc)
            unread.append(f"{path} ({str(exc) or type(exc).__name__})")
            continue
        for row, alternate in rows:
            source = f"{path} winners[{row.key.id}] trial {row.trial_id}"
            table[row.key.mode].append(winner_entry(row, source, device))
            if alternate is not None:
                source = (f"{path} winners[{row.key.id}] trial {alternate.trial_id} "
                          f"({DETERMINISTIC_ROLE})")
                table[row.key.mode].append(
                    winner_entry(alternate, source, device, DETERMINISTIC_ROLE, row))
    if unread:
        table["unread"] = unread
    return table
