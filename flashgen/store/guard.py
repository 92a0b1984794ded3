"""What flashgen checks before it writes a database file, and how store errors read.

Why this exists: opening a file for writing used to switch it to WAL and add flashgen's
tables before anything could fail, so a user's SQLite file of another program (or one a
newer flashgen wrote) was changed even when the run then stopped with a traceback. Here:

* `check_writable` reads the file through a read-only connection and refuses, before the
  file is touched, a non-empty database that is not flashgen's or that a newer flashgen
  wrote. flashgen's own files carry `APPLICATION_ID` in their header (`mark`); files made
  before that are recognised by their flashgen migrations and get the mark on their next
  write.
* `open_without_shm` reads a WAL-mode file where SQLite cannot create the shared-memory file
  (a read-only folder), without silently leaving out what is still in the `-wal` file.
* `explain` turns the errors a bad file, a full disk, a lock or a read-only place raise into
  one line that names the file and says what to do, for the CLI.

This module imports nothing of flashgen, so the CLI can import it without torch.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import sqlite3
import tempfile
import warnings
from collections.abc import Collection
from pathlib import Path

#: `PRAGMA application_id` of every database flashgen writes ("FGDB" in ASCII), so that
#: flashgen knows its own files from other programs' (sqlite3 and `file` show it too).
APPLICATION_ID = 0x46474442
#: The sqlite-utils migration set of flashgen's schema (`_sqlite_migrations.migration_set`).
MIGRATION_SET = "flashgen"
#: Environment variable: seconds a writer waits for another program's write lock.
BUSY_TIMEOUT_ENV = "FLASHGEN_BUSY_TIMEOUT"


class StoreError(sqlite3.DatabaseError):
    """flashgen will not use a database file as asked; the message names the file and says
    what to do. A `sqlite3.DatabaseError`, so callers that already handle a bad database
    (dispatch falling back to the defaults) handle this too."""


class ForeignDatabase(StoreError):
    """The file is a SQLite database of another program."""


class NewerDatabase(StoreError):
    """The file was written by a newer flashgen: its schema has migrations this one lacks."""


def busy_timeout_s(default: float) -> float:
    """Seconds to wait for a write lock: $FLASHGEN_BUSY_TIMEOUT, else `default`.

    Why configurable: a lock held by another program is only reported after the wait, and a
    test of that report should not have to wait the full minute."""
    value = os.environ.get(BUSY_TIMEOUT_ENV, "")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds >= 0 and math.isfinite(seconds):
        return seconds
    if value.strip() and value not in _WARNED:  # set but unusable: say so, once per value
        _WARNED.add(value)
        warnings.warn(f"{BUSY_TIMEOUT_ENV}={value!r} is not a number of seconds >= 0; "
                      f"waiting {default:g} s for a write lock", RuntimeWarning, stacklevel=2)
    return default


#: The unusable $FLASHGEN_BUSY_TIMEOUT values already warned of.
_WARNED: set[str] = set()


def _read_only(path: Path, timeout: float) -> sqlite3.Connection:
    """A connection that cannot change the file, whatever is done through it."""
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=timeout)


def read_only_connection(path: Path, timeout: float) -> sqlite3.Connection:
    """A read-only connection to an existing file that changes nothing in it; a WAL-mode
    file in a folder where SQLite cannot create its shared-memory file, and a file with the
    journal of a write killed midway, are read through `open_without_shm`. A file a writer
    holds locked raises: reading around its lock could see half a write."""
    conn = _read_only(path, timeout)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as exc:
        conn.close()
        if "locked" in str(exc):
            raise
        conn = open_without_shm(path)
    return conn


def file_identity(path: Path) -> tuple[int, int, list[str], list[str]]:
    """`_identity` of the SQLite file at `path`, read without changing it (sqlite3's
    DatabaseError where it is not an SQLite file)."""
    conn = read_only_connection(path, 5.0)
    try:
        return _identity(conn)
    finally:
        conn.close()


def _identity(conn: sqlite3.Connection) -> tuple[int, int, list[str], list[str]]:
    """The file's application id, user version, tables and flashgen migrations applied."""
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    user_version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = sorted(name for (name,) in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"))
    applied: list[str] = []
    if "_sqlite_migrations" in tables:
        applied = [name for (name,) in conn.execute(
            "SELECT name FROM _sqlite_migrations WHERE migration_set = ?", (MIGRATION_SET,))]
    return app_id, user_version, tables, applied


#: What a refused writer (`flashgen tune`) and a refused reader (`show`, `export`) can do.
_WRITER_ADVICE = "pass --db with a new file for flashgen's results"
_READER_ADVICE = "pass --db with a flashgen tuning database (`flashgen tune` writes one)"


def _refuse_foreign(path: Path, app_id: int, user_version: int, tables: list[str],
                    applied: list[str], advice: str = _WRITER_ADVICE) -> None:
    ours = app_id == APPLICATION_ID or (app_id == 0 and bool(applied))
    blank = not tables and app_id == 0 and user_version == 0
    if not ours and not blank:
        held = ", ".join(tables[:4]) + (", ..." if len(tables) > 4 else "")
        what = f"it holds tables {held}" if tables else f"application id {app_id:#x}"
        raise ForeignDatabase(
            f"{path} is another program's SQLite database ({what}); flashgen did not change "
            f"it: {advice}")


def check_ours(conn: sqlite3.Connection, path: Path) -> None:
    """Raise `ForeignDatabase` if `path`, open as `conn`, is another program's SQLite file: a
    reader (`flashgen show`, `flashgen export`) would otherwise find none of its rows, as if
    flashgen had tuned nothing."""
    _refuse_foreign(path, *_identity(conn), advice=_READER_ADVICE)


def check_writable(path: Path, known_migrations: Collection[str], schema_version: int,
                   timeout: float) -> None:
    """Raise `ForeignDatabase` or `NewerDatabase` if flashgen must not write `path`.

    A missing or empty file, an empty database, and flashgen's own files of this schema or an
    older one pass. Only reads happen, through a read-only connection, so the file's bytes
    stay as they were whatever the answer. A file that is no SQLite database at all raises
    SQLite's own error here, also before anything is written."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    # As every reader reads it (a write killed midway is read as committed): a writer let
    # in then rolls that write back in the file itself.
    conn = read_only_connection(path, timeout)
    try:
        app_id, user_version, tables, applied = _identity(conn)
    finally:
        conn.close()
    _refuse_foreign(path, app_id, user_version, tables, applied)
    unknown = [name for name in applied if name not in known_migrations]
    if unknown or user_version > schema_version:
        found = f"migration {unknown[0]}" if unknown else f"schema version {user_version}"
        raise NewerDatabase(
            f"{path} was written by a newer flashgen ({found} is unknown to this one); it is "
            f"read but not written: upgrade flashgen, or pass --db with another file to tune")


def mark(conn: sqlite3.Connection) -> None:
    """Stamp flashgen's application id into the file's header (inside the caller's write
    transaction), so `check_writable` knows the file as flashgen's from now on."""
    if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")


class _SnapshotConnection(sqlite3.Connection):
    """A read-only connection to a copy of a database; closing it removes the copy."""

    scratch: tempfile.TemporaryDirectory[str] | None = None

    def close(self) -> None:
        super().close()
        if self.scratch is not None:
            self.scratch.cleanup()
            self.scratch = None


def open_without_shm(path: Path) -> sqlite3.Connection:
    """Read a database that SQLite cannot open read-only in place, which happens to a
    WAL-mode file in a folder where its `-shm` file cannot be created, and to a file with a
    hot rollback journal (read from a copy where the interrupted write is rolled back).

    Without a `-wal` file beside it, the file is all there is, and opening it as immutable
    reads it as it stands. With one, immutable would ignore the log and show the results a
    killed run left there as missing, so the pair is copied to a temporary folder and read
    there; if the log cannot be copied, `StoreError` says so rather than show less."""
    uri = path.resolve().as_uri()
    wal = path.with_name(path.name + "-wal")
    journal = path.with_name(path.name + "-journal")
    if journal.exists() and journal.stat().st_size > 0:
        # A hot rollback journal: a writer was killed mid-write, and the file holds pages of
        # a write never committed, which a read-only connection may not roll back (SQLite
        # refuses) and immutable would read as they stand. The pair is copied, and a
        # read-write connection to the copy rolls the write back there, so this reads what
        # was committed; the next writer of the file itself rolls it back in place.
        return _snapshot(path, journal, "an interrupted write's journal", "")
    if not wal.exists() or wal.stat().st_size == 0:
        return sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True)
    return _snapshot(path, wal, "recent results", "?mode=ro")


