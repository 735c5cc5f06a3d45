"""Where studies are kept: Optuna storages opened from the URLs users type, and the default one.

A URL is read as SQLAlchemy reads it (`storage_file`), so the file autotune checks or resolves
is the file the storage opens. RDB storages (SQLite, PostgreSQL, MySQL) get Optuna's heartbeats,
and a journal file gets the ones study.py keeps as trial attributes, with the same settings
(HEARTBEAT_S, GRACE_S, MAX_RETRIES), so that a trial left RUNNING by a killed worker is failed and
retried.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import shlex
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import AutotuneError, first_line

if TYPE_CHECKING:  # optuna is imported where a storage opens: the CLI's --help stays quick
    import optuna


def _seconds_from_env(name: str, default: float) -> tuple[float, str | None]:
    """The environment variable `name` in seconds (`default` where unset), and its text where it
    is no number of seconds, the default kept then."""
    text = os.environ.get(name)
    try:
        value = default if text is None else float(text)
    except ValueError:
        return default, text
    return (value, None) if 0 <= value < math.inf else (default, text)  # nan: no trial ever stale


HEARTBEAT_S = 5  # a parent alive writes a heartbeat this often while its trial runs
# A RUNNING trial without a heartbeat for this long was orphaned: failed, retried. The environment
# variable shortens it for the tests that kill workers. A value that is no number of seconds is said
# where a storage opens (open_storage): read here, at import, it was a traceback on --help too.
GRACE_S, _BAD_GRACE = _seconds_from_env("AUTOTUNE_STALE_AFTER_S", 20.0)
MAX_RETRIES = 2  # an orphaned trial is measured again at most this often
DEFAULT_WORKDIR = Path("autotune-studies")  # trial folders, compile cache and the default storage


def _proc_stat(pid: int) -> tuple[int, str] | None:
    """A process's start in clock ticks after boot and its state letter, from /proc/PID/stat
    (fields 22 and 3); None where it cannot be read. Ticks after boot, not psutil's
    create_time: that one is wall-clock time and moves when the clock is set (NTP, a VM resumed),
    which would make a live worker look like another process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        return int(fields[19]), fields[0]
    except (OSError, ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def _machine() -> tuple[str, int] | None:
    """This boot (Linux's boot_id) and PID namespace; read once, as neither changes while a
    process lives (a forked child shares both)."""
    try:
        return (Path("/proc/sys/kernel/random/boot_id").read_text().strip(), os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def this_process(trial_number: int) -> dict | None:
    """Who holds trial `trial_number`, told so that a later run on the same machine can see it
    gone: the boot (boot_id, one per machine and boot: two machines may share a host name), the
    PID namespace (containers on one host), the PID and its start (a PID in use again). The
    trial's number goes with it: Optuna's retry of a trial copies its attributes, and the copy
    must not speak for the retry. None where /proc cannot tell; such a trial waits out the
    heartbeat grace (GRACE_S)."""
    machine, stat = _machine(), _proc_stat(os.getpid())
    if machine is None or stat is None:
        return None
    return {"trial": trial_number, "boot_id": machine[0], "pid_ns": machine[1], "pid": os.getpid(),
            "start_ticks": stat[0]}


def written_for(holder, trial_number: int) -> bool:
    """Whether `holder` is this_process's record for trial `trial_number` (Optuna's retry copies
    its dead trial's record, which does not speak for the retry)."""
    return isinstance(holder, dict) and holder.get("trial") == trial_number


def is_gone(holder: dict | None, trial_number: int) -> bool:
    """Whether the process that `this_process(trial_number)` described, on this machine, has
    ended (or is a zombie its parent has not reaped): its RUNNING trial was orphaned and need not
    wait out GRACE_S (a resume after SIGKILL waited 20 s in silence). False whenever it cannot
    tell: no record or another trial's, another machine or container, a process that runs, one
    hidden from this user (/proc mounted hidepid)."""
    if not written_for(holder, trial_number):
        return False
    if _machine() is None or (holder.get("boot_id"), holder.get("pid_ns")) != _machine():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the PID exists
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process: it exists
    stat = _proc_stat(pid)
    if stat is None:
        return False  # it exists, hidden from this user
    start, state = stat
    return start != holder.get("start_ticks") or state == "Z"


def default_storage(workdir: Path | None = None) -> str:
    """The storage a run keeps in its working folder when no --storage names another."""
    return sqlite_url((workdir or DEFAULT_WORKDIR) / "studies.db")


_IN_MEMORY = (None, "", ":memory:")  # SQLite databases that live in memory only


def _sqlite(url: str):
    """SQLAlchemy's reading of a SQLite URL, or None for any other storage (a journal file, a
    database server, or no URL at all: open_storage says so)."""
    parsed = _server_url(url)
    return parsed if parsed is not None and parsed.get_backend_name() == "sqlite" else None


def keeps_nothing(url: str) -> bool:
    """Whether the storage lives in memory only: autotune's "memory", SQLite's `sqlite://` and
    `:memory:` (a study there is gone when the run ends)."""
    sqlite = _sqlite(url)
    return url == "memory" or (sqlite is not None and sqlite.database in _IN_MEMORY)


def storage_file(url: str) -> Path | None:
    """The file behind a SQLite or journal storage URL (None for a server or in-memory database).
    Parsed by SQLAlchemy, so that a query string (`?timeout=30`), a driver (`sqlite+pysqlite`)
    and escapes (`%3F`) mean what they mean when the storage opens."""
    if url.startswith("journal:"):
        name = url[len("journal:"):]
    else:
        sqlite = _sqlite(url)
        if sqlite is None or sqlite.database in _IN_MEMORY:
            return None
        name = sqlite.database
    if "\0" in name:  # %00 decoded: every use of the path would be "ValueError: embedded null byte"
        raise AutotuneError(f"storage {url}: its file name holds a NUL byte (%00), which no file name can")
    return Path(name)


def _server_url(url: str):
    """SQLAlchemy's reading of a database URL; None for a journal file, "memory" or no URL."""
    if url == "memory" or url.startswith("journal:"):
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        return None


MASK = "***"  # SQLAlchemy's stand-in for a hidden password


class RetryStaleTrial:
    """Optuna's retry of a stale trial (RetryHeartbeatStaleTrialCallback), less the constraints
    the dead attempt recorded before it was told: Optuna copies every system attribute into the
    retry, and Trial.set_constraint keeps a value already set (with a warning), so the sampler
    would judge the retry's feasibility by the dead attempt's measurement."""

    _CONSTRAINT = "constraints:"  # the key prefix of Optuna's Trial.set_constraint

    def __init__(self):
        import optuna

        self._retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES)

    def __call__(self, study, trial) -> None:
        fresh = copy.copy(trial)
        fresh.system_attrs = {key: value for key, value in trial.system_attrs.items()
                              if not key.startswith(self._CONSTRAINT)}
        self._retry(study, fresh)


def export_command(study_name: str, url: str) -> str:
    """The `autotune export` line that writes a stored study's profile, quoted to be pasted into a
    shell: study names may hold spaces or begin with a dash, which argparse reads as an option
    unless joined to it with '='."""
    name = shlex.quote(study_name)
    return (f"autotune export --study-name{'=' if study_name.startswith('-') else ' '}{name} "
            f"--storage {shlex.quote(display_url(url))}")


def display_url(url: str) -> str:
    """`url` as autotune shows and records it: a database server's password masked (***), in the
    URL as SQLAlchemy renders it and in a `password` query argument, for profiles, reports and
    messages are read and shared by people other than the one who typed it."""
    parsed = _server_url(url)
    if parsed is None:
        return url
    if "password" in parsed.query:
        parsed = parsed.update_query_dict({"password": MASK})
    elif parsed.password is None:
        return url
    return parsed.render_as_string(hide_password=True)


def is_masked(url: str) -> bool:
    """Whether `url` was recorded by display_url with its password masked: it cannot open."""
    parsed = _server_url(url)
    return parsed is not None and (parsed.password == MASK or parsed.query.get("password") == MASK)


def with_storage_file(url: str, path: Path) -> str:
    """`url` (a SQLite or journal storage URL) with its file replaced by `path`."""
    if url.startswith("journal:"):
        return f"journal:{path}"
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=str(path)).render_as_string(hide_password=False)


