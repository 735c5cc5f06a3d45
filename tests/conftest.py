import os
import sys
from pathlib import Path

# One CPU thread in every test process and every child it starts (trials take the CLI's thread
# count, torch's default, which reads this). The suite runs on 2 cores with two pytest workers and
# child processes beside them: OpenMP threads of two processes spinning on the same cores made a
# tiny pipeline call 20x slower (5 s against 0.1-0.3 s). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests import helpers.py by name

from helpers import run_cli  # noqa: E402


# The test files, the longest-running first (per-file sums of `pytest --junitxml` times, 2026-12-02).
# `-n 2 --dist loadfile` gives a worker a whole file at a time, and xdist hands out the files with
# the most tests first: a file of few but long tests (test_shared_study.py: 5 tests, 104 s) came late and kept one
# worker busy for minutes while the other had nothing left. Handed out longest first, the two end
# within a short file of each other. A file not listed (a new one) goes first: of unknown length,
# it is cheaper early than last. A stale order costs balance, never a test.
LONGEST_FIRST = [
    "tests/test_cli.py", "tests/test_cli_runs.py", "tests/test_catalogue.py", "tests/test_runner.py",  # 374-151 s
    "tests/test_shared_study.py", "tests/test_report.py", "tests/test_study.py", "tests/test_quality.py",  # 104-54 s
    "tests/test_knobs.py", "tests/test_profile.py", "tests/test_models.py", "tests/test_space.py",  # 44-15 s
    "tests/test_measure.py", "tests/test_search_efficiency.py", "tests/test_sizes.py", "tests/test_repair.py",
    "tests/test_gpu_check.py", "tests/test_versus_pool.py",  # 4 s and under
    "tests/gpu/test_knobs_gpu.py", "tests/gpu/test_cuda.py", "tests/gpu/test_gpu_workers.py",  # skipped on a CPU
]


def pytest_configure(config):
    # xdist's controller hands out the files in the order collected (below), not by test count
    # (--no-loadscope-reorder, xdist 3.8), unless the command line asks for one or the other
    asked = " ".join([*config.invocation_params.args, os.environ.get("PYTEST_ADDOPTS", "")])
    if hasattr(config.option, "loadscopereorder") and "loadscope-reorder" not in asked:
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], -1))  # stable: a file's tests keep their order

    # Every test under tests/gpu is a GPU test: marked, and skipped cleanly where CUDA is absent.
    import torch

    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture
def cpp_compiler():
    """For a test that compiles and calls on the CPU: skipped, with autotune's own reason, where
    inductor finds no C++ compiler (a slim image); there autotune drops compile from the space."""
    from autotune.knobs.compile import _no_cpp_compiler

    why = _no_cpp_compiler()
    if why:
        pytest.skip(why)


@pytest.fixture
def cuda_host_compiler(monkeypatch):
    """For a test of a CUDA target (a value: nothing runs on CUDA here): the GPU machine it stands
    for has the C compiler Triton needs, whether or not this host does."""
    from autotune.knobs import compile

    monkeypatch.setattr(compile, "_no_c_compiler_for_triton", lambda: None)


@pytest.fixture
def cli(tmp_path):
    """Run the CLI in a fresh folder (the default storage and profile land there)."""
    return lambda *args, **kw: run_cli(*args, cwd=kw.pop("cwd", tmp_path), **kw)


@pytest.fixture(autouse=True)
def a_serving_process_per_test():
    """Each test stands for a process of its own: what an earlier test's configuration set of a
    process-wide setting is forgotten (else applying another would warn, as in a serving process
    that serves two profiles), and so is the state the process had before (else a False choice
    would put back what an earlier test left, not what this one found). Read only where the knobs
    were imported: no import here."""
    yield
    base = sys.modules.get("autotune.knobs.base")
    if base is not None:
        base.ProcessSettings.forget()


@pytest.fixture
def inductor_config():
    """The inductor flags are process-global: put them back after a test sets them."""
    from torch._inductor import config

    saved = config.save_config()
    yield config
    config.load_config(saved)
