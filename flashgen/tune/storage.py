"""Studies in a shared Optuna storage, so tuners on many GPUs and hosts search together.

One study per (flashgen version, tuning key, exact problem): the key holds the mode, the GPU
model and the Triton and torch versions, so nothing of another GPU kind or version is ever
mixed in, and every worker's TPE sees every trial of its problem. Beside each study is a
claims study, the storage's equivalent of `store.claims`: a worker creates a claim trial
carrying the variant (creation is one atomic write, and trial ids grow in write order), and
of the live claims of one variant the lowest id holds it. A claim stays RUNNING while its
variant is measured, then COMPLETE with the outcome (so later workers take it instead of
measuring) or FAIL when given back. The same ordering shares a run's trial budget: of the
live or complete claims of one campaign (a `flashgen tune` invocation, or every invocation
naming it with `--campaign`), only the first `budget` count.

A worker that dies stops beating: Optuna's heartbeat (`heartbeat_interval`, `grace_period`,
`fail_stale_trials`) turns its RUNNING trials and claims into FAIL, and the stale trial is
enqueued again (`RetryFailedTrialCallback`), so it is measured by another worker. RDB
storages beat natively; the journal file gets the same contract from `_HeartbeatJournal`.
Claims and leases also name their process (`OWNER_ATTR`): one of this host whose process is
gone fails at once, without waiting out the grace period.

What flashgen's trials table needs rides on each measured or pruned trial as the user
attribute `ROW_ATTR`, and the study's key and problem as study user attributes, so that
`tune.pull` can rebuild every host's rows in one SQLite file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sqlite3
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy.engine
import sqlalchemy.exc
from optuna.exceptions import DuplicatedStudyError, UpdateFinishedTrialError
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages._heartbeat import BaseHeartbeat  # the contract RDBStorage implements
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from optuna.storages.journal._file import LOCK_FILE_SUFFIX
from optuna.trial import FrozenTrial, TrialState

from flashgen.kernels.problem import Problem
from flashgen.store.db import gone_here, now_stamp
from flashgen.store.keys import TuningKey

#: Seconds between heartbeats of a running trial or claim.
HEARTBEAT_S = 5
#: Seconds without a heartbeat after which a running trial counts as its worker's death.
GRACE_S = 30
#: Times a dead worker's trial is enqueued again.
MAX_RETRY = 3
#: The trial user attribute holding a flashgen trial row (see `row_of`).
ROW_ATTR = "flashgen_row"
#: The study user attribute saying what a study is (see `StudyInfo`).
INFO_ATTR = "flashgen"
#: The study user attribute holding the latest SDPA baseline a worker timed.
BASELINE_ATTR = "flashgen_baseline"
#: Suffix of a claims study's name.
CLAIMS_SUFFIX = " claims"
#: The claims-study trial attribute naming the campaign a problem lease belongs to.
LEASE_ATTR = "lease"
#: The user attribute of a claim or lease naming its process: "<host> <pid>".
OWNER_ATTR = "owner"
#: The system attribute of a journal trial holding its latest heartbeat (seconds since epoch).
_BEAT_ATTR = "flashgen_heartbeat"

_RDB_DIALECTS = ("postgresql", "mysql", "sqlite")
#: Tries at opening an RDB storage whose tables another worker is creating right then.
_CREATE_TRIES = 5


class StorageError(ValueError):
    """A storage URL that is malformed, or names a storage that cannot be reached."""


def redact(url: str) -> str:
    """`url` without its password, for messages."""
    if "://" in url and "@" in url.split("://", 1)[1]:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        if ":" in creds:
            return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return url


def storage_file(url: str) -> Path | None:
    """The local file `url` names (a journal path, or an sqlite:/// URL's database), or
    None for a server."""
    if url.endswith(".log") and "://" not in url:
        return Path(url)
    if url.split("://", 1)[0].split("+", 1)[0] == "sqlite":
        try:
            return _sqlite_file(sqlalchemy.engine.make_url(url).database)
        except sqlalchemy.exc.ArgumentError:
            return None
    return None


def _sqlite_file(name: str | None) -> Path | None:
    """The file an SQLite URL's database `name` is; None for memory and `file:` URIs."""
    if not name or name == ":memory:" or name.startswith("file:"):
        return None
    return Path(name).expanduser()


def open_storage(url: str, *, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S,
                 must_exist: bool = False) -> BaseStorage:
    """The storage `url` names, reached and ready, or a one-line `StorageError`.

    A path ending in `.log` is a journal file (Optuna's `JournalFileBackend`, with the
    open-lock that works on NFS); anything else must be an SQLAlchemy URL of PostgreSQL
    (`postgresql+psycopg://user:pw@host/db`), MySQL or SQLite. Connecting happens here, so
    a bad URL fails before any GPU work. An SQLite file that is a flashgen tuning database
    or another program's is refused unchanged; `must_exist` (a reader: `flashgen pull`)
    refuses a file path that does not exist, which opening would create."""
    if not url:
        raise StorageError("--storage is empty")
    if url.endswith(".log") and "://" not in url:
        path = Path(url).expanduser()
        if not path.parent.is_dir():
            raise StorageError(f"--storage {url}: folder {path.parent} does not exist")
        if must_exist and not path.is_file():
            raise StorageError(f"--storage {url}: journal file does not exist (`flashgen tune "
                               "--storage` writes it)")
        if not must_exist:  # a writer: `flashgen tune`
            _check_journal_writable(url, path)
        try:
            _check_journal_start(path)
            backend = JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path)))
            journal = _HeartbeatJournal(backend, heartbeat_s, grace_s)
            journal.get_all_studies()  # reads the log now: a broken one fails here
            return journal
        except OSError as exc:
            raise StorageError(f"--storage {url}: {exc.strerror or exc}") from None
        except (ValueError, KeyError, TypeError) as exc:  # a line that is not a journal op
            first = (str(exc).splitlines() or [""])[0][:80]
            raise StorageError(f"--storage {url} is not an Optuna journal file "
                               f"({type(exc).__name__}: {first}); give the .log that "
                               "`flashgen tune --storage` wrote, or a new file") from None
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme.split("+", 1)[0] not in _RDB_DIALECTS:
        raise StorageError(
            f"--storage {redact(url)!r} is neither a journal file path ending in .log nor a "
            f"postgresql://, mysql:// or sqlite:// URL")
    netloc = url.split("://", 1)[1].split("/", 1)[0] if "://" in url else ""
    if netloc.count("@") > 1:  # the driver splits at the first: the rest reads as the host
        raise StorageError(f"--storage {redact(url)}: the user or password holds '@'; write "
                           "it as %40 (percent-encoded)")
    if scheme.split("+", 1)[0] == "sqlite":
        _check_sqlite_file(url, must_exist)
    engine: dict[str, Any] = {}
    if scheme.startswith("postgresql"):
        engine = {"connect_args": {"connect_timeout": 10}}
    try:
        for attempt in range(_CREATE_TRIES):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    return RDBStorage(url, engine_kwargs=engine,
                                      heartbeat_interval=heartbeat_s, grace_period=grace_s,
                                      heartbeat_stale_trial_callback=_retry_stale)
            except sqlalchemy.exc.IntegrityError:
                # Workers opening an empty database at once race to create Optuna's tables;
                # the loser's CREATE fails on what the winner made, and a retry finds them.
                if attempt == _CREATE_TRIES - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")
    except ImportError as exc:  # a missing driver; Optuna re-raises it as a plain one
        missing = getattr(exc, "name", None) or getattr(exc.__cause__, "name", None)
        what = f"driver {missing!r}" if missing else f"its driver ({str(exc).splitlines()[0]})"
        if not scheme.startswith("postgresql"):
            hint = "install the SQLAlchemy driver its URL names"
        elif missing == "psycopg2":  # the extra brings psycopg 3, taken when named (or new)
            hint = "write postgresql+psycopg:// and pip install 'flashgen[distributed]'"
        else:
            hint = "pip install 'flashgen[distributed]'"
        raise StorageError(f"--storage {redact(url)}: {what} is not installed "
                           f"({hint})") from None
    except Exception as exc:  # SQLAlchemy's errors: unreachable host, bad login, bad URL
        first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""])[0]
        raise StorageError(f"--storage {redact(url)}: cannot connect: "
                           f"{type(exc).__name__}: {first}") from None


