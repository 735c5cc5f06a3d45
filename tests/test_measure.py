"""The timing loop: warm up until steady, then timed calls until the median is stable; the
host peak a process reports is its own."""

import os
import signal
import subprocess
import sys
import time
import types

import pytest

from autotune.measure import cut_short, far_slower_at_once, summarize, timed_call, timed_calls, too_slow, warm_up


def scripted(durations):
    """A call that takes the given durations in turn, then the last one forever, on a clock of its
    own (pass it as the timing loop's `clock`): what the loops decide depends on the durations
    alone, not on how late a real sleep wakes on a loaded machine (a 0.1 s sleep can pass 0.2 s)."""
    it = iter(durations)
    last = [durations[-1]]
    clock = types.SimpleNamespace(now=0.0)

    def call():
        last[0] = next(it, last[0])
        clock.now += last[0]
        return last[0]

    return call, lambda: clock.now


def test_the_timing_loops_time_real_calls_by_default():
    # a real sleep: it may overrun under load, never end early
    seconds, said = timed_call(lambda: time.sleep(0.02) or "done", "cpu")
    assert said == "done" and seconds >= 0.02
    times, first = warm_up(lambda: time.sleep(0.02) or "first", "cpu", max_calls=1)
    assert first == "first" and len(times) == 1 and times[0] >= 0.02
    assert timed_calls(lambda: time.sleep(0.02), "cpu", min_calls=1, max_calls=1)["latency_s"] >= 0.02


def test_warm_up_runs_until_two_calls_agree():
    # A slow first call (compilation), a second still warming, then steady.
    call, clock = scripted([0.8, 0.3, 0.1, 0.1])
    times, first = warm_up(call, "cpu", min_calls=1, max_calls=6, clock=clock)
    assert first == 0.8
    assert times == pytest.approx([0.8, 0.3, 0.1, 0.1])
    # within `steady` (10%) of each other: 0.1 then 0.105 agree, 0.1 then 0.115 do not
    call, clock = scripted([0.8, 0.1, 0.105, 0.3])
    assert len(warm_up(call, "cpu", max_calls=6, clock=clock)[0]) == 3
    call, clock = scripted([0.8, 0.1, 0.115, 0.115])
    assert len(warm_up(call, "cpu", max_calls=6, clock=clock)[0]) == 4


def test_warm_up_stops_at_its_cap():
    call, clock = scripted([0.01, 0.05, 0.01, 0.05, 0.01])
    times, _ = warm_up(call, "cpu", max_calls=3, clock=clock)
    assert len(times) == 3


def test_warm_up_ends_after_two_warm_calls_over_the_slow_bound():
    # unsteady (0.3, 0.5, 0.3, ...), but its second and third calls are both over the bound
    call, clock = scripted([0.8, 0.3, 0.5, 0.3, 0.5, 0.3])
    times, _ = warm_up(call, "cpu", max_calls=6, steady=0.1, slow_above_s=0.2, clock=clock)
    assert len(times) == 3
    assert too_slow(times, 0.2, steady=0.1)
    # one slow warm call (a CUDA graph recorded in the second call) is not enough
    call, clock = scripted([0.8, 0.3, 0.1, 0.1])
    times, _ = warm_up(call, "cpu", max_calls=6, steady=0.5, slow_above_s=0.2, clock=clock)
    assert len(times) == 4 and not too_slow(times, 0.2, steady=0.5)
    call, clock = scripted([0.8, 0.3, 0.1, 0.1])
    times, _ = warm_up(call, "cpu", max_calls=6, steady=0.5, slow_above_s=0.5, clock=clock)
    assert len(times) == 4  # under the bound: warmed up until steady


def test_the_first_warm_call_far_over_the_bound_ends_the_warm_up():
    # 0.8 s against a bound of 0.2 s: over 3x. Nothing compiled in it: the first call says it
    call, clock = scripted([0.8, 0.8, 0.8])
    times, _ = warm_up(call, "cpu", max_calls=3, steady=0.5, slow_above_s=0.2, first_warm_call=0, clock=clock)
    assert times == pytest.approx([0.8]) and far_slower_at_once(times, 0.2, 0)
    # a first call that compiles is cold: the second says it (1.6 s cold, 0.8 s warm: not steady)
    call, clock = scripted([1.6, 0.8, 0.8])
    times, _ = warm_up(call, "cpu", max_calls=3, steady=0.1, slow_above_s=0.2, first_warm_call=1, clock=clock)
    assert len(times) == 2 and far_slower_at_once(times, 0.2, 1) and not far_slower_at_once(times[:1], 0.2, 1)
    # no call to rely on (CUDA graphs recorded in the calls after the first): two warm calls
    call, clock = scripted([1.6, 0.8, 0.8])
    times, _ = warm_up(call, "cpu", max_calls=3, steady=0.1, slow_above_s=0.2, clock=clock)
    assert len(times) == 3
    # under 3x the bound, or no bound, or --warmup 2 where nothing is compiled: not by one call
    assert not far_slower_at_once([0.5], 0.2, 0) and not far_slower_at_once([0.8], None, 0)
    call, clock = scripted([0.8, 0.8, 0.8])
    times, _ = warm_up(call, "cpu", min_calls=2, max_calls=3, steady=0.5, slow_above_s=0.2, first_warm_call=0,
                       clock=clock)
    assert len(times) == 2


