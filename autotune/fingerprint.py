"""The machine and software a profile was measured on.

GPU facts come from NVML, not torch: the tuning parent must not create a CUDA context of its own
(it would hold device memory while trials are measured against the budget).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
from importlib import metadata

import psutil

from .sizes import format_size

PACKAGES = ("torch", "diffusers", "transformers", "accelerate", "torchao", "xformers", "optuna")
# The libraries whose versions change what a configuration measures (a kernel, a knob's code)
SOFTWARE_KEYS = ("torch", "diffusers", "transformers", "torchao", "xformers")


def software() -> dict:
    from . import __version__

    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    # the code that runs, installed or not (a checkout on PYTHONPATH has no package metadata)
    out["autotune"] = __version__
    return out


def visible_gpus() -> list[str] | None:
    """The GPUs CUDA_VISIBLE_DEVICES names, in the order torch numbers them (cuda:0 first), or
    None where it is not set (every GPU is visible, torch's numbering is the driver's)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return [v.strip() for v in visible.split(",") if v.strip()]


def device_index(device: str) -> int:
    """The GPU index torch's `device` names: cuda:N, or 0 for cuda."""
    return int(device.split(":")[1]) if ":" in device else 0


def _nvml_id(device: str) -> int | str:
    """NVML's name for torch's `device`: its index among every GPU of the machine, or the UUID
    that CUDA_VISIBLE_DEVICES names it by (GPU-..., MIG-...). Trials run with CUDA_DEVICE_ORDER=
    PCI_BUS_ID, NVML's order; a serving process that has started CUDA in CUDA's default order
    (fastest first) is asked for the GPU's UUID instead, which names one GPU for both."""
    index = device_index(device)
    torch = sys.modules.get("torch")  # never imported, nor CUDA started, here: the tuning parent forks
    if (os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and torch is not None
            and torch.cuda.is_initialized()):
        return str(torch.cuda.get_device_properties(index).uuid)
    ids = visible_gpus()
    if ids and index < len(ids):
        return int(ids[index]) if ids[index].isdigit() else ids[index]
    return index


def nvml_handle(pynvml, uuid: str):
    """NVML's handle of the GPU with this UUID, written as torch prints it (bare), as NVML and
    CUDA_VISIBLE_DEVICES write it (GPU-..., MIG-... for a MIG instance), or as a prefix of that,
    which CUDA_VISIBLE_DEVICES takes (GPU-8932f937)."""
    names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]
    for name in names:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)
        except pynvml.NVMLError:
            pass
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        if _text(pynvml.nvmlDeviceGetUUID(handle)).startswith(tuple(names)):
            return handle
    from .errors import AutotuneError

    raise AutotuneError(f"the NVIDIA driver lists no GPU {uuid}")


def is_device_name(name) -> bool:
    """cpu, cuda or cuda:N: the devices autotune measures on."""
    return isinstance(name, str) and re.fullmatch(r"cpu|cuda(:\d+)?", name) is not None


NO_CUDA = "no CUDA GPU is usable here"


def device_problem(name) -> str | None:
    """Why `name` cannot be measured or served on here (not cpu, cuda or cuda:N; no CUDA GPU
    usable; no GPU of that number), or None where it can. The caller names whose device it was."""
    if not is_device_name(name):
        return "expected cpu, cuda or cuda:N"
    if name.startswith("cuda") and not cuda_available():
        return NO_CUDA
    if name.startswith("cuda:") and int(name[5:]) >= cuda_device_count():
        return f"no such GPU (GPUs usable here: {cuda_device_count()})"
    return None


def cuda_available() -> bool:
    """Whether a CUDA GPU is usable, asked of NVML and torch's build without a CUDA context."""
    import torch

    if torch.version.cuda is None:
        return False
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:  # no driver, no library: no GPU here
        return False


def cuda_device_count() -> int:
    """GPUs this process may use: those CUDA_VISIBLE_DEVICES names, or every one the driver sees
    (NVML: no CUDA context in the tuning parent); 0 without a driver."""
    if not cuda_available():
        return 0
    import pynvml

    count = int(pynvml.nvmlDeviceGetCount())
    ids = visible_gpus()
    return count if ids is None else min(count, len(ids))


def machine(device: str) -> dict:
    if device.startswith("cuda"):
        import pynvml

        pynvml.nvmlInit()
        gpu = _nvml_id(device)
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu) if isinstance(gpu, int) else nvml_handle(pynvml, gpu)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        return {
            "device": device,
            "name": name.decode() if isinstance(name, bytes) else name,
            "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
            "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
            "capability": f"{major}.{minor}",
            "cpu_count": os.cpu_count(),
        }
    return {
        "device": "cpu",
        "name": cpu_name(),
        "memory_bytes": int(psutil.virtual_memory().total),
        "cpu_count": os.cpu_count(),
    }


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity (a container's cpuset, a `taskset`),
    not the whole machine's count (os.process_cpu_count, from Python 3.13)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def capability(device: str) -> tuple[int, int] | None:
    if not device.startswith("cuda"):
        return None
    major, minor = machine(device)["capability"].split(".")
    return int(major), int(minor)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@functools.cache
def _first_core() -> dict[str, str]:
    """The fields /proc/cpuinfo lists for the first core (Linux lists every core alike), read
    once per process; empty where there is no such file (another OS)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first core's block ends
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this machine's CPU ("flags" on x86, "Features" on Arm); empty
    where none are listed, so that nothing is decided from them."""
    core = _first_core()
    return frozenset((core.get("flags") or core.get("Features") or "").split())


def cpu_name() -> str:
    return _first_core().get("model name") or platform.processor() or platform.machine()


def _shown(key: str, value, other) -> str:
    """A fingerprint value as a person reads it: a size (a key ending in _bytes) in GiB, not
    25276510208; with its bytes too where the other side's rounds to the same text."""
    if key.endswith("_bytes") and isinstance(value, int) and not isinstance(value, bool):
        text = format_size(value)
        return f"{text} ({value} bytes)" if isinstance(other, int) and format_size(other) == text else text
    return repr(value)


def differences(recorded: dict, current: dict, keys, absent: str = "unknown") -> list[str]:
    """Human lines for each key whose value differs between two fingerprints; a value one side
    lacks (a GPU's name on a machine without that GPU, a library not installed) is `absent`
    there, not None."""
    lines = []
    for key in keys:
        was, now = recorded.get(key), current.get(key)
        if was != now:
            was_text = f"profiled on {_shown(key, was, now)}" if was is not None else f"{absent} when profiled"
            now_text = f"here {_shown(key, now, was)}" if now is not None else f"{absent} here"
            lines.append(f"{key}: {was_text}, {now_text}")
    return lines