def _check_journal_writable(url: str, path: Path) -> None:
    """A `StorageError` where a tuner could not append to the journal at `path` (the file,
    or its folder, where the open-lock file goes), found now rather than as a worker's
    traceback."""
    if not os.access(path.parent, os.W_OK):
        raise StorageError(f"--storage {url}: folder {path.parent} is not writable (the "
                           "journal and its lock file go there)")
    if path.is_file() and not os.access(path, os.W_OK):
        raise StorageError(f"--storage {url}: the journal file is not writable")


def check_journal_tail(url: str) -> None:
    """A `StorageError` where the journal `url` ends in a partial line (a write cut short
    by a full disk or a crash): Optuna reads past it, but a tuner's next append would glue
    onto it and make the journal unreadable to every host until mended by hand. A line
    another tuner is appending right now looks partial too, so the tail is read again
    under the journal's lock, which every writer holds while it appends."""
    path = storage_file(url)
    if path is None or not url.endswith(".log") or not path.is_file():
        return
    size = path.stat().st_size
    if _last_line_end(path, size) == size:
        return
    lock = JournalFileOpenLock(str(path))
    lock.acquire()
    try:
        size = path.stat().st_size
        whole = _last_line_end(path, size)
    finally:
        lock.release()
    if whole != size:
        raise StorageError(
            f"--storage {url} ends in a partial line ({size - whole} bytes after the last "
            f"whole one: a write cut short), which the next write would make unreadable; "
            f"remove it (truncate -s {whole} {path}) and run again")


