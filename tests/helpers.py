"""Shared test helpers: tiny offline pipelines with a configuration applied, the CLI in a child."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
