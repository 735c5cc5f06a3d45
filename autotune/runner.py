"""The parent side of a trial: start the worker in its own process group, wait, kill, classify.

Each trial runs in a process of its own, so that a crash, a leak, global state changed by a knob
(torchao's inductor settings, compiled graphs) or an out-of-memory kill cannot touch the study.

Two launchers start that process:
- "fork": forked from a server process that imported torch and diffusers once (Python's own
  multiprocessing forkserver, preloading autotune.preload). A trial starts in milliseconds.
- "spawn": a fresh interpreter per trial (`python -m autotune.worker`), paying the imports each
  time. The default on CUDA targets until the fork path has been checked on a GPU.
Either way the child leads its own process group, so one killpg ends it and anything it started.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from . import worker
from .measure import resident_bytes
from .sizes import format_size

LAUNCHERS = ("fork", "spawn")

# Host memory kept free while a trial runs: a trial that would take it (a batch far beyond the
# machine) is stopped by the parent as out_of_memory, before the kernel's OOM killer picks a
# process, which may be autotune itself or anything else on the machine. Checked every
# GUARD_EVERY_S, finer than the tick: host memory can fill within a second.
HOST_RESERVE_BYTES = min(2**30, psutil.virtual_memory().total // 20)
GUARD_EVERY_S = 0.1
EXIT_GRACE_S = 30.0  # a child that wrote its result is given this long to exit, then killed


@contextlib.contextmanager
def environment(**values: str):
    """Environment variables that child processes started inside the block inherit; the old
    values (or their absence) come back after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def default_launcher(device: str) -> str:
    return "spawn" if device.startswith("cuda") else "fork"


class _Spawned:
    server_died = False  # no server between this parent and its child

    def __init__(self, request_path: Path, result_path: Path, log_path: Path, tick=None, tick_every_s=1.0):
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONUNBUFFERED="1")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.worker", str(request_path), str(result_path), worker.this_process()],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self):
        self._log.close()


_forkserver = None


def _fork_context(log_dir: Path):
    global _forkserver
    if _forkserver is None:
        # The server starts on the first trial and inherits this environment: CUDA's numbering
        # as NVML's (PCI bus order), as spawned trials get it, whatever order the user's shell set
        # (a faster GPU listed first would be measured as another's index; helper-17)
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ.setdefault("AUTOTUNE_FORKSERVER_LOG", str(log_dir / "forkserver.log"))
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(["autotune.preload"])
    return _forkserver


@contextlib.contextmanager
def _ticking(tick, tick_every_s: float):
    """`tick` called every `tick_every_s` from a thread while the block runs: a forked trial's
    start waits for its fork server's imports (seconds; a minute on a loaded machine), and a
    shared study's other workers fail a trial whose heartbeat is storages.GRACE_S old (helper-21:
    no tick ran there). Heartbeats from a thread, as Optuna's own heartbeat thread records them."""
    if tick is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(tick_every_s):
            try:
                tick()
            except Exception:
                # a storage that did not answer this time, or a trial given up as stale: the
                # trial's own loop ticks next and meets the same error where it is handled
                pass

    beating = threading.Thread(target=beat, name="autotune-trial-start-heartbeat", daemon=True)
    beating.start()
    try:
        yield
    finally:
        stop.set()
        beating.join()


FORK_ATTEMPTS = 3  # starts of a forked trial where its server dies under it
SERVER_DIED = "server_died"  # True in a result: its fork server died while it ran (not the config's doing)


