"""Measuring one pipeline: latency of full calls and peak memory as the budget sees it.

Memory, three figures side by side:
- on a GPU, the budgeted figure is what the driver reports for this process (NVML, polled in a
  thread for the whole trial, CUDA context included); torch's allocator peaks stand beside it;
- on a CPU, the budgeted figure is the process's peak resident memory (the kernel's VmHWM).
"""

from __future__ import annotations

import os
import resource
import statistics
import threading
import time
from dataclasses import dataclass


def host_peak_rss_bytes() -> int:
    """This process's peak resident memory. The kernel keeps it for us: nothing to poll.

    VmHWM, the high-water mark of the process's own memory image, not getrusage's ru_maxrss: after
    exec, ru_maxrss keeps the peak of the image it replaced, and Python starts children with vfork,
    so a spawned trial would report its parent's peak whenever that is higher (seen: 2.8 GB for a
    trial peaking at 0.5 GB, started from a test process that had built pipelines)."""
    peak = _proc_status_bytes("self", "VmHWM:")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes(pid: int | str = "self") -> int | None:
    """A process's resident memory now (VmRSS), or None where /proc cannot tell."""
    return _proc_status_bytes(pid, "VmRSS:")


def _proc_status_bytes(pid: int | str, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def fork_unmapped_bytes() -> int:
    """What a process forked from the preloaded server holds less than a fresh process would.

    Called first thing in the child. Linux does not copy page tables of file-backed read-only
    mappings on fork: the library pages the server touched while importing are resident there but
    not counted in the child until it touches them again, while a fresh serving process counts
    every one. Measured on tiny-sd15: a forked trial peaked 73-81 MiB below the same config in a
    fresh interpreter. Adding the server's resident memory less the child's own at start makes the
    child's figure an upper bound of the fresh process's: pages the trial touches again are then
    counted twice (18-26 MiB there, 4-5% of a tiny pipeline's peak; little next to real weights)."""
    server, own = resident_bytes(os.getppid()), resident_bytes()
    if server is None or own is None:
        return 0
    return max(0, server - own)


class NvmlPeak:
    """Polls NVML for the device memory used by this process, keeping the peak.

    Per-process figures come from nvmlDeviceGetComputeRunningProcesses. A process is listed only
    once it holds a CUDA context, and inside a container the driver may list processes under
    another PID namespace and never show it. So both figures are kept: the process's own, and the
    device's used memory minus what was used when tracking started. The process's own is reported
    when it was ever listed ("nvml-process"); else the device's ("nvml-device", which counts other
    processes on the GPU too). Where the driver refuses the per-process listing (vGPU, MIG), the
    device's figure is kept; where it refuses both, polling stops (`failure` says why) and the
    tracker falls back on torch's figures.
    """

    def __init__(self, torch_uuid: str, interval_s: float = 0.005):
        import pynvml  # nvidia-ml-py

        from .fingerprint import nvml_handle

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = nvml_handle(pynvml, torch_uuid)
        self.failure: str | None = None
        self._per_process = True
        self._start_used = pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
        self.interval_s = interval_s
        self._pid = os.getpid()
        self.process_peak: int | None = None  # None: this process was never listed
        self.device_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-peak", daemon=True)
        self._thread.start()

    @property
    def source(self) -> str:
        return "nvml-device" if self.process_peak is None else "nvml-process"

    @property
    def peak(self) -> int:
        return self.device_peak if self.process_peak is None else self.process_peak

    def current(self) -> int:
        """What the source of `peak` reports now (raises where NVML stopped answering)."""
        if self.failure:
            raise RuntimeError(self.failure)
        own = self._own_usage() if self._per_process else None
        if own is not None or self.process_peak is not None:
            return own or 0
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used - self._start_used

    def _own_usage(self) -> int | None:
        for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
            if proc.pid == self._pid and proc.usedGpuMemory is not None:
                return proc.usedGpuMemory
        return None

    def _run(self):
        # An exception here would end the thread unseen and leave the peak at what it was: any is
        # caught, not only NVMLError (pynvml raises NVMLLibraryMismatchError, a plain Exception,
        # where the driver lacks the listing's versioned function).
        listed_before = False  # the listing answered once: a later error is a failure, not "not supported"
        while not self._stop.is_set():
            own = None
            if self._per_process:
                try:
                    own = self._own_usage()
                    listed_before = True
                except Exception as exc:
                    if listed_before:
                        self.failure = f"NVML stopped answering: {exc}"
                        return
                    self._per_process = False  # not supported on this GPU: the device's figure, then
            if own is not None:
                self.process_peak = max(self.process_peak or 0, own)
            elif self.process_peak is None:  # the device's figure counts only until the process is listed
                try:
                    used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used - self._start_used
                except Exception as exc:
                    self.failure = f"NVML stopped answering: {exc}"
                    return
                self.device_peak = max(self.device_peak, used)
            self._stop.wait(self.interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class MemoryReport:
    peak_bytes: int  # the figure the budget is checked against
    source: str  # "nvml-process", "nvml-device", "torch-reserved+outside", "torch-reserved" or "rss"
    host_peak_rss_bytes: int
    torch_peak_allocated_bytes: int | None = None
    torch_peak_reserved_bytes: int | None = None
    nvml_sampled_peak_bytes: int | None = None  # the highest NVML reading the poller took
    outside_torch_bytes: int | None = None  # the driver's figure less torch's cache, at the end
    nvml_failure: str | None = None  # why NVML polling stopped before the end, if it did
    per_gpu_peak_bytes: dict[str, int] | None = None  # each GPU's, when a pipeline spans several


def device_peak(sampled: int, reserved_peak: int | None, outside_torch: int | None) -> tuple[int, bool]:
    """The device peak to budget against, and whether torch's figure set it.

    NVML is polled, so a peak shorter than the polling interval can fall between two readings:
    accelerate's sequential offload empties torch's cache after each weight it moves, so the
    cache grows and shrinks around every layer. torch's allocator counts its own peak exactly;
    the driver holds `outside_torch` more than torch's cache (the CUDA context, kernel modules),
    which only grows while a process runs, so reading it at the end bounds it from above.
    Without that reading (NVML or the CUDA context failed at the end), torch's reserved peak
    still bounds the driver's figure from below."""
    if reserved_peak is None:
        return sampled, False
    if outside_torch is None:
        return (reserved_peak, True) if reserved_peak > sampled else (sampled, False)
    exact = reserved_peak + outside_torch
    return (exact, True) if exact > sampled else (sampled, False)


class MemoryTracker:
    """Tracks peak memory on `device` from construction to `report()`.

    `gpus`: every CUDA device a pipeline placed over several GPUs uses, tracked in place of
    `device` alone; the figure budgeted is the highest of their peaks (a budget holds per GPU).
    `host_extra_bytes` is added to the host peak: a forked trial's pages the kernel does not
    count but a fresh process would (fork_unmapped_bytes)."""

    def __init__(self, device: str, host_extra_bytes: int = 0, gpus: tuple[str, ...] = ()):
        self.device = device
        self.host_extra_bytes = host_extra_bytes
        self._nvml: dict[str, NvmlPeak] = {}
        if device.startswith("cuda"):
            import torch

            # Initialized first: given "cuda:N", reset_peak_memory_stats does not initialize CUDA
            # itself (only a bare "cuda" does, by asking for the current device) and raises.
            torch.cuda.init()
            for gpu in gpus or (device,):
                torch.cuda.reset_peak_memory_stats(gpu)
                # Name the same GPU in torch and NVML by its UUID, whatever the device ordering.
                self._nvml[gpu] = NvmlPeak(str(torch.cuda.get_device_properties(gpu).uuid))

    def report(self) -> MemoryReport:
        rss = host_peak_rss_bytes() + self.host_extra_bytes
        if not self._nvml:
            return MemoryReport(peak_bytes=rss, source="rss", host_peak_rss_bytes=rss)
        reports = {gpu: self._gpu_report(gpu, poller, rss) for gpu, poller in self._nvml.items()}
        highest = max(reports.values(), key=lambda r: r.peak_bytes)
        if len(reports) > 1:
            highest.per_gpu_peak_bytes = {gpu: r.peak_bytes for gpu, r in reports.items()}
        return highest

    @staticmethod
    def _gpu_report(gpu: str, poller: NvmlPeak, rss: int) -> MemoryReport:
        import torch

        allocated = reserved = outside = None
        try:
            torch.cuda.synchronize(gpu)
            time.sleep(2 * poller.interval_s)  # let the poller see the final state
            allocated = torch.cuda.max_memory_allocated(gpu)
            reserved = torch.cuda.max_memory_reserved(gpu)
            outside = max(0, poller.current() - torch.cuda.memory_reserved(gpu))
        except Exception:  # noqa: BLE001 - a CUDA context broken by the trial's own error (an
            pass  # illegal address, a device-side assert): what NVML saw is still the result
        sampled = poller.stop()
        peak, from_torch = device_peak(sampled, reserved, outside)
        return MemoryReport(
            peak_bytes=peak,
            source=("torch-reserved" if outside is None else "torch-reserved+outside") if from_torch
            else poller.source,
            host_peak_rss_bytes=rss,
            torch_peak_allocated_bytes=allocated,
            torch_peak_reserved_bytes=reserved,
            nvml_sampled_peak_bytes=sampled,
            outside_torch_bytes=outside,
            nvml_failure=poller.failure,
        )


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def timed_call(fn, device: str, clock=time.perf_counter):
    """Run fn() once; return (seconds, result), with the device synchronized on both sides.
    `clock`: what it is timed by, in seconds (a test's clock moves by what its scripted calls say,
    so that a loaded machine cannot change what the timing loops decide)."""
    synchronize(device)
    start = clock()
    result = fn()
    synchronize(device)
    return clock() - start, result


STEADY = 0.10  # two calls in a row within this of each other: warmed up


def too_slow(times: list[float], bound: float | None, steady: float = STEADY) -> bool:
    """The last two calls both took over `bound`, and both were warm: not the first (the cold
    one), unless the first two agree within `steady` (nothing was compiled or recorded)."""
    if bound is None or len(times) < 2 or min(times[-2:]) <= bound:
        return False
    return len(times) >= 3 or abs(times[1] - times[0]) <= steady * times[0]


# The first warm call this many times over the cut's bound (`far_slower_at_once`): on a CPU where
# nothing is compiled in it, the first call is already warm (one-time allocations and kernel
# choices cost a fraction of it); where it compiles, or on a GPU, the second is (a CUDA graph
# recorded there excepted: the caller passes no first warm call for those modes;
# worker._first_warm_call). One warm call says what two
# would. On this project's 2-core CPU, float16 with int8 weight-only and one-slice attention took
# 394 s a call against the fastest trial's 1.3 s, and its second warm call cost another 6.5 minutes
# for the same verdict (a compiled float16 config of the same run reached the trial timeout, 20
# minutes, with no figure: how its calls went is not known, only that they were slow).
FAR_SLOWER = 3.0


def far_slower_at_once(times: list[float], bound: float | None, first_warm_call: int | None) -> bool:
    """The calls so far end with the first warm one (index `first_warm_call`: 0 on a CPU where
    nothing is compiled in the first call, 1 where it is or on a GPU, None where no single call
    says it: worker._first_warm_call),
    and it took over FAR_SLOWER times `bound`: too slow, without a second warm call. (`--warmup N`
    asks for N calls at least: over 1, an uncompiled trial never stops at its first call; a compiled
    one still may at its second.)"""
    return (first_warm_call is not None and bound is not None and len(times) == first_warm_call + 1
            and times[-1] > FAR_SLOWER * bound)


def cut_short(warm_times: list[float], bound: float | None, first_warm_call: int | None) -> dict | None:
    """The figure of a trial whose warm-up ended it (`too_slow`, `far_slower_at_once`), or None
    where it goes on to timed calls: its last two warm calls (or its first warm one, far over the
    bound) summarized as timed calls are, with `cut_short` saying why."""
    if too_slow(warm_times, bound):
        return {**summarize(warm_times[-2:]), "cut_above_s": bound,
                "cut_short": f"its warm calls took {warm_times[-2]:.3f} and {warm_times[-1]:.3f} s, over {bound:.3f} s"}
    if far_slower_at_once(warm_times, bound, first_warm_call):
        return {**summarize(warm_times[-1:]), "cut_above_s": bound,
                "cut_short": f"its first warm call took {warm_times[-1]:.3f} s, over {FAR_SLOWER:g} x {bound:.3f} s"}
    return None


# How a trial is timed unless told otherwise: the one place these defaults are written (the CLI's
# options, TuneRequest, worker.trial_request and the timing loops below read them).
WARMUP_CALLS = 1  # untimed calls at least
MAX_WARMUP_CALLS = 5  # untimed calls at most, while two in a row disagree by over STEADY
TIMED_CALLS = 3  # timed calls at least, and the window whose spread must be under SPREAD_LIMIT
MAX_TIMED_CALLS = 10  # timed calls at most
SPREAD_LIMIT = 0.05  # (max - min) / median of the last TIMED_CALLS calls
TRIAL_TIMEOUT_S = 1200.0  # a trial (or a replay) is killed after this long


def timed_calls_cap(max_calls: int | None, repeats: int) -> int:
    """Timed calls at most: `max_calls` (MAX_TIMED_CALLS when not given), never fewer than the
    `repeats` whose spread decides when a trial stops."""
    return max(max_calls or MAX_TIMED_CALLS, repeats)


def warm_up(call, device: str, min_calls: int = WARMUP_CALLS, max_calls: int = MAX_WARMUP_CALLS, steady: float = STEADY,
            slow_above_s: float | None = None, first_warm_call: int | None = None, clock=time.perf_counter):
    """Call until two calls in a row take times within `steady` of each other (compilation,
    cuDNN autotuning and allocator growth happen in the first calls), at least `min_calls` and at
    most `max_calls` times, or until two warm calls in a row take over `slow_above_s` (too slow
    to be worth a steady figure; `too_slow`), or the first warm call (index `first_warm_call`) far
    over it (`far_slower_at_once`). Returns (seconds of each call, output of the first call);
    `clock` times them (timed_call)."""
    times: list[float] = []
    first_output = None
    while len(times) < max(1, max_calls):
        seconds, output = timed_call(call, device, clock)
        if not times:
            first_output = output
        times.append(seconds)
        if len(times) >= max(2, min_calls) and abs(times[-1] - times[-2]) <= steady * times[-2]:
            break
        if len(times) >= min_calls and (too_slow(times, slow_above_s, steady)
                                        or far_slower_at_once(times, slow_above_s, first_warm_call)):
            break
    return times, first_output


# Other processes taking this many of a CPU trial's cores, on average, while it was timed: its
# timing is not a quiet machine's. Measured on a 2-core VM (2 threads): 0.002 cores quiet; 0.64
# beside one process spinning on a core (the trial's matmuls then shared the two cores three ways).
BUSY_CPU_CORES = 0.25


class OtherCpuUse:
    """How many CPU cores other processes kept busy, on average, from construction to `cores()`,
    among the CPUs this process may run on (its affinity: a container's or a `taskset`'s, not
    the whole host's): their busy time (the kernel's, by psutil, hypervisor steal included) less
    this process's own (every thread of it, and the processes it started: own_cpu_seconds). A
    trial timed beside a busy neighbour runs slower and noisier than it will serve on a quiet
    machine, and nothing in its own figures shows it."""

    def __init__(self):
        self.allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self._start = self._read()

    def _read(self) -> tuple[float, float, float]:
        import psutil

        per_cpu = psutil.cpu_times(percpu=True)
        cpus = [per_cpu[i] for i in self.allowed if i < len(per_cpu)] if self.allowed else per_cpu
        busy = sum(t.user + t.nice + t.system + sum(getattr(t, f, 0.0) for f in ("irq", "softirq", "steal"))
                   for t in cpus)
        return time.perf_counter(), busy, own_cpu_seconds()

    def cores(self) -> float:
        (wall0, busy0, own0), (wall1, busy1, own1) = self._start, self._read()
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(wall1 - wall0, 1e-9)

    def taken(self) -> float:
        """Of `cores()`, what this process's torch threads had to share: beyond the allowed cores
        they leave free (on a large host, work on the other cores is no neighbour of theirs).
        Rounded, as a result records it (`cores_taken_by_others`)."""
        import torch

        spare = max(0, len(self.allowed) - torch.get_num_threads()) if self.allowed else 0
        return round(max(0.0, self.cores() - spare), 2)


def own_cpu_seconds() -> float:
    """CPU time of this process and every process it started: its live descendants' (inductor's
    compile workers, a g++ they run), and those ended and waited for. A compiling trial's
    children are its own work, not a neighbour's: counted as others', a compiled trial cut short
    in its warm-up read as disturbed."""
    import psutil

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # ended meanwhile: in RUSAGE_CHILDREN once waited for
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def busy_cores(measured: dict) -> float | None:
    """The cores other processes took from a measurement (a trial's result, a confirmation, the
    reference calls) when that many tell on its timing (BUSY_CPU_CORES); else None."""
    taken = measured.get("cores_taken_by_others") or 0
    return taken if taken >= BUSY_CPU_CORES else None


def timed_calls(
    call,
    device: str,
    min_calls: int = TIMED_CALLS,
    max_calls: int = MAX_TIMED_CALLS,
    spread_limit: float = SPREAD_LIMIT,
    clock=time.perf_counter,
) -> dict:
    """Timed calls until the median is stable: the last `min_calls` calls lie within
    `spread_limit` of their median, or `max_calls` is reached. On a CPU, beside them, how many of
    the trial's cores other processes took meanwhile (`cores_taken_by_others`; on a GPU, host
    neighbours matter less, and --gpus workers time side by side by design). `clock`: timed_call's."""
    others = OtherCpuUse() if device == "cpu" else None
    latencies: list[float] = []
    window = max(1, min_calls)
    while True:
        latencies.append(timed_call(call, device, clock)[0])
        if len(latencies) < window:
            continue
        recent = summarize(latencies[-window:])
        stable = recent["spread"] <= spread_limit
        if stable or len(latencies) >= max_calls:
            break
    result = summarize(latencies)
    result["window_spread"] = recent["spread"]
    result["stable"] = stable
    if others:
        result["cores_taken_by_others"] = others.taken()
    return result


def summarize(latencies: list[float]) -> dict:
    """Median, 90th percentile and relative spread ((max - min) / median) of call times."""
    ordered = sorted(latencies)
    median = statistics.median(ordered)
    p90 = statistics.quantiles(ordered, n=10, method="inclusive")[-1] if len(ordered) > 1 else ordered[0]
    return {
        "latency_s": median,
        "p90_s": p90,
        "latencies_s": latencies,
        "calls": len(latencies),
        "spread": (ordered[-1] - ordered[0]) / median if median > 0 else 0.0,
    }
