"""Imported once by the fork server that trials are forked from (runner.py, launcher "fork").

Everything heavy a trial needs is imported here, so that a trial starts in milliseconds instead of
paying torch + diffusers imports each time. Nothing here may initialize CUDA: a CUDA context does
not survive fork. PYTORCH_NVML_BASED_CUDA_CHECK makes torch.cuda.is_available() ask NVML instead
of the CUDA driver, for any library that asks at import time.
"""

import os
import threading

# What libraries print while importing goes to the server's log, not the user's terminal.
if os.environ.get("AUTOTUNE_FORKSERVER_LOG"):
    _log = os.open(os.environ["AUTOTUNE_FORKSERVER_LOG"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(_log, 1)
    os.dup2(_log, 2)

# multiprocessing's server notices that autotune has gone (Ctrl-C, SIGKILL) only once these
# imports are done: seconds, a minute on a loaded machine, of a busy core, with the resource
# tracker it shares kept alive and autotune's output pipes held open meanwhile. A watcher ends
# the server at once instead, and stops when the imports are done, so that no thread is left in
# the process every trial is forked from.
_parent = os.getppid()
_imported = threading.Event()


def _exit_if_orphaned() -> None:
    while not _imported.wait(0.2):
        if os.getppid() != _parent:
            os._exit(0)


_watch = threading.Thread(target=_exit_if_orphaned, name="autotune-preload-watch", daemon=True)
_watch.start()

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# diffusers imports xformers.ops where xFormers is installed, and that import asks whether its
# Triton split-K kernel may run: torch.cuda.get_device_capability(), which initializes CUDA
# (xformers/__init__.py, _is_triton_available, 0.0.35). Asked not to, it answers without the
# device. That kernel serves decoding-shaped attention only (multi-query keys, at most 32 queries:
# xformers/ops/fmha/dispatch.py), never a diffusion model's, so the trials measure what a
# production process runs.
os.environ.setdefault("XFORMERS_FORCE_DISABLE_TRITON", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import diffusers  # noqa: E402
import torch  # noqa: E402,F401

from . import knobs, measure, models, worker  # noqa: E402,F401
from .models import FAMILIES  # noqa: E402

# diffusers resolves its classes lazily: touch each family's pipeline class to import it now.
for _family in FAMILIES.values():
    getattr(diffusers, _family.pipeline_class)

# tqdm makes a multiprocessing lock, a named semaphore registered with the study's resource
# tracker, at its first bar. A trial killed with its group (timeout, Ctrl-C) never unregisters it,
# and the tracker then warns of a "leaked semaphore" on the user's terminal. A trial is one
# process drawing no bar across processes: a thread lock does.
from tqdm import tqdm  # noqa: E402

tqdm.set_lock(threading.RLock())

_imported.set()
_watch.join()