def sqlite_url(path: Path) -> str:
    """The storage URL of the SQLite file `path`, escaped (a folder named `runs?1` stays one)."""
    from sqlalchemy.engine import URL

    return URL.create("sqlite", database=str(path)).render_as_string()


def open_storage(url: str, existing: bool = False) -> optuna.storages.BaseStorage:
    """The storage behind a URL, or one clear AutotuneError (bad URL, server down, no driver).

    `existing`: only read what is there; a SQLite or journal file that is missing is an error
    instead of being created empty (for warm starts, export and reports).

    RDB storages (SQLite, PostgreSQL, MySQL) get heartbeats, so that a trial left RUNNING by a
    killed parent is failed and retried (RetryStaleTrial re-enqueues it)."""
    import optuna

    if url == "memory":  # nothing kept: for replays and tests of the search itself
        return optuna.storages.InMemoryStorage()
    if _BAD_GRACE is not None:  # the heartbeats' grace, which every storage that keeps trials uses
        raise AutotuneError(f"AUTOTUNE_STALE_AFTER_S={_BAD_GRACE!r}: not a number of seconds (unset, it is {GRACE_S:g})")
    shown = display_url(url)
    path = check_file(url, must_exist=existing)  # a reader creates nothing
    if path is not None and not path.parent.is_dir():  # else SQLite's "unable to open database file"
        raise AutotuneError(f"storage {url}: no such folder {path.parent}")
    if existing and path is not None and not url.startswith("journal:") and not _has_optuna_tables(path):
        # Opening it would create Optuna's tables in it (a 0-byte file grew to 112 KiB): a reader
        # (export, a report, a warm start) writes nothing, and finds no study there.
        return optuna.storages.InMemoryStorage()
    if url.startswith("journal:"):
        _check_journal(url, path)
        if not existing:
            _set_aside_a_cut_last_line(url, path)
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
        return _rdb_storage(url)
    except ImportError as exc:  # Optuna's "Failed to import DB access module", the driver's name below
        missing = getattr(exc.__cause__, "name", None) or str(exc.__cause__ or exc)
        fix = ' (pip install "autotune[postgres]")' if url.startswith("postgres") else ""
        raise AutotuneError(f"storage {shown}: cannot open it: its database driver is not installed "
                            f"(no module {missing}){fix}") from None
    except Exception as exc:  # SQLAlchemy's and the drivers' errors: many types, one meaning here
        raise AutotuneError(f"storage {shown}: cannot open it ({first_line(exc)})") from None