#: The study of a named campaign (`--campaign`) that records its trial budget.
CAMPAIGN_STUDY = "flashgen campaign {}"
#: Its attribute: the --trials of the campaign's first invocation (None: --timeout alone).
TRIALS_ATTR = "trials"


def campaign_trials(storage: BaseStorage, campaign: str, trials: int | None,
                    wait_s: float = 5.0) -> int | None:
    """The --trials of `campaign`: `trials` where this invocation is its first (recorded
    now), else what its first recorded. An invocation that finds the record's study made but
    not yet written waits `wait_s` for it (two starting at once), then takes its own."""
    name = CAMPAIGN_STUDY.format(campaign)
    try:
        study = optuna.create_study(storage=storage, study_name=name)
    except DuplicatedStudyError:
        deadline = time.monotonic() + wait_s
        while True:
            attrs = optuna.load_study(study_name=name, storage=storage).user_attrs
            if TRIALS_ATTR in attrs:
                return attrs[TRIALS_ATTR]
            if time.monotonic() > deadline:
                return trials  # its first invocation died between its two writes
            time.sleep(0.1)
    study.set_user_attr(TRIALS_ATTR, trials)
    return trials


#: Seconds after which Optuna forcibly releases a journal's open-lock file that nobody
#: touches (`JournalFileOpenLock`'s grace period); a write holds it for milliseconds.
JOURNAL_LOCK_GRACE_S = 30


def clear_stale_journal_lock(url: str) -> float | None:
    """Remove the open-lock file beside the journal `url` where it is older than
    `JOURNAL_LOCK_GRACE_S` (left by a tuner killed while writing), returning its age in
    seconds; None where there is none to remove. Optuna would wait out the grace period on
    every first write, with a warning every 10 s, before removing it itself."""
    path = storage_file(url)
    if path is None or not url.endswith(".log"):
        return None
    lock = Path(f"{path}{LOCK_FILE_SUFFIX}")
    try:
        age = time.time() - lock.stat().st_mtime
        if age <= JOURNAL_LOCK_GRACE_S:
            return None
        lock.unlink()
    except FileNotFoundError:  # released meanwhile
        return None
    return age


