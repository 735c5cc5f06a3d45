"""The child side of a trial: build, configure, warm up, measure; report JSON to the parent.

Run as `python -m autotune.worker REQUEST.json RESULT.json`. Everything that can go wrong inside
the pipeline is caught here and reported as a classified result; what kills the process (a signal,
the kernel's OOM killer, a timeout) is classified by the parent (runner.py) instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from . import measure
from .errors import AutotuneError

_T0 = time.perf_counter()

# Trial statuses. "ok" is the only one with a latency; the rest are results too, not crashes of
# the study: the sampler learns from them as infeasible points.
OK = "ok"
OUT_OF_MEMORY = "out_of_memory"
UNSUPPORTED = "unsupported"
COMPILE_ERROR = "compile_error"
NAN_OUTPUT = "nan_output"
BLANK_OUTPUT = "blank_output"  # every pixel the same (the black image of an fp16 overflow)
ERROR = "error"
TIMEOUT = "timeout"  # set by the parent
CRASHED = "crashed"  # set by the parent
FAILED_STATUSES = (OUT_OF_MEMORY, UNSUPPORTED, COMPILE_ERROR, NAN_OUTPUT, BLANK_OUTPUT, ERROR, TIMEOUT, CRASHED)


def trial_request(
    spec, config: dict, workload, device: str, *, capability=None, warmup: int = measure.WARMUP_CALLS,
    max_warmup: int = measure.MAX_WARMUP_CALLS, repeats: int = measure.TIMED_CALLS,
    max_calls: int = measure.MAX_TIMED_CALLS, spread_limit: float = measure.SPREAD_LIMIT, cut_above_s: float | None = None,
    threads: int | None = None, compile_cache_dir=None, output_path=None, profile=None, **marks,
) -> dict:
    """What the child process of a trial is asked to do (`run` reads it; it travels as JSON): the
    one place its keys and defaults are written. `spec` is a models.ModelSpec, `workload` a
    workload.Workload; `output_path` keeps the first image for the quality guard, `profile` makes
    the child load that profile as production does (`autotune verify`); `cut_above_s`: two warm
    calls in a row slower than this end the warm-up and stand for the timed calls (the config
    cannot win; see study.CUT_SLOWER_THAN); `marks` ride along unread (a confirmation's round)."""
    return {
        "model": spec.to_dict(),
        "config": dict(config),
        "workload": workload.to_dict(),
        "device": device,
        "capability": list(capability) if capability else None,
        "warmup": warmup,
        "max_warmup": max(max_warmup, warmup),
        "repeats": repeats,
        "max_calls": measure.timed_calls_cap(max_calls, repeats),
        "spread_limit": spread_limit,
        "cut_above_s": cut_above_s,
        "threads": threads,
        "compile_cache_dir": str(compile_cache_dir) if compile_cache_dir else None,
        "output_path": str(Path(output_path).resolve()) if output_path else None,
        "profile": str(Path(profile).resolve()) if profile else None,
        **marks,
    }


def _host_memory_ran_out(exc: BaseException) -> bool:
    # Python's MemoryError; torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory"),
    # ENOMEM from the system ("Cannot allocate memory")
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or "can't allocate memory" in text or "cannot allocate memory" in text


def _asked_bytes(exc: BaseException) -> int:
    """What the allocation that failed asked for, where the error says (torch's CPU allocator:
    "you tried to allocate N bytes"); else 0."""
    asked = re.search(r"tried to allocate (\d+) bytes", str(exc))
    return int(asked.group(1)) if asked else 0


OUT_OF_MEMORY_ON = "out_of_memory_on"  # "host" in a result: see ran_out_of_host_memory
# True in a trial's result whose second measurement (for the load beside its first) an interrupt
# stopped: the first stands (study._measure_trial), and its line says so (console)
SECOND_TRIAL_STOPPED = "second_trial_stopped"
# In a result stopped by a host allocation that failed inside the trial (MemoryError, torch's CPU
# allocator): the bytes it asked for (0: not said). On a CPU the runner judges it as it judges its
# own host-memory stop: within what the trial may hold, the machine's; past it, the budget's.
HOST_ALLOCATION_FAILED = "host_allocation_failed"
# True in a CPU trial's result stopped because the machine's memory ran short while the trial held
# less than its budget (runner.run_trial): other processes took the memory
HELD_WITHIN_BUDGET = "held_within_budget"


def machine_was_short(result: dict) -> bool:
    """Stopped because other processes took the machine's memory (HELD_WITHIN_BUDGET): a result
    that says nothing of the config, where a GPU's host running short may be its own doing."""
    return bool(result.get(HELD_WITHIN_BUDGET))


def host_memory_mark(device: str, held: int = 0, may_hold_bytes: int | None = None) -> dict:
    """What an out_of_memory result adds when host memory ran short (runner's host reserve,
    MemoryError, torch's CPU allocator). On a GPU target, where the budget is the GPU's: marked
    the host's. On a CPU, where the budget is host memory and the caller knows what a trial may
    hold and still fit (`may_hold_bytes`, the budget less its margin): a trial that `held` no
    more is marked the machine's (others took the memory); one that held more cannot fit, and
    records that as its peak. Else nothing: the budget's verdict."""
    if device.startswith("cuda"):
        return {OUT_OF_MEMORY_ON: "host"}
    if may_hold_bytes is None:
        return {}
    if held <= may_hold_bytes:
        return {OUT_OF_MEMORY_ON: "host", HELD_WITHIN_BUDGET: True}
    return {"peak_memory_bytes": held}


def ran_out_of_host_memory(result: dict) -> bool:
    """Host memory ran short (host_memory_mark): under a GPU budget, or on a CPU while the trial
    held less than its budget. This machine's limit, which says nothing of what the config needs
    within the budget."""
    return result.get(OUT_OF_MEMORY_ON) == "host"


def ran_out_of_budgeted_memory(result: dict) -> bool:
    """Stopped for lack of the memory the budget is on: the GPU's, or host memory on a CPU (beyond
    the budget, or where the runner could not tell)."""
    return result.get("status") == OUT_OF_MEMORY and not ran_out_of_host_memory(result)


def classify(exc: BaseException) -> str:
    import torch

    from .errors import ProfileError

    if isinstance(exc, ProfileError) and exc.__cause__ is not None:  # verify's load_pipeline said it in one line
        return classify(exc.__cause__)
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or _host_memory_ran_out(exc):
        return OUT_OF_MEMORY
    if "alloc_failed" in text:  # cuBLAS/cuDNN handles and workspaces (CUBLAS_STATUS_ALLOC_FAILED)
        return OUT_OF_MEMORY
    module = type(exc).__module__ or ""
    if module.startswith(("torch._dynamo", "torch._inductor")) or "inductor" in text:
        return COMPILE_ERROR
    # "not_supported": cuDNN's CUDNN_STATUS_NOT_SUPPORTED (a kernel for these shapes or dtypes);
    # SDPA held to kernels that take none of these inputs: "no available kernel" on CUDA, "no
    # viable backend" on the CPU; the cuDNN attention kernel's frontend finding no plan for these
    # shapes or this GPU (pytorch#140930, diffusers#9704)
    if isinstance(exc, NotImplementedError) or any(s in text for s in ("not implemented for", "not supported",
                                                                       "not_supported", "no available kernel",
                                                                       "no viable backend",
                                                                       "no execution plans support the graph")):
        return UNSUPPORTED
    return ERROR


def placed_over(config: dict, device: str) -> tuple[str, ...]:
    """The GPUs a config's pipeline uses, when more than `device`: every visible one when its
    components are spread over them (balanced placement); none otherwise."""
    if config.get("placement") != "balanced" or not device.startswith("cuda"):
        return ()
    from .fingerprint import cuda_device_count

    return tuple(f"cuda:{i}" for i in range(cuda_device_count()))


def _first_warm_call(config: dict, device: str) -> int | None:
    """Which call of a trial is its first warm one (measure.far_slower_at_once). On a CPU the first
    where nothing is compiled in it, else the second. On a GPU the second: a fresh process's first
    call loads its CUDA kernels (lazily, by default), makes cuBLAS and cuDNN handles and, with
    cuDNN attention or benchmark mode, autotunes (SDXL bfloat16 on an H100: 2.90 s, then
    0.81-0.99 s in its warm-up calls; a tiny model's first call, many times its warm ones, would
    be cut as far too slow); none to rely on where the calls after the first record a CUDA graph
    (how many they take is torch's business)."""
    from .knobs.compile import CUDA_GRAPH_MODES

    mode = config.get("compile", "none")
    if device.startswith("cuda"):
        return None if mode in CUDA_GRAPH_MODES else 1
    return 1 if mode != "none" else 0


def run(request: dict, started: float = _T0, host_extra_bytes: int = 0) -> dict:
    """Measure one trial as `request` (trial_request) asks; the result, failures classified."""
    import numpy as np
    import torch

    from . import fingerprint, quality
    from .knobs import Target, build_configured
    from .measure import MemoryTracker, OtherCpuUse, cut_short, timed_calls, warm_up
    from .models import ModelSpec
    from .workload import Workload

    threads = request["threads"]
    if threads:
        torch.set_num_threads(int(threads))
    if request["compile_cache_dir"]:
        # One inductor/FX-graph cache per study: a config compiled once compiles from cache when
        # it is confirmed (read when inductor first compiles, after this point). `verify` gives
        # none and uses inductor's default cache, as a serving process would.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = request["compile_cache_dir"]
    device = request["device"]
    spec = ModelSpec.from_dict(request["model"])
    workload = Workload.from_dict(request["workload"])
    config = request["config"]
    # the workload: knobs whose effect depends on it (MagCache's steps, VAE tiling's tile size)
    target = Target(device=device, family=spec.family, capability=request["capability"], workload=workload)
    # the libraries that measured it: a study resumed after an upgrade holds trials of both
    result: dict = {"status": OK, "threads": torch.get_num_threads(), "software": fingerprint.software()}

    try:
        tracker = MemoryTracker(device, host_extra_bytes=host_extra_bytes, gpus=placed_over(config, device))
    except Exception as exc:  # noqa: BLE001 - NVML cannot see this GPU (or no CUDA): nothing could be budgeted
        result.update(status=classify(exc), phase="load", traceback=traceback_for_result(traceback.format_exc()),
                      error=f"load: GPU memory cannot be tracked here: {type(exc).__name__}: {exc}".splitlines()[0][:500])
        return result
    if host_extra_bytes:
        result["host_fork_correction_bytes"] = host_extra_bytes
    phase = "load"
    try:
        # Importing the pipeline class is paid once per serving process, not per model load:
        # reported on its own, outside the cold start.
        import diffusers

        getattr(diffusers, spec.pipeline_class)
        result["import_s"] = time.perf_counter() - started
        t_start = time.perf_counter()
        if device.startswith("cuda:"):
            # cuda:N the current device, as a serving process on that GPU would have it: diffusers'
            # group-offload hooks wait on, and record their copies against, the current device's stream
            torch.cuda.set_device(device)
        if request["profile"]:
            # `autotune verify`: exactly what production runs.
            from .profile import load_profile

            pipe = load_profile(request["profile"], check_fingerprint=False).load_pipeline(device=device)
        else:
            pipe = build_configured(spec, config, target)
        pipe.set_progress_bar_config(disable=True)
        result["load_s"] = time.perf_counter() - t_start

        def call():
            return workload.call(pipe)

        phase = "warm-up"
        during_warm_up = OtherCpuUse() if device == "cpu" else None  # for a trial cut short there
        first_warm_call = _first_warm_call(config, device)
        warm_times, output = warm_up(call, device, min_calls=request["warmup"], max_calls=request["max_warmup"],
                                     slow_above_s=request["cut_above_s"], first_warm_call=first_warm_call)
        # The first call pays for compilation and autotuning: the cold start a server sees.
        result["first_call_s"] = warm_times[0]
        result["cold_start_s"] = result["load_s"] + warm_times[0]
        result["warmup_s"] = warm_times
        images = np.asarray(output.images)
        if request["output_path"]:
            # Kept for the quality guard, which the parent runs: comparing here would add its
            # imports to this process's peak memory.
            output_path = Path(request["output_path"])
            quality.save_output(images, output_path)
            result["output"] = str(output_path)
            result["image"] = str(quality.save_png(images, output_path.with_suffix(".png")))
        problem = quality.defect(images)
        if problem:
            result["status"] = problem
            result["error"] = "the output holds NaN or inf" if problem == NAN_OUTPUT else \
                "the output image is blank (one value everywhere)"
            return result
        phase = "timed calls"
        bound = request["cut_above_s"]
        cut = cut_short(warm_times, bound, first_warm_call)
        if cut:
            # Far slower than the study's best: a precise median would not change the pick, and
            # on a CPU such a config (float16 there) costs minutes per trial. Its warm calls, timed
            # like the timed calls, are its figure; memory was tracked through all, a whole call
            # at least.
            result.update(cut)
            if during_warm_up:
                result["cores_taken_by_others"] = during_warm_up.taken()
        else:
            result.update(
                timed_calls(
                    call,
                    device,
                    min_calls=request["repeats"],
                    max_calls=request["max_calls"],
                    spread_limit=request["spread_limit"],
                )
            )
        result["per_step_s"] = result["latency_s"] / workload.steps
    except Exception as exc:  # every failure is a result, classified
        result["status"] = classify(exc)
        if result["status"] == OUT_OF_MEMORY and _host_memory_ran_out(exc):
            result.update(host_memory_mark(device))
            result[HOST_ALLOCATION_FAILED] = _asked_bytes(exc)  # judged by the runner, which knows the budget
        # autotune's own errors are written for the user already; a library's needs its type
        said = str(exc) if isinstance(exc, AutotuneError) else f"{type(exc).__name__}: {exc}"
        result["error"] = f"{phase}: {said}".splitlines()[0][:500]
        result["phase"] = phase  # "load": the pipeline was never built
        result["traceback"] = traceback_for_result(traceback.format_exc())
        traceback.print_exc()  # whole, into the trial's log
    finally:
        memory = tracker.report()
        result.update(
            peak_memory_bytes=memory.peak_bytes,
            memory_source=memory.source,
            host_peak_rss_bytes=memory.host_peak_rss_bytes,
            torch_peak_allocated_bytes=memory.torch_peak_allocated_bytes,
            torch_peak_reserved_bytes=memory.torch_peak_reserved_bytes,
            nvml_sampled_peak_bytes=memory.nvml_sampled_peak_bytes,
            outside_torch_bytes=memory.outside_torch_bytes,
            worker_s=time.perf_counter() - started,
        )
        if memory.nvml_failure:
            result["nvml_failure"] = memory.nvml_failure
        if memory.per_gpu_peak_bytes:
            result["per_gpu_peak_bytes"] = memory.per_gpu_peak_bytes
    return result


def traceback_for_result(text: str, limit: int = 4000) -> str:
    """A traceback short enough for the study's storage: its end, after the lines that name an
    error (a C++ compile error from inductor is one line among thousands of compiler warnings,
    and the end alone held only warnings)."""
    if len(text) <= limit:
        return text
    errors = [line for line in text.splitlines() if re.search(r"\berror\b", line, re.IGNORECASE)][:20]
    head = "\n".join(errors)[: limit // 2]
    return f"{head}\n...\n{text[-(limit - len(head) - 5):]}" if head else text[-limit:]


def write_json(path: Path, data: dict, indent: int | None = None) -> None:
    """Write JSON atomically (a temporary file, then a rename): a reader, or a run stopped
    mid-write, sees the old file or the new one, never half of one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    os.replace(tmp, path)


def process_start(pid: int) -> int | None:
    """When a process started, in clock ticks since boot (/proc/PID/stat, field 22): with its pid,
    it names one process, and no clock step changes it (psutil's create_time adds the boot time
    read from the wall clock). None when that process is gone, or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold ")"
    except OSError:
        return None
    return None if fields[0] == b"Z" else int(fields[19])  # a zombie has exited already


def end_with_parent(parent: str | None, every_s: float = 1.0) -> None:
    """Kill this trial once the parent that runs it is gone.

    A trial leads a process group of its own (so that the parent's killpg reaches all of it), which
    also keeps it alive when the parent is SIGKILLed: left alone it would go on using the GPU and
    the cores while the resumed study measures other configs, and write into a trial folder the
    resumed run reuses. `parent` is "PID:START" (process_start), given on the command line by
    runner.run_trial, so that a request file run again by hand is not tied to a dead parent. The
    kernel's PR_SET_PDEATHSIG would do this for a spawned child, but a forked trial's parent is the
    fork server, not the study."""
    watch_parent(parent, kill_own_group, every_s)


def kill_own_group() -> None:
    """SIGKILL the process group this process leads (inductor's compile workers too), or only
    itself if it leads none."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def this_process() -> str:
    """This process as "PID:START", for a child's watch_parent."""
    return f"{os.getpid()}:{process_start(os.getpid())}"


def watch_parent(parent: str | None, when_gone, every_s: float = 1.0) -> None:
    """Call `when_gone()` from a daemon thread once the process `parent` ("PID:START", see
    this_process) has exited. Nothing when `parent` is None or there is no /proc to watch through."""
    if not parent or process_start(os.getpid()) is None:
        return
    pid, started = (int(x) for x in parent.split(":"))

    def watch():
        while process_start(pid) == started:
            time.sleep(every_s)
        when_gone()

    threading.Thread(target=watch, name="autotune-parent-watch", daemon=True).start()


def main(argv: list[str], started: float = _T0, host_extra_bytes: int = 0) -> int:
    """`python -m autotune.worker REQUEST.json RESULT.json [PARENT]` (PARENT: see end_with_parent)."""
    request_path, result_path = Path(argv[0]), Path(argv[1])
    end_with_parent(argv[2] if len(argv) > 2 else None)
    result = run(json.loads(request_path.read_text()), started, host_extra_bytes)
    write_json(result_path, result)
    return 0


def forked_main(request_path: str, result_path: str, log_path: str, parent: str | None = None) -> None:
    """Entry point of a trial forked from the fork server (runner.py, launcher "fork")."""
    started = time.perf_counter()
    from .measure import fork_unmapped_bytes

    unmapped = fork_unmapped_bytes()  # before this process touches anything
    os.setsid()  # lead a process group, as a spawned worker does, so killpg reaches everything
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import torch

    end_with_parent(parent)
    request = json.loads(Path(request_path).read_text())
    if request["device"].startswith("cuda") and torch.cuda._is_in_bad_fork():
        # A library initialised CUDA while the server preloaded it (preload.py keeps xFormers
        # from it; another may), and a CUDA context does not survive fork: say so, not "Cannot
        # re-initialize".
        result = {"status": UNSUPPORTED, "threads": request["threads"],
                  "error": "the fork launcher cannot run CUDA trials here: importing the libraries "
                           "initialised CUDA in the fork server; use --launcher spawn"}
    else:
        result = run(request, started, host_extra_bytes=unmapped)
    write_json(Path(result_path), result)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