class _Forked:
    def __init__(self, request_path: Path, result_path: Path, log_path: Path, tick=None, tick_every_s=1.0):
        context = _fork_context(log_path.parent.parent)
        for attempt in range(FORK_ATTEMPTS):
            self.proc = context.Process(
                target=worker.forked_main, daemon=False,
                args=(str(request_path), str(result_path), str(log_path), worker.this_process()))
            try:
                with _ticking(tick, tick_every_s):  # blocks until the server has imported
                    self.proc.start()
                break
            except (EOFError, OSError):
                # the server died, and was still dying when ensure_running looked: it starts
                # another once it sees this one gone. (A server that died between forking the
                # trial and sending its pid, a window of microseconds, leaves that trial running
                # unknown to this parent, beside the one started again.)
                if attempt == FORK_ATTEMPTS - 1:
                    raise
                time.sleep(0.5)
        self.pid = self.proc.pid
        try:
            self._created = psutil.Process(self.pid).create_time()
        except psutil.Error:
            self._created = None  # ended already
        self.server_died = False

    def wait(self, timeout: float) -> int | None:
        self.proc.join(timeout)
        code = self.proc.exitcode
        if code is not None and self._running():
            # The fork server reports its children's exits: where it died, multiprocessing says
            # 255 while the trial runs on, orphaned (helper-21)
            self.server_died = True
        return code

    def _running(self) -> bool:
        try:
            child = psutil.Process(self.pid)
            return child.create_time() == self._created and child.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def close(self):
        self.proc.close()