def _last_line_end(path: Path, size: int, chunk: int = 1 << 16) -> int:
    """The offset just past the last newline of the file at `path` (0 where it has none),
    read backwards a chunk at a time."""
    with path.open("rb") as f:
        end = size
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                return start + at + 1
            end = start
    return 0


def _check_journal_start(path: Path) -> None:
    """A ValueError where `path` holds something other than an Optuna journal: Optuna reads
    a file whose only line is not a journal operation as empty (a torn last write), and the
    tuner's writes after it would then fail every read."""
    if not path.is_file():
        return
    with path.open("rb") as f:
        first = f.readline(1 << 20)
    if first.strip():
        op = json.loads(first)
        if not isinstance(op, dict) or "op_code" not in op:
            raise ValueError(f"line 1 is not a journal operation: {first[:40]!r}")


#: Tables every Optuna RDB storage has: an SQLite file holding others is not one.
_OPTUNA_TABLES = frozenset({"studies", "trials", "version_info"})


def _check_sqlite_file(url: str, must_exist: bool) -> None:
    """Refuse, unchanged, an SQLite storage file that Optuna would add its tables to but
    that is not an Optuna storage: a flashgen tuning database (both have a `trials` table,
    and the tuning database is what --db names) or another program's database; and, for a
    reader, a file that does not exist."""
    from flashgen.store.guard import APPLICATION_ID, file_identity

    try:
        path = _sqlite_file(sqlalchemy.engine.make_url(url).database)
    except sqlalchemy.exc.ArgumentError as exc:
        raise StorageError(f"--storage {url}: {exc}") from None
    if path is None:
        return
    if not path.exists():
        if must_exist:
            raise StorageError(f"--storage {url}: {path} does not exist (`flashgen tune "
                               "--storage` writes it)")
        return
    if not path.is_file():
        raise StorageError(f"--storage {url}: {path} is not a file")
    try:
        app_id, _, tables, applied = file_identity(path)
    except sqlite3.DatabaseError as exc:
        raise StorageError(f"--storage {url}: {path} is not an SQLite database ({exc}); "
                           "flashgen did not change it") from None
    if app_id == APPLICATION_ID or applied:
        raise StorageError(f"--storage {url}: {path} is a flashgen tuning database, not an "
                           "Optuna storage; flashgen did not change it: give --storage a new "
                           "file (or a .log journal) and the tuning database to --db")
    if tables and not _OPTUNA_TABLES.issubset(tables):
        held = ", ".join(tables[:4]) + (", ..." if len(tables) > 4 else "")
        raise StorageError(f"--storage {url}: {path} is another program's SQLite database "
                           f"(it holds tables {held}); flashgen did not change it: give "
                           "--storage a new file or a .log journal")


#: A temporary journal's folder name: this prefix, the owning process id, a random part.
JOURNAL_PREFIX = "flashgen-studies-"
#: The file in that folder naming its owner, "HOST PID": a /tmp shared between hosts or
#: containers holds folders whose process this host cannot ask about.
JOURNAL_OWNER = "owner"
#: Seconds a dead invocation's journal must have been still before it is swept: an orphaned
#: worker may be writing its last trial's outcome.
JOURNAL_STILL_S = 120


@contextlib.contextmanager
def temporary_journal() -> Iterator[str]:
    """A journal file in a new temporary folder, removed at the end (the default storage of
    one `flashgen tune`). First removes the folders of earlier invocations killed before they
    could remove theirs (SIGKILL, the OOM killer): their journals serve nobody."""
    import tempfile

    sweep_journals(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=f"{JOURNAL_PREFIX}{os.getpid()}-") as folder:
        (Path(folder) / JOURNAL_OWNER).write_text(f"{owner()}\n")
        yield str(Path(folder) / "studies.log")