def test_a_cut_trial_s_figure_is_its_warm_calls_never_the_cold_one():
    # compiled: cold 9 s, first warm call 0.8 s, over 3 x 0.2 s: that call alone is the figure
    cut = cut_short([9.0, 0.8], 0.2, first_warm_call=1)
    assert cut["latency_s"] == 0.8 and cut["calls"] == 1 and cut["cut_above_s"] == 0.2
    assert cut["cut_short"] == "its first warm call took 0.800 s, over 3 x 0.200 s"
    # nothing compiled: the first call is warm
    assert cut_short([0.8], 0.2, first_warm_call=0)["latency_s"] == 0.8
    # the first two agree (the compile cost little): both warm, and both the figure
    cut = cut_short([0.82, 0.8], 0.2, first_warm_call=1)
    assert cut["calls"] == 2 and cut["cut_short"].startswith("its warm calls took 0.820 and 0.800 s")
    # two warm calls after a cold one
    assert cut_short([9.0, 0.5, 0.45], 0.2, first_warm_call=None)["latencies_s"] == [0.5, 0.45]
    # not over the bound, or no bound, or a cold call only: timed calls follow
    assert cut_short([9.0, 0.3], 0.2, first_warm_call=1) is None
    assert cut_short([9.0, 0.8], None, first_warm_call=1) is None
    assert cut_short([9.0], 0.2, first_warm_call=1) is None


def test_two_slow_calls_that_agree_from_the_start_are_warm_already():
    # nothing compiled (float16 on a CPU): the first two calls agree, and both count as warm
    assert too_slow([0.50, 0.52], 0.2)
    assert not too_slow([0.90, 0.50], 0.2)  # a cold first call: the second alone is not enough
    assert too_slow([0.90, 0.50, 0.52], 0.2) and not too_slow([0.50, 0.52], None)


def test_timed_calls_stop_once_the_window_agrees():
    call, clock = scripted([0.05, 0.3, 0.1, 0.1, 0.1])
    result = timed_calls(call, "cpu", min_calls=3, max_calls=10, spread_limit=0.5, clock=clock)
    assert result["stable"]
    assert result["calls"] == 5  # the window of the last three agrees at the fifth call
    assert result["latency_s"] == pytest.approx(0.1)


def test_timed_calls_give_up_at_the_cap_and_say_so():
    call, clock = scripted([0.01, 0.03] * 10)
    result = timed_calls(call, "cpu", min_calls=3, max_calls=5, spread_limit=0.05, clock=clock)
    assert result["calls"] == 5 and not result["stable"]
    assert result["window_spread"] == pytest.approx(2.0)  # (0.03 - 0.01) / 0.01


def test_summary_reports_median_p90_and_spread():
    s = summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s["latency_s"] == 3.0 and s["calls"] == 5
    assert s["p90_s"] == pytest.approx(7.6)  # linear between the 4th and 5th calls (4 + 0.6 * 6)
    assert s["spread"] == 3.0


PARENT_THEN_CHILD = """
import subprocess, sys
big = bytearray(2**30)
for i in range(0, len(big), 4096):
    big[i] = 1  # the parent's peak: 1 GiB resident
del big
child = "from autotune.measure import host_peak_rss_bytes; print(host_peak_rss_bytes())"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
"""


def test_a_child_reports_its_own_peak_not_its_parents():
    # getrusage's ru_maxrss would say 1 GiB here: after exec it keeps the peak of the image it
    # replaced, which Python's vfork start makes the parent's.
    out = subprocess.run([sys.executable, "-c", PARENT_THEN_CHILD], capture_output=True, text=True, check=True)
    assert 0 < int(out.stdout.strip()) < 256 * 2**20