def _snapshot(path: Path, beside: Path, what: str, mode: str) -> sqlite3.Connection:
    """A connection to a copy of `path` and its `beside` file (its WAL or its rollback
    journal) in a temporary folder, opened with URI `mode`; `StoreError` if the pair cannot
    be copied."""
    scratch = tempfile.TemporaryDirectory(prefix="flashgen-db-")
    copy = Path(scratch.name) / path.name
    try:
        shutil.copyfile(path, copy)
        shutil.copyfile(beside, copy.with_name(copy.name + beside.name[len(path.name):]))
    except OSError as exc:
        scratch.cleanup()
        raise StoreError(
            f"{path} keeps {what} in {beside}, which cannot be read here "
            f"({exc.strerror or exc}); copy both files to a folder you can write and pass "
            f"that copy with --db") from exc
    conn = sqlite3.connect(f"{copy.as_uri()}{mode}", uri=True, factory=_SnapshotConnection)
    conn.scratch = scratch
    return conn


#: What a SQLite error message means for the user, and what to do about it.
_SQLITE_ADVICE: tuple[tuple[str, str], ...] = (
    ("file is not a database",
     "{path} is not a SQLite database (damaged, or another kind of file); move it away, or "
     "pass --db with another file"),
    ("malformed",
     "{path} is damaged (database disk image is malformed); restore it from a backup, or "
     "move it away so that a new one is made"),
    ("database or disk is full",
     "no space left to write {path} (database or disk is full); free some space and run "
     "again: what was stored before is kept"),
    ("database is locked",
     "{path} is locked: another program has held its write lock for over {wait:g} s; close "
     "it (or wait for it) and run again; ${env} sets the wait"),
    ("readonly database",
     "{path} is read-only here; make it and its folder writable, or pass --db with a "
     "writable file"),
    ("unable to open database file",
     "cannot open {path}: its folder is missing or not writable; pass --db with a file in "
     "a folder you can write"),
    ("no such column",
     "{path} does not hold flashgen's tables (another program's database?); pass --db with "
     "a flashgen database"),
    ("disk I/O error",
     "input/output error on {path} (disk full, removed, or failing); check the disk and run "
     "again"),
)

