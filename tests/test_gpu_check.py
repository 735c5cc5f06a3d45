"""benchmarks/gpu_check.sh's own start, on this machine: what a GPU visit's one command depends on
before its first test."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_python_without_the_packages_is_told_what_is_missing_in_one_line(tmp_path):
    """Run by a Python whose start imports nothing beyond itself (-S: no site, as a Python 3.12
    without autotune's editable install starts), the check named nothing: `import importlib`
    alone gave no importlib.util, and it ended in an AttributeError (helper-17). PYTHONPATH
    emptied: packages installed there (the GPU machine's --target folder) are found without site."""
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path / "out"), "suite"], cwd=ROOT,
                          env={**os.environ, "PYTHON": f"{sys.executable} -S", "PYTHONPATH": ""}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == ("gpu_check: not importable here: torch, diffusers, optuna, torchao, pynvml, "
                                   "skimage, xdist, pytest_timeout")
    assert not (tmp_path / "out" / "gpu-tests.log").exists()  # stopped before any stage
