"""Shared test helpers: tiny offline pipelines with a configuration applied, the CLI in a child."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (it is not a package: each runs as `python SCRIPT`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def build_tiny(family: str, config: dict | None = None):
    """A tiny pipeline of `family` on the CPU, in the state `config` describes."""
    from autotune.knobs import Target, build_configured
    from autotune.models import resolve_model

    spec = resolve_model(f"tiny-{family}")
    pipe = build_configured(spec, config or {}, Target(device="cpu", family=spec.family))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, family: str, steps: int = 2):
    """One short call at the tiny model's resolution; returns the numpy images."""
    import torch

    from autotune.models import resolve_model

    w = resolve_model(f"tiny-{family}").default_workload
    out = pipe(
        prompt="a red cube", height=w.height, width=w.width, num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(0), output_type="np",
    )
    return out.images


def run_cli(*args, cwd=None, timeout=600, env=None):
    """`autotune ARGS` as a user runs it: a real child process (`env`: variables added to ours)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "autotune", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout,
    )


def run_cli_behind_a_locked_folder(folder: Path, *args, cwd=None, mode=0o000):
    """`autotune ARGS` with `folder` at `mode` (000: no access; 555: read-only), as a user without
    root meets it. Root passes such modes by its capabilities: the child drops them (setpriv),
    and the test skips without setpriv."""
    import shutil

    import pytest

    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip(f"root, and no setpriv to drop the capabilities that pass mode {mode:03o}")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    folder.chmod(mode)
    try:
        return subprocess.run([*prefix, sys.executable, "-m", "autotune", *map(str, args)],
                              capture_output=True, text=True, cwd=cwd, timeout=300)
    finally:
        folder.chmod(0o755)


def rounds_as_the_study_gives(results: dict[int, dict], confirmed: dict[str, list[dict]], rounds: int = 2) -> bool:
    """The confirmation entries of each contender (`confirmed`, the study's attribute; `results`,
    each trial's result by number) number as study._rounds_of gives them: `rounds`, or one more at
    a time (UNDER_LOAD_ROUNDS in all at most) for a config timed under load in its search trial and
    every round before its last, where another contender had a trial timed quiet (as CI's other
    tests can make it). Two workers confirming at once give more rounds without that."""
    from autotune.measure import busy_cores
    from autotune.study import UNDER_LOAD_ROUNDS

    trials = {int(n): [results[int(n)], *entries] for n, entries in confirmed.items()}
    quiet_seen = any(busy_cores(t) is None and t.get("latency_s") is not None for ts in trials.values() for t in ts)
    return all(len(ts) - 1 == rounds or quiet_seen and rounds < len(ts) - 1 <= UNDER_LOAD_ROUNDS
               and all(busy_cores(t) is not None for t in ts[:-1]) for ts in trials.values())


# ---- end-to-end runs of the CLI (test_cli.py, test_cli_runs.py) --------------------------------
# A small space on tiny-sd15 so that end-to-end runs stay short: 8 configurations.
SMALL_SPACE = "knobs:\n  dtype: [float32, bfloat16]\n  channels_last: [false, true]\n  attention: [sdpa, sliced]\n"
# A short workload for end-to-end runs: what these tests check does not depend on the image size.
SMALL_WORKLOAD = ["--height", "64", "--width", "64", "--steps", "2"]


def one_line_error(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def stored_study(tmp_path):
    import optuna

    url = f"sqlite:///{tmp_path / 'autotune-studies' / 'studies.db'}"
    (summary,) = optuna.get_all_study_summaries(url)
    return optuna.load_study(study_name=summary.study_name, storage=url)


def start_cli(tmp_path, *args, stderr=subprocess.STDOUT):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # SIGINT back to its default in the child, as in a terminal: a shell starting the tests as a
    # background job hands them SIGINT ignored, and Python then keeps ignoring it.
    return subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=stderr, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_second_measured_trial(tmp_path, timeout=300) -> int:
    """The number of the second trial that reached a child process, once it has (the first is
    the baseline). Not always trial 1: a trial the sampler draws as a repeat of one measured
    already, or a forbidden one, is told without a child and leaves no directory."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = sorted(tmp_path.glob("autotune-studies/trials/*/trial-*/request.json"))
        if len(started) >= 2:
            return int(started[1].parent.name.split("-")[1])
        time.sleep(0.2)
    raise AssertionError("no second trial started")


def all_trials(tmp_path):
    import optuna

    url = f"sqlite:///{tmp_path / 'autotune-studies' / 'studies.db'}"
    (summary,) = optuna.get_all_study_summaries(url)
    return optuna.load_study(study_name=summary.study_name, storage=url).trials


def processes_left_in(folder, wait_s=10.0):
    """Processes still running with `folder` as their working directory (the CLI's children)."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for proc in psutil.process_iter(["cwd", "status"]):
            if proc.info["cwd"] == str(folder) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(proc)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def write_profile(path, device="cpu", budget="2GB", margin="5%", threads=1, config=None, model="tiny-sd15",
                  measurement=None):
    """A profile of tiny-sd15's default config at 64x64, 1 step, as `autotune verify` reads it. Its
    recorded peak, 200 MiB, fits a 2 GB budget with 1800 MB of margin; a replay peaks at about 500 MiB."""
    from autotune import fingerprint
    from autotune.models import resolve_model
    from autotune.sizes import parse_margin, parse_size
    from autotune.workload import Workload
    import yaml

    spec = resolve_model(model)
    workload = Workload(**{**spec.default_workload.to_dict(), "height": 64, "width": 64, "steps": 1})
    budget_bytes = parse_size(budget)
    point = {"trial": 0, "config": config or {}, "latency_s": 0.1, "peak_memory_bytes": 200 * 2**20}
    path.write_text(yaml.safe_dump({
        "autotune_profile": 1, "model": spec.to_dict(), "workload": workload.to_dict(),
        "budget": {"memory_bytes": budget_bytes, "margin": margin, "margin_bytes": parse_margin(margin, budget_bytes)},
        "measurement": measurement or {"threads": threads, "timed_calls_max": 3, "spread_limit": 0.5},
        "machine": {**fingerprint.machine("cpu"), "device": device}, "software": fingerprint.software(),
        "best": point, "pareto": [point], "study": {"name": "written-by-hand", "choice": None},
    }, sort_keys=False))
    return path