#: What an OSError's errno means when flashgen writes a file or makes a folder.
_OS_ADVICE: dict[int, str] = {
    errno.EACCES: "permission denied for {path}; choose a place you can write (--db, --out) "
                  "or fix its permissions",
    errno.EPERM: "operation not permitted on {path}; choose a place you can write (--db, "
                 "--out) or fix its permissions",
    errno.EROFS: "cannot write {path}: the file system is read-only; choose a place you can "
                 "write (--db, --out)",
    errno.ENOSPC: "no space left on the device writing {path}; free some space and run again",
    errno.EDQUOT: "disk quota exceeded writing {path}; free some space and run again",
    errno.EISDIR: "{path} is a folder; name a database file (--db, $FLASHGEN_DB)",
    errno.ENOTDIR: "cannot use {path}: a part of its folder path is a file, not a folder; "
                   "choose another place (--db, --out)",
    # mkdir(exist_ok=True) where a file has the folder's name.
    errno.EEXIST: "cannot make the folder {path}: a file of that name is in the way; choose "
                  "another place (--db, --out)",
}


def explain(exc: BaseException, path: Path | str | None, wait_s: float) -> str | None:
    """One line for a known database or file error, naming the file and what to do; None
    for anything else (a bug should keep its traceback). `path` is the database the
    command uses (an OSError names its own file); `wait_s` is the lock wait that ran out."""
    where = str(path) if path else "the tuning database"
    if isinstance(exc, StoreError) or getattr(exc, "one_line", False):
        return str(exc)  # its own message names the place and what to do
    if isinstance(exc, sqlite3.Error):
        text = str(exc)
        if "unable to open database file" in text and path and Path(path).is_file() and (
                not os.access(path, os.R_OK)):  # the folder is fine: the file is not readable
            return (f"cannot open {where}: the file cannot be read here (its permissions); "
                    "make it readable, or pass --db with another file")
        for needle, advice in _SQLITE_ADVICE:
            if needle in text:
                return advice.format(path=where, wait=wait_s, env=BUSY_TIMEOUT_ENV)
        return None
    if isinstance(exc, OSError) and exc.errno in _OS_ADVICE:
        return _OS_ADVICE[exc.errno].format(path=exc.filename or where)
    return None