class FakeNvml:
    """Stands in for pynvml: no NVIDIA driver exists on this machine. The device's used memory
    and this process's listing follow a script, one step per poll."""

    class Proc:
        def __init__(self, pid, used):
            self.pid, self.usedGpuMemory = pid, used

    class Info:
        def __init__(self, used):
            self.used = used

    def __init__(self, steps):
        self.steps, self.i = steps, 0  # [(device used, this process's used or None), ...]

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle):
        return self.Info(self.steps[min(self.i, len(self.steps) - 1)][0])

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self.i += 1
        own = self.steps[min(self.i, len(self.steps) - 1)][1]
        return [self.Proc(12345, 7)] + ([self.Proc(os.getpid(), own)] if own is not None else [])


def nvml_peak_over(steps, monkeypatch):
    from autotune.measure import NvmlPeak

    fake = FakeNvml(steps)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    peak = NvmlPeak("GPU-x", interval_s=0.001)
    while fake.i < len(steps) + 2:
        time.sleep(0.001)
    return peak.stop(), peak.source


def test_nvml_peak_is_the_process_own_once_it_is_listed(monkeypatch):
    # Not listed before its CUDA context exists; then listed: its own figure counts, not the
    # device's (another process holds 5000 of it).
    steps = [(1000, None), (1000, None), (6000, 300), (9000, 800), (7000, 500)]
    assert nvml_peak_over(steps, monkeypatch) == (800, "nvml-process")


def test_nvml_peak_falls_back_to_the_device_when_the_process_is_never_listed(monkeypatch):
    steps = [(1000, None), (3000, None), (4500, None), (2000, None)]
    assert nvml_peak_over(steps, monkeypatch) == (3500, "nvml-device")


class NVMLError(Exception):
    pass


class Props:
    """What torch.cuda.get_device_properties tells of a GPU here: its UUID."""

    def __init__(self, uuid="x"):
        self.uuid = uuid


def stub_torch_cuda(monkeypatch, calls=None, **given):
    """torch.cuda as a trial reports it whose reserved memory peaked at 900 (200 reserved at the
    end, 700 allocated at most): there is no CUDA here. `given`: functions of the device standing
    in for some of these; `calls` records the names called, in order."""
    import torch

    figures = {"init": None, "reset_peak_memory_stats": None, "synchronize": None, "get_device_properties": Props(),
               "max_memory_allocated": 700, "max_memory_reserved": 900, "memory_reserved": 200}
    for name, value in figures.items():
        def stub(*args, name=name, value=value, function=given.get(name)):
            if calls is not None:
                calls.append(name)
            return function(*args) if function else value

        monkeypatch.setattr(torch.cuda, name, stub)


class RefusingNvml(FakeNvml):
    """A driver that refuses the per-process listing (vGPU, MIG), and after `answers` polls of
    the device's memory, every call."""

    NVMLError = NVMLError

    def __init__(self, steps, answers):
        super().__init__(steps)
        self.answers = answers

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        raise NVMLError("Not Supported")

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.i += 1
        if self.i > self.answers:
            raise NVMLError("GPU is lost")
        return super().nvmlDeviceGetMemoryInfo(handle)


def test_nvml_that_refuses_the_process_listing_gives_the_devices_figure(monkeypatch):
    from autotune.measure import NvmlPeak

    fake = RefusingNvml([(1000, None), (1000, None), (2500, None), (4000, None), (3000, None)], answers=10**6)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    peak = NvmlPeak("GPU-x", interval_s=0.001)
    deadline = time.monotonic() + 10  # a poller that died would never read on
    while fake.i < 8 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert (peak.stop(), peak.source, peak.failure) == (3000, "nvml-device", None)
    assert peak.current() == 2000