def sweep_journals(root: Path, still_s: float = JOURNAL_STILL_S) -> list[Path]:
    """Remove this user's temporary journal folders under `root` whose owning process, on
    this host, is gone and whose files have not changed for `still_s` seconds; returns them."""
    removed = []
    for folder in root.glob(f"{JOURNAL_PREFIX}*"):
        try:
            info = folder.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            host, pid = (folder / JOURNAL_OWNER).read_text().split()
            if not gone_here(host, int(pid)):
                continue
            changed = max([info.st_mtime, *(f.stat().st_mtime for f in folder.iterdir())])
        except (OSError, ValueError):  # gone meanwhile, not ours to read, or no owner named
            continue
        if time.time() - changed >= still_s:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _retry_stale(study: optuna.Study, trial: FrozenTrial) -> None:
    """Enqueue a dead worker's trial again; a dead claim is simply gone (FAIL)."""
    if not study.study_name.endswith(CLAIMS_SUFFIX):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            _RETRY(max_retry=MAX_RETRY)(study, trial)


#: Optuna 4.9 renamed the callback that enqueues a stale trial again.
_RETRY = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback",
                 getattr(optuna.storages, "RetryFailedTrialCallback", None))


class _HeartbeatJournal(JournalStorage, BaseHeartbeat):
    """A journal storage with Optuna's heartbeat contract, which the journal lacks: a beat is
    a system attribute of the trial (the writer's clock; hosts must agree within the grace
    period), a RUNNING trial without one dates from its start."""

    def __init__(self, backend: JournalFileBackend, heartbeat_s: int, grace_s: int) -> None:
        super().__init__(backend)
        self._heartbeat_s, self._grace_s = heartbeat_s, grace_s

    def record_heartbeat(self, trial_id: int) -> None:
        with contextlib.suppress(UpdateFinishedTrialError, KeyError):
            self.set_trial_system_attr(trial_id, _BEAT_ATTR, time.time())

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        now = time.time()
        stale = []
        for trial in self.get_all_trials(study_id, deepcopy=False,
                                         states=(TrialState.RUNNING,)):
            start = trial.datetime_start.timestamp() if trial.datetime_start else now
            if now - trial.system_attrs.get(_BEAT_ATTR, start) > self._grace_s:
                stale.append(trial._trial_id)
        return stale

    def get_heartbeat_interval(self) -> int | None:
        return self._heartbeat_s

    def get_heartbeat_stale_trial_callback(
            self) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        return _retry_stale