# ---- naming storages: URLs, SQLite files, NAME@STORAGE ----------------------------------------
SQLITE_HEADER = b"SQLite format 3\0"
_STORAGE_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://|journal:")


def is_storage_url(text: str) -> bool:
    """Written as a storage URL (a database URL or journal:PATH), not as a path."""
    return "://" in text or text.startswith("journal:")


def is_sqlite_file(text: str) -> bool:
    """A path that names a SQLite database: one ending .db, or a file that begins as one does."""
    if text.endswith(".db"):
        return True
    try:
        with Path(text).open("rb") as f:
            return f.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:
        return False


JOURNAL_START = b'{"op_code":'  # the first line of every journal: the operation that created a study


def is_journal_file(text: str) -> bool:
    """A path that names a file Optuna's journal storage wrote: JSON lines, an operation each."""
    try:
        with Path(text).open("rb") as f:
            return f.read(len(JOURNAL_START)) == JOURNAL_START
    except OSError:
        return False


def as_storage_url(text: str) -> str:
    """A path that names a SQLite file (x.db) or a journal file as its storage URL; anything else
    as it is (`autotune report runs.journal` read the journal as a profile: "not valid YAML")."""
    if not text or is_storage_url(text):
        return text
    if is_sqlite_file(text):
        return sqlite_url(Path(text))
    return f"journal:{text}" if is_journal_file(text) else text