class MismatchedNvml(RefusingNvml):
    """A driver without the versioned listing function: pynvml raises NVMLLibraryMismatchError,
    which is an Exception, not an NVMLError."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        raise Exception("Unversioned function called and the pyNVML version does not match")


def test_nvml_whose_listing_raises_another_error_gives_the_devices_figure(monkeypatch):
    # the poller caught NVMLError alone: this ended its thread unseen, at a peak of 0
    from autotune.measure import NvmlPeak

    fake = MismatchedNvml([(1000, None), (1000, None), (2500, None), (4000, None), (3000, None)], answers=10**6)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    peak = NvmlPeak("GPU-x", interval_s=0.001)
    deadline = time.monotonic() + 10
    while fake.i < 8 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert (peak.stop(), peak.source, peak.failure) == (3000, "nvml-device", None)


def test_nvml_that_stops_answering_leaves_torchs_reserved_peak_as_the_figure(monkeypatch):
    # Before, the poller's thread died on the first NVMLError, unseen, and the trial's peak was
    # what it had read by then (0 here): any config would have fit. No driver or CUDA here:
    # NVML is scripted and torch.cuda's figures stubbed, as below.
    from autotune.measure import MemoryTracker

    monkeypatch.setitem(sys.modules, "pynvml", RefusingNvml([(1000, None)], answers=2))

    stub_torch_cuda(monkeypatch)
    report = MemoryTracker("cuda:0").report()
    assert report.peak_bytes == 900 and report.source == "torch-reserved"
    assert report.outside_torch_bytes is None and "GPU is lost" in report.nvml_failure


def test_the_device_peak_is_torchs_exact_peak_plus_what_lies_outside_it_when_polling_missed_it():
    from autotune.measure import device_peak

    # polling saw 6.0 GB; torch reserved 6.5 GB for a moment between two readings, and the
    # driver holds 0.7 GB beyond torch's cache: 7.2 GB is the peak
    assert device_peak(6_000, 6_500, 700) == (7_200, True)
    assert device_peak(8_000, 6_500, 700) == (8_000, False)  # polling caught it (and more)
    assert device_peak(6_000, None, None) == (6_000, False)  # torch's figures were unreadable
    assert device_peak(0, 6_500, None) == (6_500, True)  # NVML failed: torch's reserved bounds it below


def test_nvml_current_reads_the_same_source_as_the_peak(monkeypatch):
    from autotune.measure import NvmlPeak

    def polled(readings):  # an NvmlPeak stopped once it has read every scripted reading
        fake = FakeNvml(readings)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        peak = NvmlPeak("GPU-x", interval_s=0.001)
        while fake.i < len(readings):
            time.sleep(0.001)
        peak.stop()
        return peak

    peak = polled([(1000, None), (5000, 900), (5000, 900)])
    assert peak.source == "nvml-process" and peak.current() == 900
    peak = polled([(1000, None), (4000, None), (4000, None)])  # never listed: the device's figure
    assert peak.source == "nvml-device" and peak.current() == 3000


def test_a_peak_polling_missed_is_reported_from_torchs_figures(monkeypatch):
    # No NVIDIA driver or CUDA here: NVML is the script below, and torch.cuda's figures are
    # stubbed to what a trial whose reserved memory peaked between two polls would report.
    from autotune.measure import MemoryTracker

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([(1000, None), (1600, 600), (1600, 600)]))

    calls = []
    stub_torch_cuda(monkeypatch, calls)
    report = MemoryTracker("cuda:0").report()
    # given "cuda:N", torch's reset_peak_memory_stats raises unless CUDA was initialized first
    assert calls.index("init") < calls.index("reset_peak_memory_stats")
    # polling saw 600 at most; torch reserved 900 at its peak, and the driver holds 600 - 200 = 400 beyond it
    assert report.nvml_sampled_peak_bytes == 600 and report.outside_torch_bytes == 400
    assert report.peak_bytes == 1300 and report.source == "torch-reserved+outside"


def test_a_pipeline_spread_over_two_gpus_is_budgeted_by_the_fuller_one(monkeypatch):
    # Balanced placement puts components on every visible GPU; only the first was tracked, so a
    # config that filled the second looked as small as its share of the first. No driver or
    # CUDA here: two GPUs' NVML figures are scripted and torch.cuda's stubbed, per device.
    from autotune import worker
    from autotune.measure import MemoryTracker

    class TwoGpus:
        NVMLError = NVMLError
        used = {"GPU-a": 900, "GPU-b": 5000}  # this process's use of each

        def nvmlInit(self):
            pass

        def nvmlDeviceGetHandleByUUID(self, uuid):
            return uuid

        def nvmlDeviceGetMemoryInfo(self, handle):
            return FakeNvml.Info(self.used[handle])

        def nvmlDeviceGetComputeRunningProcesses(self, handle):
            return [FakeNvml.Proc(os.getpid(), self.used[handle])]

    monkeypatch.setitem(sys.modules, "pynvml", TwoGpus())
    reserved = {"cuda:0": 600, "cuda:1": 4000}
    stub_torch_cuda(monkeypatch, get_device_properties=lambda d: Props({"cuda:0": "a", "cuda:1": "b"}[d]),
                    max_memory_reserved=reserved.get, memory_reserved=reserved.get)
    monkeypatch.setattr("autotune.fingerprint.cuda_device_count", lambda: 2)

    gpus = worker.placed_over({"placement": "balanced"}, "cuda")
    assert gpus == ("cuda:0", "cuda:1") and worker.placed_over({}, "cuda") == ()
    report = MemoryTracker("cuda", gpus=gpus).report()
    assert report.peak_bytes == 5000 and report.per_gpu_peak_bytes == {"cuda:0": 900, "cuda:1": 5000}
    assert report.torch_peak_reserved_bytes == 4000  # the figures beside it are that GPU's


def test_timed_calls_record_the_cores_a_neighbour_took():
    # a real neighbour spinning on a core while the timed calls (sleeps) run: its use is counted,
    # ours not; with as many torch threads as allowed cores, none is spare
    import torch

    from autotune.measure import busy_cores, timed_calls

    threads = torch.get_num_threads()
    spinner = neighbour()
    try:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        time.sleep(0.3)  # started
        result = timed_calls(lambda: time.sleep(0.5), "cpu", min_calls=2, max_calls=2)
        assert result["cores_taken_by_others"] >= 0.5 and busy_cores(result) == result["cores_taken_by_others"]
    finally:
        torch.set_num_threads(threads)
        os.kill(spinner, signal.SIGKILL)


def neighbour() -> int:
    """A process spinning on a core that is not ours: forked twice, it is no child of this one
    (a child's time is this process's own, as a compiling trial's workers are). Its pid."""
    started = subprocess.Popen([sys.executable, "-c", "import os, sys\nif os.fork(): sys.exit()\n"
                                "print(os.getpid(), flush=True)\nwhile True: pass"], stdout=subprocess.PIPE, text=True)
    pid = int(started.stdout.readline())  # not read to its end: the spinner holds the pipe open
    started.stdout.close()
    started.wait()
    return pid


def test_the_cores_a_trials_own_child_processes_take_are_not_a_neighbours():
    # a compiled trial's inductor workers and their g++ are its own work: counted as others', a
    # compiled trial cut short in its warm-up read as disturbed (helper-7)
    from autotune.measure import OtherCpuUse

    # CPU seconds, not wall time: on a loaded machine a second of spinning got 0.66 s of a core
    burn = "import sys, time\ndef burn(upto):\n    while time.process_time() < upto: pass\n"
    use = OtherCpuUse()
    child = subprocess.Popen([sys.executable, "-c", burn + "burn(0.6)\nprint(flush=True)\nsys.stdin.read()\nburn(1.2)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child.stdout.readline()  # it has burnt 0.6 s and waits, alive: read from its process
    alive = OtherCpuUse._read(use)[2] - use._start[2]
    child.stdin.close()
    child.wait()  # it burnt 0.6 s more and ended, waited for: read from this process's children's usage
    ended = OtherCpuUse._read(use)[2] - use._start[2]
    assert alive >= 0.5 and ended >= alive + 0.5, (alive, ended)  # /proc counts in 10 ms ticks


def test_nvml_that_stops_answering_after_listing_the_process_is_a_failure(monkeypatch):
    # The listing answered, then failed: that was taken for "not supported", with no failure
    # recorded and 0 made up for the memory outside torch's cache.
    from autotune.measure import MemoryTracker

    class Lost(FakeNvml):
        NVMLError = NVMLError

        lost = False

        def nvmlDeviceGetComputeRunningProcesses(self, handle):
            if self.i >= 3:
                self.lost = True
                raise NVMLError("GPU is lost")
            return super().nvmlDeviceGetComputeRunningProcesses(handle)

    fake = Lost([(1000, None), (1600, 600), (1600, 600)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)

    stub_torch_cuda(monkeypatch)
    tracker = MemoryTracker("cuda:0")
    deadline = time.monotonic() + 10
    # until the listing has failed: its third answer came before, and the poller may not have asked again yet
    while not fake.lost and time.monotonic() < deadline:
        time.sleep(0.001)
    report = tracker.report()
    assert "GPU is lost" in report.nvml_failure and report.outside_torch_bytes is None
    assert report.peak_bytes == 900 and report.source == "torch-reserved"


def test_the_timed_calls_cap_is_never_below_the_repeats_that_must_agree():
    from autotune.measure import MAX_TIMED_CALLS, timed_calls_cap

    assert timed_calls_cap(None, 3) == MAX_TIMED_CALLS
    assert timed_calls_cap(None, MAX_TIMED_CALLS + 2) == MAX_TIMED_CALLS + 2  # --repeats 12 alone
    assert timed_calls_cap(4, 3) == 4
