"""Which measured configuration to pick when the machine's noise cannot tell them apart.

Shared by the study's pick (study.choose_best) and a profile's pick for a smaller budget
(Profile.choose), which hold their measurements in different forms: trial records and the
profile's points. The rule and why: study.choose_best's docstring.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from .knobs import Config, changed

T = TypeVar("T")


def simplest_within_noise(confirmed: list[T], latency: Callable[[T], float],
                          latencies: Callable[[T], list[float]], config: Callable[[T], Config]) -> T:
    """Among configs measured again (`latencies`: their trials' medians; `latency`: the median of
    those): the one that changes fewest knobs from the default among those whose median is no
    higher than the fastest one's slowest trial, then the lowest median."""
    fastest = min(confirmed, key=latency)
    within_noise = [c for c in confirmed if latency(c) <= max(latencies(fastest))]
    return min(within_noise, key=lambda c: (len(changed(config(c))), latency(c)))