def study_and_storage(entry: str) -> tuple[str, str] | None:
    """`NAME@STORAGE` as (name, storage URL), split at the first '@' that a storage URL or a
    SQLite file that is there follows: a study name may hold '@' ("team@gpu1"), and a URL's own '@'
    (postgresql://user:pw@host/db) comes after its start. None: no storage named, or the entry
    is a storage URL or a file as a whole (sqlite:////data/team@gpu1/studies.db)."""
    if _STORAGE_URL_START.match(entry) or os.path.exists(entry):
        return None
    at = entry.find("@")
    while at != -1:
        rest = entry[at + 1:]
        if _STORAGE_URL_START.match(rest) or (os.path.isfile(rest) and is_sqlite_file(rest)):
            return entry[:at], as_storage_url(rest)
        at = entry.find("@", at + 1)
    at = entry.rfind("@")  # a SQLite file not there (x@missing.db): its name is what follows the last '@'
    if at > 0 and entry.endswith(".db"):
        return entry[:at], as_storage_url(entry[at + 1:])
    return None


def check_url(url: str) -> None:
    """One AutotuneError if `url` is not written as a storage URL (a path typed where a URL goes:
    SQLAlchemy's "Could not parse SQLAlchemy URL" says less)."""
    if url != "memory" and not is_storage_url(url):
        raise AutotuneError(f"storage {url}: not a storage URL; for a SQLite file write "
                            f"{sqlite_url(Path(url))}, for a journal file journal:{url}")


def check_file(url: str, must_exist: bool = True, hint: str = "") -> Path | None:
    """The SQLite or journal file `url` names (None for a server or memory), or one AutotuneError:
    not a URL, a folder (else "unable to open database file" or "Is a directory"), or, with
    `must_exist`, no such file, with `hint` added (WORKDIR_HINT where the URL is the default
    storage, not one the user named)."""
    check_url(url)
    path = storage_file(url)
    if path is not None and path.is_dir():
        raise AutotuneError(f"storage {url}: {path} is a folder, not a storage file")
    if must_exist and path is not None and not path.is_file():
        raise AutotuneError(f"storage {url}: no such file {path}{hint}")
    return path


def check_opens(url: str) -> None:
    """One AutotuneError now, before a search starts, if the storage does not open (a server that
    does not answer, a driver not installed); the connections made to check are closed."""
    engine = getattr(open_storage(url), "engine", None)  # RDB storages: SQLAlchemy's pool
    if engine is not None:
        engine.dispose()


WORKDIR_HINT = " (tuned with --workdir? give the same here)"  # where the default storage is missing


def _has_optuna_tables(path: Path) -> bool:
    """Whether the SQLite file `path` holds Optuna's tables, read without writing to it; a file
    that is no database counts as holding them, so that opening it says what it is."""
    import sqlite3
    from contextlib import closing

    if path.stat().st_size == 0:
        return False
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'studies'").fetchone() \
                is not None
    except sqlite3.DatabaseError:
        return True


def _check_journal(url: str, path: Path) -> None:
    """A file that is there must be an Optuna journal, every line of it: Optuna takes a first
    line it cannot parse for a record cut short by a crash, and appends its own after it, into the
    user's file; and a line past the first that is no record stops its reading with json's
    "Expecting value" wherever it reads next (at the start, or later, as a traceback). A last line
    without its newline is a record cut short by a crash, which Optuna skips."""
    import json

    try:
        f = path.open("rb")
    except FileNotFoundError:
        return  # a new journal: Optuna creates it
    except OSError as exc:
        raise AutotuneError(f"storage {url}: cannot read {path} ({exc.strerror or exc})") from None
    with f:  # line by line: a big file named by mistake is refused at its first line
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n") and (number > 1 or line.startswith(b'{"op_code":')):
                break  # the last line, cut short (a worker writing it now, or a crash); the first, as Optuna begins one
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and "op_code" in record:
                continue
            if number == 1:
                raise AutotuneError(f"storage {url}: {path} is not an Optuna journal file (its first line is no "
                                    "journal record); name a new file or an existing journal")
            raise AutotuneError(f"storage {url}: {path} holds a line that is no journal record (line {number}: "
                                "edited by hand, or corrupted); Optuna reads no further: mend or remove that "
                                "line, or name another file")


def _new_file_beside(path: Path, suffix: str) -> Path:
    """A file made empty beside `path`, named PATH.SUFFIX, or PATH.SUFFIX-2 and on where that
    exists: two cut records set aside within one second each keep their own."""
    candidate, n = path.with_name(f"{path.name}.{suffix}"), 1
    while True:
        try:
            candidate.open("xb").close()  # exclusive: made here, or FileExistsError
            return candidate
        except FileExistsError:
            n += 1
            candidate = path.with_name(f"{path.name}.{suffix}-{n}")