def fail_stale(study: optuna.Study) -> None:
    """Turn the RUNNING trials of dead workers in `study` into FAIL (and retry them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def owner() -> str:
    """This process as `OWNER_ATTR` (and a temporary journal's owner file) names it."""
    return f"{socket.gethostname()} {os.getpid()}"


def _gone(trial: FrozenTrial) -> bool:
    """Whether a running claim or lease belongs to a process of this host that no longer
    exists. Another host's, or one without an owner, waits for its heartbeat."""
    host, _, pid = str(trial.user_attrs.get(OWNER_ATTR, "")).rpartition(" ")
    return pid.isdigit() and int(pid) != os.getpid() and gone_here(host, int(pid))


def live_trials(claims: optuna.Study) -> list[FrozenTrial]:
    """The RUNNING and COMPLETE trials of a claims study, oldest first, once dead workers'
    running ones have failed: what claims, budgets and leases are decided on.

    A worker of this host killed a moment ago (SIGKILL, a crash) is known dead by its pid:
    its claims fail here and now. Until its heartbeat went stale (`GRACE_S`) they counted
    toward the campaign's budget, and a run resumed at once ended a trial short."""
    fail_stale(claims)
    live = []
    for trial in claims.get_trials(deepcopy=False,
                                   states=(TrialState.RUNNING, TrialState.COMPLETE)):
        if trial.state == TrialState.RUNNING and _gone(trial):
            with contextlib.suppress(UpdateFinishedTrialError):
                claims._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            continue
        live.append(trial)
    return sorted(live, key=lambda t: t._trial_id)


class Beater:
    """One thread beating for every trial and claim this worker holds, every interval."""

    def __init__(self, storage: BaseStorage) -> None:
        self.storage = storage
        self._held: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = (storage.get_heartbeat_interval()
                          if isinstance(storage, BaseHeartbeat) else None)
        self._thread: threading.Thread | None = None
        if self._interval:
            self._thread = threading.Thread(target=self._run, name="flashgen-heartbeat",
                                            daemon=True)
            self._thread.start()

    def hold(self, trial_id: int) -> None:
        """Beat for `trial_id` now (a fresh trial must never look stale) and from now on."""
        if self._interval:
            self.storage.record_heartbeat(trial_id)  # type: ignore[attr-defined]
        with self._lock:
            self._held.add(trial_id)

    def drop(self, trial_id: int) -> None:
        with self._lock:
            self._held.discard(trial_id)

    def _run(self) -> None:
        assert self._interval is not None
        while not self._stop.wait(self._interval):
            with self._lock:
                held = list(self._held)
            for trial_id in held:
                with contextlib.suppress(Exception):  # a beat lost is retried next interval
                    self.storage.record_heartbeat(trial_id)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def study_name(key: TuningKey, problem: Problem, version: str) -> str:
    """The study of `problem` under `key` for flashgen `version`: every part that must never
    mix is in the name."""
    shape = ",".join(str(getattr(problem, f)) for f in ("batch", "heads_q", "heads_kv",
                                                         "seq_q", "seq_k"))
    return f"flashgen {version}|{key.id}|{shape}"


@dataclass(frozen=True)
class StudyInfo:
    """What a flashgen study is about (its `INFO_ATTR`), so `pull` can rebuild rows."""

    version: str
    key: TuningKey
    problem: Problem

    def to_attr(self) -> dict[str, Any]:
        return {"version": self.version, "key": self.key.to_columns(),
                "problem": self.problem.to_dict()}

    @classmethod
    def from_attr(cls, attr: dict[str, Any]) -> StudyInfo:
        return cls(attr["version"], TuningKey.from_columns(attr["key"]),
                   Problem.from_dict(attr["problem"]))


@dataclass(frozen=True)
class SharedClaim:
    """The answer to a claim: `kind` is "ours" (measure it), "done" (`outcome` holds what
    another worker measured), "held" (another live worker is measuring it) or "over" (this
    campaign's budget is spent)."""

    kind: str
    trial_id: int | None = None
    outcome: dict[str, Any] | None = None


class Shared:
    """A worker's handle on the shared storage: which storage, which flashgen version its
    studies belong to, and which campaign (the `flashgen tune` invocation, or invocations
    naming one `--campaign`, whose workers share each problem's trial budget and lease)."""

    def __init__(self, storage: BaseStorage, version: str, campaign: str,
                 worker: str) -> None:
        self.storage, self.version, self.campaign, self.worker = (storage, version, campaign,
                                                                  worker)
        self.beater = Beater(storage)

    def close(self) -> None:
        self.beater.close()

    def study(self, key: TuningKey, problem: Problem,
              sampler: optuna.samplers.BaseSampler) -> SharedStudy:
        return SharedStudy(self, key, problem, sampler)

    # ---- problem leases ------------------------------------------------------------------

    def claims_study(self, key: TuningKey, problem: Problem) -> optuna.Study:
        """The claims study beside `problem`'s study (claims and leases live there)."""
        return optuna.create_study(
            storage=self.storage, study_name=study_name(key, problem, self.version)
            + CLAIMS_SUFFIX, direction="minimize", load_if_exists=True)

    def _leases(self, claims: optuna.Study) -> list[FrozenTrial]:
        """This campaign's live and finished leases of one problem, oldest first."""
        return [t for t in live_trials(claims) if t.user_attrs.get(LEASE_ATTR) == self.campaign]

    def lease(self, key: TuningKey, problem: Problem) -> Lease:
        """Ask to lead `problem` for this campaign: "ours" if no other worker of the campaign
        holds or has finished it, else "held" or "done". Workers that lead different problems
        do not each pay a problem's fixed costs (inputs, reference, compiles, baseline) for a
        share of its trials. A lease is a claim-like trial (lowest id wins); a dead worker's
        lease goes stale and fails, so the problem can be leased again."""
        claims = self.claims_study(key, problem)
        leases = self._leases(claims)
        if leases:
            return Lease("done" if leases[0].state == TrialState.COMPLETE else "held")
        template = optuna.trial.create_trial(
            state=TrialState.RUNNING,
            user_attrs={LEASE_ATTR: self.campaign, "worker": self.worker, OWNER_ATTR: owner()})
        trial_id = self.storage.create_new_trial(claims._study_id, template_trial=template)
        self.beater.hold(trial_id)
        first = self._leases(claims)[0]
        if first._trial_id == trial_id:
            return Lease("ours", trial_id)
        self.end_lease(Lease("ours", trial_id), finished=False)
        return Lease("done" if first.state == TrialState.COMPLETE else "held")

    def end_lease(self, lease: Lease, finished: bool = True) -> None:
        """Close a lease this worker holds: COMPLETE when the problem is finished, FAIL when
        given back."""
        if lease.trial_id is None:
            return
        state = TrialState.COMPLETE if finished else TrialState.FAIL
        with contextlib.suppress(UpdateFinishedTrialError):
            self.storage.set_trial_state_values(
                lease.trial_id, state, [0.0] if finished else None)
        self.beater.drop(lease.trial_id)

    def running(self, key: TuningKey, problem: Problem) -> int:
        """This campaign's measurements of `problem` still running (claims held by live
        workers, or by dead ones whose heartbeat has not yet gone stale)."""
        return sum(1 for t in live_trials(self.claims_study(key, problem))
                   if t.state == TrialState.RUNNING and "variant" in t.user_attrs
                   and t.user_attrs.get("campaign") == self.campaign)

    def room(self, key: TuningKey, problem: Problem, budget: int) -> bool:
        """Whether this campaign has claimed fewer than `budget` variants of `problem`."""
        return sum(1 for t in live_trials(self.claims_study(key, problem))
                   if t.user_attrs.get("campaign") == self.campaign) < budget


@dataclass(frozen=True)
class Lease:
    """The answer to `Shared.lease`: `kind` is "ours" (lead the problem), "held" (another
    live worker of the campaign leads it) or "done" (one finished it)."""

    kind: str
    trial_id: int | None = None


class SharedStudy:
    """One problem's study and claims study in the shared storage."""

    def __init__(self, shared: Shared, key: TuningKey, problem: Problem,
                 sampler: optuna.samplers.BaseSampler) -> None:
        self.shared = shared
        name = study_name(key, problem, shared.version)
        info = StudyInfo(shared.version, key, problem).to_attr()
        self.created = True
        try:
            self.study = optuna.create_study(storage=shared.storage, study_name=name,
                                             direction="minimize", sampler=sampler)
            self.study.set_user_attr(INFO_ATTR, info)
        except DuplicatedStudyError:
            self.created = False
            self.study = optuna.load_study(study_name=name, storage=shared.storage,
                                           sampler=sampler)
        self.claims = shared.claims_study(key, problem)
        self._open: set[int] = set()

    # ---- trials --------------------------------------------------------------------------

    def ask(self) -> optuna.Trial:
        """A trial of the study, beaten for until told. Dead workers' trials fail first, so
        their retries are among those `ask` can pop."""
        fail_stale(self.study)
        with warnings.catch_warnings():
            # Optuna warns that heartbeats are meant for `optimize`: we beat ourselves.
            warnings.simplefilter("ignore", UserWarning)
            trial = self.study.ask()
        self.shared.beater.hold(trial._trial_id)
        return trial

    def told(self, trial: optuna.Trial) -> None:
        self.shared.beater.drop(trial._trial_id)

    def measured(self) -> dict[str, dict[str, Any]]:
        """Every variant some worker has measured, by variant JSON, with its outcome."""
        done: dict[str, dict[str, Any]] = {}
        for trial in self.claims.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            attrs = trial.user_attrs
            if "outcome" in attrs:
                done.setdefault(attrs["variant"], attrs["outcome"])
        return done

    # ---- claims --------------------------------------------------------------------------

    def _live(self) -> list[FrozenTrial]:
        return live_trials(self.claims)

    def claim(self, variant_json: str, budget: int | None) -> SharedClaim:
        """Claim `variant_json` for this worker (see the module docstring)."""
        for trial in self._live():
            if trial.state == TrialState.COMPLETE and trial.user_attrs.get(
                    "variant") == variant_json and "outcome" in trial.user_attrs:
                return SharedClaim("done", outcome=trial.user_attrs["outcome"])
        template = optuna.trial.create_trial(
            state=TrialState.RUNNING,
            user_attrs={"variant": variant_json, "campaign": self.shared.campaign,
                        "worker": self.shared.worker, OWNER_ATTR: owner()})
        trial_id = self.shared.storage.create_new_trial(self.claims._study_id,
                                                        template_trial=template)
        self.shared.beater.hold(trial_id)
        self._open.add(trial_id)
        kind = self._standing(trial_id, variant_json, budget)
        if kind != "ours":
            self.release(trial_id)
        return SharedClaim(kind, trial_id if kind == "ours" else None)

    def _standing(self, trial_id: int, variant_json: str, budget: int | None) -> str:
        live = self._live()
        first = next((t for t in live if t.user_attrs.get("variant") == variant_json), None)
        if first is None or first._trial_id != trial_id:
            return "held"  # an earlier live claim (complete ones were taken above)
        if budget is not None:
            ours = [t._trial_id for t in live
                    if t.user_attrs.get("campaign") == self.shared.campaign]
            if trial_id not in ours[:budget]:
                return "over"
        return "ours"

    def still_ours(self, trial_id: int, variant_json: str) -> bool:
        """Whether the claim still holds, checked again just before measuring: a database
        may make an earlier-numbered claim visible a moment after a later one."""
        return self._standing(trial_id, variant_json, None) == "ours"

    def complete(self, trial_id: int, outcome: dict[str, Any]) -> None:
        storage = self.shared.storage
        with contextlib.suppress(UpdateFinishedTrialError):
            storage.set_trial_user_attr(trial_id, "outcome", outcome)
            storage.set_trial_state_values(trial_id, TrialState.COMPLETE, [0.0])
        self._forget(trial_id)

    def release(self, trial_id: int) -> None:
        with contextlib.suppress(UpdateFinishedTrialError):
            self.shared.storage.set_trial_state_values(trial_id, TrialState.FAIL)
        self._forget(trial_id)

    def release_all(self) -> None:
        """Give back every claim still open (budget or time ran out before measuring)."""
        for trial_id in list(self._open):
            with contextlib.suppress(Exception):  # best effort: a stale claim expires anyway
                self.release(trial_id)

    def _forget(self, trial_id: int) -> None:
        self._open.discard(trial_id)
        self.shared.beater.drop(trial_id)

    def set_baseline(self, attrs: dict[str, Any]) -> None:
        self.study.set_user_attr(BASELINE_ATTR, attrs)


def row_of(variant: dict[str, Any], status: str, *, reason: str = "",
           timing: Any = None, tflops: float | None = None, error: float | None = None,
           bound: float | None = None, seed: int | None = None, run_id: str | None = None,
           kernel_hash: str | None = None, created_at: str | None = None) -> dict[str, Any]:
    """A trial row as a JSON-able trial attribute: what `pull` needs to store it as the
    worker stored it. `created_at`: the worker's own row's stamp (default now); `pull`
    knows a row it already holds by it."""
    return {"variant": variant, "status": status, "reason": reason,
            "median_ms": timing.median_ms if timing else None,
            "p20_ms": timing.p20_ms if timing else None,
            "p80_ms": timing.p80_ms if timing else None,
            "reps": timing.reps if timing else None, "tflops": tflops, "error": error,
            "bound": bound, "seed": seed, "run_id": run_id, "kernel_hash": kernel_hash,
            "created_at": created_at or now_stamp()}


def flashgen_studies(storage: BaseStorage) -> Iterator[tuple[optuna.study.StudySummary | Any,
                                                             StudyInfo]]:
    """Every flashgen trials study in `storage` (any version), with what it is about."""
    for frozen in storage.get_all_studies():
        attr = frozen.user_attrs.get(INFO_ATTR)
        if attr and not frozen.study_name.endswith(CLAIMS_SUFFIX):
            yield frozen, StudyInfo.from_attr(attr)


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
