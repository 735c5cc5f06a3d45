"""The parent side of a trial: start the worker in its own process group, wait, kill, classify.

Each trial runs in a fresh child process so that a crash, a leak, global state changed by a knob
(torchao's inductor settings, compiled graphs) or an out-of-memory kill cannot touch the study.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import worker


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


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
) -> dict:
    """Run one trial in a child process and return its result dict (always; never raises for
    what happens in the child). `tick` is called about every `tick_every_s` while the child runs
    (heartbeats, progress). On KeyboardInterrupt the child's process group is killed first."""
    workdir.mkdir(parents=True, exist_ok=True)
    request_path, result_path, log_path = (
        workdir / "request.json",
        workdir / "result.json",
        workdir / "worker.log",
    )
    request_path.write_text(json.dumps(request))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.worker", str(request_path), str(result_path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: one killpg ends it and its children
        )
        try:
            while True:
                try:
                    proc.wait(timeout=tick_every_s)
                    break
                except subprocess.TimeoutExpired:
                    if tick:
                        tick()
                    if time.perf_counter() - started > timeout_s:
                        _kill_group(proc)
                        return {
                            "status": worker.TIMEOUT,
                            "error": f"no result after {timeout_s:.0f} s (--trial-timeout); killed",
                            "wall_s": time.perf_counter() - started,
                        }
        except BaseException:
            _kill_group(proc)
            raise
    wall_s = time.perf_counter() - started
    if result_path.exists():
        result = json.loads(result_path.read_text())
    elif proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        hint = " (the kernel's OOM killer sends this when host memory runs out)" if name == "SIGKILL" else ""
        result = {"status": worker.CRASHED, "signal": name, "error": f"killed by {name}{hint}"}
    else:
        tail = _log_tail(log_path).strip().splitlines()
        last = tail[-1] if tail else ""
        result = {"status": worker.CRASHED, "error": f"exited with code {proc.returncode}: {last}"}
    result["wall_s"] = wall_s
    result["log"] = str(log_path)
    return result