def _set_aside_a_cut_last_line(url: str, path: Path) -> None:
    """A journal whose last line lacks its newline ends in a record cut short (a worker killed
    while writing it, a full disk). Optuna skips it when reading, but appends the next record
    onto it, which makes one line that is no record in the middle of the file: every later read
    fails. Under Optuna's own lock, so that no worker is writing, the cut part is moved to a file
    beside the journal (nothing is deleted) and the journal ends at its last whole record."""
    from optuna.storages.journal import JournalFileSymlinkLock  # JournalFileBackend's default lock

    def cut_at() -> int | None:
        """Where the cut last line begins, or None where the file ends with a whole line."""
        try:
            with path.open("rb") as f:
                size = f.seek(0, os.SEEK_END)
                if size == 0 or (f.seek(size - 1), f.read(1))[1] == b"\n":
                    return None
                block = min(size, 1 << 20)  # a record is far shorter than this
                f.seek(size - block)
                return size - block + f.read(block).rfind(b"\n") + 1
        except FileNotFoundError:
            return None

    if cut_at() is None:
        return
    lock = JournalFileSymlinkLock(str(path))
    try:
        lock.acquire()
    except OSError as exc:  # a read-only folder: no lock, and no new record either
        raise AutotuneError(f"storage {url}: {path} ends in a record cut short, which could not be set aside "
                            f"({exc.strerror or exc})") from None
    try:
        start = cut_at()  # again, under the lock: a worker may have finished its line meanwhile
        if start is None:
            return
        aside = _new_file_beside(path, f"cut-{int(time.time())}")
        with path.open("r+b") as f:
            f.seek(start)
            aside.write_bytes(f.read())
            f.truncate(start)
    except OSError as exc:
        raise AutotuneError(f"storage {url}: {path} ends in a record cut short, which could not be set aside "
                            f"({exc.strerror or exc})") from None
    finally:
        lock.release()
    warnings.warn(f"storage {url}: its last record was cut short (a run stopped while writing it): set aside in "
                  f"{aside.name}, so that the next record starts a line of its own")


def _rdb_storage(url: str, attempts: int = 5) -> optuna.storages.RDBStorage:
    import optuna
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(attempts):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(
                    url,
                    heartbeat_interval=HEARTBEAT_S,
                    grace_period=GRACE_S,
                    heartbeat_stale_trial_callback=RetryStaleTrial(),
                    # SQLite: a worker waits for another's write rather than fail at 5 s
                    engine_kwargs={"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None,
                )
                if storage.engine.name == "sqlite" and storage.engine.url.database not in _IN_MEMORY:
                    _serialize_sqlite_transactions(storage.engine)  # an in-memory one has one user
                return storage
        except (IntegrityError, ProgrammingError) as exc:
            # Workers starting together on an empty PostgreSQL database race to create Optuna's
            # tables and types: the loser gets "duplicate key ... pg_type" or 'type
            # "studydirection" already exists', and finds them made a moment later.
            racing = isinstance(exc, IntegrityError) or "already exists" in str(exc)
            if not racing or attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def _serialize_sqlite_transactions(engine) -> None:
    """Make every SQLite transaction take the write lock when it begins (BEGIN IMMEDIATE).

    Optuna hands a queued trial to a worker by reading that it is WAITING and then writing
    RUNNING, under SELECT ... FOR UPDATE, which SQLite ignores: two workers sharing an SQLite
    study (`--gpus`, or two commands) both read WAITING and both took the trial (40 queued
    trials, 4 processes: 7 handed out twice), then measured one config in one trial folder
    and one of them crashed telling a finished trial. With the lock taken at BEGIN the second
    reader waits and sees RUNNING. Workers write a few rows a second, so waiting costs
    milliseconds. The recipe is SQLAlchemy's for pysqlite (its docs, "Serializable isolation"):
    keep the driver from issuing its own deferred BEGIN, issue ours."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _driver_begins_nothing(dbapi_connection, _record):
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # connections opened before the listeners (Optuna's table check) go