def _kill_group(child) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone already, or killed before it could lead a group of its own
    try:
        os.kill(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait(None)


def _kill_leftovers(child) -> None:
    """After the trial's process ended (or was reported ended): what it started and left behind
    (a shell, a compile worker), and the trial itself where its fork server died, go with its
    process group (helper-21: both ran on). The group only: the ended process's own pid may be
    free for another process by now."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it
    if child.server_died:
        # forked, not yet leading its group (os.setsid) when its server died: itself too; its
        # pid is its own, as _Forked._running has just matched its start time
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)


def signal_name(number: int) -> str:
    """SIGKILL, SIGSEGV, ...; a real-time signal (signal.Signals names only its ends) as SIGRTMIN+N."""
    try:
        return signal.Signals(number).name
    except ValueError:
        rtmin = getattr(signal, "SIGRTMIN", None)
        if rtmin is not None and rtmin < number < signal.SIGRTMAX:
            return f"SIGRTMIN+{number - rtmin}"
        return f"signal {number}"


def _log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_trial(
    request: dict,
    workdir: Path,
    timeout_s: float,
    tick: Callable[[], None] | None = None,
    tick_every_s: float = 1.0,
    launcher: str = "spawn",
    stop_above_bytes: int | None = None,
    stop_above_what: str = "",
    may_hold_bytes: int | None = None,
) -> dict:
    """Run one trial in a child process and return its result dict (always; never raises for
    what happens in the child). `tick` is called about every `tick_every_s` while the child runs
    (heartbeats, progress). On KeyboardInterrupt the child's process group is killed first.
    `stop_above_bytes`: a trial whose resident memory passes it is stopped as out_of_memory (on a
    CPU, where the budget is host memory, a config far over it cannot fit whatever its speed);
    `stop_above_what` says what that bound is, for the message ("2x the 2.00 GiB budget").
    `may_hold_bytes`: on a CPU, what a trial may hold and still fit (the budget less its margin,
    host memory). A trial stopped because the machine's memory ran short while it held no more
    than that is marked as the machine's (other processes hold the rest), not judged by the
    budget; one holding more cannot fit, and records what it held as its peak."""
    workdir.mkdir(parents=True, exist_ok=True)
    request_path, result_path, log_path = (
        workdir / "request.json",
        workdir / "result.json",
        workdir / "worker.log",
    )
    request_path.write_text(json.dumps(request))
    result_path.unlink(missing_ok=True)
    log_path.unlink(missing_ok=True)  # a forked child that dies before opening it: no earlier run's last line
    started = time.perf_counter()  # the trial's wall time counts its process's start
    child = {"fork": _Forked, "spawn": _Spawned}[launcher](request_path, result_path, log_path, tick, tick_every_s)

    def killed(status: str, error: str, **extra) -> dict:
        _kill_group(child)
        return {"status": status, "error": error, "wall_s": time.perf_counter() - started,
                "launcher": launcher, "log": str(log_path), **extra}

    written_at = None  # when result.json was first seen, the child still running
    try:
        # --trial-timeout from the child's start: the fork server's own start (its imports) is
        # not the trial's, and a first trial timed out before its process began (helper-21)
        deadline = time.perf_counter() + timeout_s
        next_tick = time.perf_counter() + tick_every_s
        while True:
            # never past the deadline: a --trial-timeout under one tick is held too
            returncode = child.wait(max(0.0, min(GUARD_EVERY_S, deadline - time.perf_counter())))
            if returncode is not None:
                break
            # Measured, and slow to exit (a CUDA or inductor teardown): the result stands, and the
            # child is not waited for past EXIT_GRACE_S (the result is written whole, os.replace).
            if result_path.exists():
                written_at = written_at or time.perf_counter()
                if time.perf_counter() - written_at >= EXIT_GRACE_S or time.perf_counter() >= deadline:
                    _kill_group(child)
                    break
            # The trial's own RSS (one /proc read; its children would mean scanning every process),
            # read only when it can matter.
            available = psutil.virtual_memory().available
            if available < HOST_RESERVE_BYTES:
                held = resident_bytes(child.pid) or 0
                # On a GPU no peak: the peak is device memory, and host RSS would stand for it.
                mark = worker.host_memory_mark(request["device"], held, may_hold_bytes)
                said = (f", within the {format_size(may_hold_bytes)} it may hold to fit: other processes hold the rest"
                        if worker.machine_was_short(mark) else "")
                return killed(worker.OUT_OF_MEMORY, f"host memory nearly exhausted ({available // 2**20} MiB "
                              f"available, the trial holding {held // 2**20} MiB{said}): stopped before the kernel's "
                              "out-of-memory killer", **mark)
            if stop_above_bytes and (held := resident_bytes(child.pid) or 0) > stop_above_bytes:
                what = f"{stop_above_what}; " if stop_above_what else ""
                return killed(worker.OUT_OF_MEMORY, f"the trial's resident memory passed {format_size(stop_above_bytes)} "
                              f"({what}{format_size(held)} when read): stopped, as it cannot fit the budget",
                              peak_memory_bytes=held)  # at least this much: it was still growing
            if tick and time.perf_counter() >= next_tick:
                tick()
                next_tick += tick_every_s
            if time.perf_counter() >= deadline:
                return killed(worker.TIMEOUT, f"no result after {timeout_s:g} s (--trial-timeout); killed")
        _kill_leftovers(child)
    except BaseException:
        _kill_group(child)
        raise
    finally:
        child.close()
    wall_s = time.perf_counter() - started
    if result_path.exists():
        result = json.loads(result_path.read_text())
        failed = result.get(worker.HOST_ALLOCATION_FAILED)
        if failed is not None and may_hold_bytes is not None and worker.OUT_OF_MEMORY_ON not in result:
            # an allocation the machine refused inside the trial, judged as this loop judges its
            # own stop: what it held and asked for within what it may hold, the machine's
            held = (result.get("peak_memory_bytes") or 0) + failed
            result.update(worker.host_memory_mark(request["device"], held, may_hold_bytes))
    elif child.server_died:
        result = {"status": worker.CRASHED, SERVER_DIED: True,
                  "error": "the fork server that started the trial died while it ran (killed by hand, or by "
                           "the kernel's out-of-memory killer?); the trial was stopped"}
    elif returncode < 0:
        name = signal_name(-returncode)
        hint = " (the kernel's OOM killer sends this when host memory runs out)" if name == "SIGKILL" else ""
        result = {"status": worker.CRASHED, "signal": name, "error": f"killed by {name}{hint}"}
    else:
        tail = _log_tail(log_path).strip().splitlines()
        last = tail[-1] if tail else ""
        result = {"status": worker.CRASHED, "error": f"exited with code {returncode}: {last}"}
        if last.startswith("MemoryError"):  # raised outside the worker's handlers (while importing)
            result["status"] = worker.OUT_OF_MEMORY
            result.update(worker.host_memory_mark(request["device"], 0, may_hold_bytes))  # it held little yet
    result["wall_s"] = wall_s
    result["launcher"] = launcher
    result["log"] = str(log_path)
    return result
