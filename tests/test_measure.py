"""The timing loop: warm up until steady, then timed calls until the median is stable; the
host peak a process reports is its own."""

import subprocess
import sys
import time

from autotune.measure import summarize, timed_calls, warm_up


def sleeper(durations):
    """A call that takes the given durations in turn, then the last one forever."""
    it = iter(durations)
    last = [durations[-1]]

    def call():
        last[0] = next(it, last[0])
        time.sleep(last[0])
        return last[0]

    return call


def test_warm_up_runs_until_two_calls_agree():
    # A slow first call (compilation), a second still warming, then steady. Durations far apart
    # and a loose `steady`: a sleep overshoots by milliseconds on a loaded machine (CI saw two
    # 40 ms sleeps differ by more than 10%).
    times, first = warm_up(sleeper([0.8, 0.3, 0.1, 0.1]), "cpu", min_calls=1, max_calls=6, steady=0.5)
    assert first == 0.8
    assert len(times) == 4
    assert times[0] > times[-1]


def test_warm_up_stops_at_its_cap():
    times, _ = warm_up(sleeper([0.01, 0.05, 0.01, 0.05, 0.01]), "cpu", max_calls=3)
    assert len(times) == 3


def test_timed_calls_stop_once_the_window_agrees():
    result = timed_calls(sleeper([0.05, 0.3, 0.1, 0.1, 0.1]), "cpu", min_calls=3, max_calls=10,
                         spread_limit=0.5)
    assert result["stable"]
    assert 3 <= result["calls"] < 10
    assert abs(result["latency_s"] - 0.1) < 0.05


def test_timed_calls_give_up_at_the_cap_and_say_so():
    result = timed_calls(sleeper([0.01, 0.03] * 10), "cpu", min_calls=3, max_calls=5, spread_limit=0.05)
    assert result["calls"] == 5 and not result["stable"]
    assert result["window_spread"] > 0.05


def test_summary_reports_median_p90_and_spread():
    s = summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s["latency_s"] == 3.0 and s["calls"] == 5
    assert 4.0 < s["p90_s"] <= 10.0
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
