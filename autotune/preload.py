"""Imported once by the fork server that trials are forked from (runner.py, launcher "fork").

Everything heavy a trial needs is imported here, so that a trial starts in milliseconds instead of
paying torch + diffusers imports each time. Nothing here may initialize CUDA: a CUDA context does
not survive fork. PYTORCH_NVML_BASED_CUDA_CHECK makes torch.cuda.is_available() ask NVML instead
of the CUDA driver, for any library that asks at import time.
"""

import os

# What libraries print while importing goes to the server's log, not the user's terminal.
if os.environ.get("AUTOTUNE_FORKSERVER_LOG"):
    _log = os.open(os.environ["AUTOTUNE_FORKSERVER_LOG"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(_log, 1)
    os.dup2(_log, 2)

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
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
import threading  # noqa: E402

from tqdm import tqdm  # noqa: E402

tqdm.set_lock(threading.RLock())
