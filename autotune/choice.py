"""Which measured configurations to keep and pick when the machine's noise cannot tell them apart.

Shared by the study (its front and study.choose_best), a profile's pick for a smaller budget
(Profile.choose) and the report (its fronts), which hold their measurements in different forms:
trial records, the profile's points, the report's points; hence the accessor arguments. The pick's rule and
why: study.choose_best's docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from .knobs import Config

T = TypeVar("T")


def changes(config: Config) -> int:
    """How many knobs a config sets away from the default pipeline."""
    from .knobs import changed  # here: the catalogue imports torch, and the report needs none

    return len(changed(config))

def pareto_front(items: list[T], peak: Callable[[T], int], latency: Callable[[T], float]) -> list[T]:
    """The items no other beats on both latency and peak memory, ordered by peak. Strictly: a
    point a few KiB below a faster one stays, as the only measured config for a budget between
    them (merging such points within a tolerance left budgets with a slower pick, or none).

    Two objectives and a handful of points: a sort and one pass, instead of recasting the study
    as multi-objective only to read optuna's best_trials."""
    front: list[T] = []
    for item in sorted(items, key=lambda i: (peak(i), latency(i))):
        if not front or latency(item) < latency(front[-1]):
            front.append(item)
    return front


def pick(items: list[T], latency: Callable[[T], float], latencies: Callable[[T], list[float]],
         config: Callable[[T], Config], confirmed: Callable[[T], bool]) -> T:
    """The pick among feasible configs: the fastest, where it was not measured again (it stands
    on its one measurement, as any pick does without confirmation: a resume with `--confirm 0`,
    a `--timeout` that ended confirmation early, a front point below a study's pick that was
    never a contender); else `simplest_within_noise` among those measured again (`confirmed`).
    The one rule of the study's pick and of a profile's for a smaller budget: no config left
    unconfirmed stands on the front faster than the pick (a simpler config kept within noise may
    stand off the front, beside the faster one its note names)."""
    fastest = min(items, key=latency)
    if not confirmed(fastest):
        return fastest
    return simplest_within_noise([i for i in items if confirmed(i)], latency, latencies, config)


def simplest_within_noise(confirmed: list[T], latency: Callable[[T], float],
                          latencies: Callable[[T], list[float]], config: Callable[[T], Config]) -> T:
    """Among configs measured again (`latencies`: their trials' medians; `latency`: the median of
    those): the one that changes fewest knobs from the default among those whose median is no
    higher than the fastest one's slowest trial, then the lowest median. The fastest is within
    its own noise whatever its trials (a profile's point may carry a median its listed trials do
    not bound: edited, or written by an earlier autotune)."""
    fastest = min(confirmed, key=latency)
    bound = max([latency(fastest), *latencies(fastest)])
    within_noise = [c for c in confirmed if latency(c) <= bound]
    return min(within_noise, key=lambda c: (changes(config(c)), latency(c)))
