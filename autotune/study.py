"""The Optuna study: propose configs, measure each in a child process, record what was measured.

Objective: latency (seconds, minimized). Constraints (seen by the sampler): peak memory plus the
safety margin against the budget, and the output's PSNR against the study's float32 reference
(quality.py), each as a relative violation (> 0 is infeasible). A trial that ran out of memory, crashed or
produced NaN completes as infeasible instead of failing, so the sampler learns from it. A config
the rules forbid is told as pruned (infeasible) without being measured; a config measured already
is not measured again, nor one that only adds memory to a config that ran out of it
(`memory_dominated`). A fresh study measures the baseline first, then an earlier study's front
(--warm-start), then the space's seeds (in float32 where bfloat16 proved slow and float32 fits: `machine_seeds`).

Several workers (processes, GPUs, machines) may share one study through its storage: each asks for
the next config, skips one another worker is measuring, and waits for the others' trials before it
reports the study done. A worker that dies leaves its trial RUNNING without heartbeats; the next
worker to look fails it and queues its config again (RDB storages through Optuna's heartbeat,
journal files through a heartbeat kept here as a trial attribute).
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import json
import math
import os
import socket
import statistics
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import TrialState

from . import fingerprint, quality, repair, runner, storages, worker
from .choice import changes, pareto_front as _front, pick
from .console import config_changes, count, counts_text
from .errors import AutotuneError, first_line
from .fingerprint import is_device_name
from .knobs import CATALOGUE, Config, Target, baseline, complete, conflict
from .measure import MAX_TIMED_CALLS, SPREAD_LIMIT, TIMED_CALLS, TRIAL_TIMEOUT_S, WARMUP_CALLS, busy_cores
from .models import ModelSpec
from .sizes import MAX_SIZE, format_size, parse_margin
from .space import Dimension, SearchSpace, config_key, searched, stored_form
from .workload import Workload

WORKER = f"{socket.gethostname()}:{os.getpid()}"  # who measured a trial, in a shared study
PROCESS = "process"  # user attr: storages.this_process(number) of the worker holding a trial
SEEDS_QUEUED = "seeds_queued"  # a study attribute: its seeds are in its queue (True), or being queued
SEEDS_QUEUEING = "queueing"  # its value while a run queues them: stopped there, the next run queues the rest
QUEUED_AGAIN = "queued_again"  # user attr: a config queued again unmeasured (Ctrl-C, a model that did not load: _queue_again)
MAX_UNMEASURED_IN_A_ROW = 50  # proposals measured already, forbidden or known not to fit: the space is spent
MAX_TWINS_IN_A_ROW = 5  # then wait for the other worker's trial of that config to end

# Violation recorded for a trial with no usable measurement (crash, NaN output, forbidden): worse
# than any measured overshoot of the budget up to 100%, so the sampler ranks it last.
BROKEN = 1.0


@dataclass
class TuneRequest:
    spec: ModelSpec
    workload: Workload
    budget_bytes: int
    space: SearchSpace  # restricted to the target already
    target: Target
    storage: str
    study_name: str
    trials: int  # measured trials the study should hold when done
    workdir: Path  # per-trial request/result/log files
    timeout_s: float | None = None
    patience: int | None = None  # stop when the best has not improved (by 1%) for this many trials
    trial_timeout_s: float = TRIAL_TIMEOUT_S
    margin: str = "0"  # safety margin ("5%", "512MB"): a config fits when peak + margin <= budget
    repeats: int = TIMED_CALLS  # timed calls at least, and the window whose spread must be under spread_limit
    max_calls: int = MAX_TIMED_CALLS  # timed calls at most
    spread_limit: float = SPREAD_LIMIT
    warmup: int = WARMUP_CALLS  # warm-up calls at least (more until two in a row agree)
    threads: int | None = None
    compile_cache_dir: Path | None = None  # inductor cache shared by the study's trials
    # Quality guard: "auto" (calibrated per study on what bfloat16 alone does), a PSNR in dB, or
    # None / 0 for no quality constraint.
    min_psnr_db: float | str | None = "auto"
    seed: int | None = None
    launcher: str = "spawn"  # runner.LAUNCHERS
    warm_start: list = field(default_factory=list)  # configs to measure first (an earlier front)
    # The device model (GPU or CPU name). A study holds measurements of one model only: workers
    # on another refuse to join it. None: not checked (replays of stored tables).
    hardware: str | None = None
    machine: dict | None = None  # fingerprint.machine(), kept with the study for `export`
    # Rounds of re-measurement of the contenders (the fastest feasible configs) once the search
    # stops: the search keeps the lowest of many noisy single measurements, which is biased low.
    confirm_rounds: int = 0
    # Memory repair (repair.py) of configs that ran out of memory; benchmarks switch it off to
    # measure what it adds.
    memory_repair: bool = True

    @property
    def reference_path(self) -> Path:
        """The study's float32 output the quality guard compares every trial with."""
        return self.workdir / "reference.npy"

    @property
    def margin_bytes(self) -> int:
        return parse_margin(self.margin, self.budget_bytes)

    def trial_request(self, config: Config, output_path: Path | None = None, **overrides) -> dict:
        """What the child process of a trial of `config` is asked to do (worker.run reads it), as
        this study measures; `overrides`: other worker.trial_request arguments, or marks."""
        settings = dict(
            capability=self.target.capability, warmup=self.warmup, repeats=self.repeats,
            max_calls=self.max_calls, spread_limit=self.spread_limit, threads=self.threads,
            compile_cache_dir=self.compile_cache_dir, output_path=output_path,
        )
        return worker.trial_request(self.spec, config, self.workload, self.target.device, **{**settings, **overrides})


@dataclass
class TrialRecord:
    number: int
    config: Config
    status: str
    result: dict
    violation: float
    baseline: bool = False
    seeded: bool = False  # a seed of the space or an earlier study's (--warm-start), not the sampler's
    repair: dict | None = None  # a memory repair's {"of": trial number, "adds": "knob=value"} (repair.py)
    duplicate_of: int | None = None
    violations: dict = field(default_factory=dict)  # {"memory": ..., "quality": ...}
    # Later measurements of the same config in fresh trials (confirm_contenders): each
    # {"latency_s", "p90_s", "peak_memory_bytes", "status", "violation"}.
    confirmations: list[dict] = field(default_factory=list)
    # Why this autotune's rules forbid the config, where they do: a study measured by an earlier
    # autotune whose rules a later one tightened. Profile.apply would refuse a profile of it.
    forbidden_now: str | None = None

    @property
    def feasible(self) -> bool:
        return self.status == worker.OK and self.violation <= 0

    @property
    def over_budget(self) -> bool:
        """Ran, and its peak plus the margin came out over the budget (study.violation)."""
        return self.status == worker.OK and self.violations.get("memory", 0) > 0

    @property
    def out_of_budgeted_memory(self) -> bool:
        """Stopped for lack of the memory the budget is on (worker.ran_out_of_budgeted_memory)."""
        return worker.ran_out_of_budgeted_memory({**self.result, "status": self.status})

    @property
    def latencies_s(self) -> list[float]:
        """Every measured median of this config: the trial's, then its confirmations'."""
        first = self.result.get("latency_s")
        return [x for x in [first, *(c.get("latency_s") for c in self.confirmations)] if x is not None]

    @property
    def latency_s(self) -> float | None:
        """The trial's median, or with confirmations the median of its quiet trials' medians
        (quiet_trials: those timed without busy neighbours, else the two least disturbed). On a
        machine busy on and off the default pipeline was timed at 0.72 s quiet and at 11.1 and
        14.3 s beside a neighbour: the median of all three reported a speedup of 13x. The same
        trials as its spread (quiet_latencies_s): read from all, the median of four trials timed
        under load lay above its two least disturbed, and choose_best found no config within
        its own spread and crashed (helper-12)."""
        if not self.confirmations:
            return self.result.get("latency_s")
        return statistics.median(self.quiet_latencies_s or self.latencies_s)

    def measured_trials(self) -> list[dict]:
        """Its trials that measured a median: the first, then its confirmations, in order."""
        return [t for t in [self.result, *self.confirmations]
                if t.get("latency_s") is not None and t.get("status", worker.OK) == worker.OK]

    @property
    def quiet_medians_s(self) -> list[float]:
        """The medians of its trials timed without busy neighbours (measure.busy_cores), in order."""
        return [t["latency_s"] for t in self.measured_trials() if busy_cores(t) is None]

    @property
    def under_load_medians_s(self) -> list[float]:
        """The medians of its trials timed beside busy neighbours, in order."""
        return [t["latency_s"] for t in self.measured_trials() if busy_cores(t) is not None]

    def quiet_trials(self) -> list[dict]:
        """Its measured trials that ran without other processes taking cores from them
        (measure.busy_cores); where none ran so, the two that others took the fewest cores from
        (in the order measured). What its median, spread, p90 and cold start are read from: a
        trial timed beside a busy neighbour (14 s p90 against a 0.2 s median, in a shared study on
        2 cores; a baseline's 10.7 s beside its quiet 0.77 s) says nothing of the config's own."""
        measured = self.measured_trials()
        quiet = [t for t in measured if busy_cores(t) is None]
        if quiet:
            return quiet
        least = sorted(measured, key=lambda t: t.get("cores_taken_by_others") or 0)[:2]
        return [t for t in measured if any(t is kept for kept in least)]

    @property
    def quiet_latencies_s(self) -> list[float]:
        """The medians of quiet_trials: the spread study.choose_best judges noise by."""
        return [t["latency_s"] for t in self.quiet_trials()]

    @property
    def p90_s(self) -> float | None:
        """The trial's p90 of its calls, or with confirmations the highest of its quiet trials'
        p90s (never below their median of medians, as one trial's p90 could be)."""
        p90s = [t["p90_s"] for t in self.quiet_trials() if t.get("p90_s")]
        return max(p90s) if p90s else self.result.get("p90_s")

    def across_trials(self, key: str) -> float | None:
        """A per-trial figure (cold_start_s, spread) of a config measured again: the median over
        its quiet trials that recorded it (confirmations before 2026-11-25 did not); else the
        first trial's."""
        values = [t[key] for t in self.quiet_trials() if t.get(key) is not None] if self.confirmations else []
        return statistics.median(values) if values else self.result.get(key)

    @property
    def ruled_out_by(self) -> str | None:
        """Why a config that ran cannot be picked, one reason each, in this order: "budget" (the
        peak of a trial of it, plus the margin, over the budget), "forbidden" (by this autotune's
        rules, since it was measured), "quality" (below the quality guard), "failed again" (a
        confirmation crashed or timed out); None for one that can be, or that did not run. The
        one reading of the summary, the no-fit error and the trial lines."""
        if self.status != worker.OK or self.feasible:
            return None
        return "budget" if self.over_budget else self.ruled_out_otherwise

    @property
    def ruled_out_otherwise(self) -> str | None:
        """"forbidden", "quality" or "failed again" (in ruled_out_by's order) where that rules the
        config out, over the budget or not: it would not be picked under a larger budget either."""
        v = self.violations
        if self.forbidden_now:
            return "forbidden"
        return "quality" if v.get("quality", 0) > 0 else "failed again" if v.get("failed_again", 0) > 0 else None

    @property
    def peak_memory_bytes(self) -> int | None:
        """The highest peak any of its trials measured: the budget must hold for each."""
        peaks = [p for p in [self.result.get("peak_memory_bytes"),
                             *(c.get("peak_memory_bytes") for c in self.confirmations)] if p]
        return max(peaks) if peaks else None


@dataclass
class StudyOutcome:
    records: list[TrialRecord]  # measured trials (not duplicates; forbidden_now marks those this autotune's rules now forbid), by number
    stop_reason: str
    baseline: TrialRecord | None = None
    best: TrialRecord | None = None
    front: list[TrialRecord] = field(default_factory=list)  # feasible Pareto front, by memory
    counts: dict = field(default_factory=dict)
    quality_guard: dict | None = None  # reference, threshold and how it was calibrated
    guard_asked: bool = False  # the request asks for a guard (None above then: not calibrated yet)
    seed_note: str | None = None  # how the seeds were adapted to this machine, if they were
    measured_here: int = 0  # trials this worker measured (the others measured the rest)
    confirmed_here: int = 0  # confirmation trials this worker measured
    choice_note: str | None = None  # why a simpler config was kept over a faster median, if it was
    ruled_out_note: str | None = None  # measured configs this autotune's rules now forbid, left out of the pick
    software_note: str | None = None  # where its trials were measured under different library versions
    trials: list = field(default_factory=list, repr=False)  # every trial as read, for reports not to read again

    @property
    def waiting(self) -> list:
        """The trials queued and not yet taken (seeds, a warm start, repairs, configs queued again)."""
        return [t for t in self.trials if t.state == TrialState.WAITING]

    @property
    def smallest_peak_bytes(self) -> int | None:
        """The smallest peak of the configs that ran or ran out of memory (where an out-of-memory
        one stopped), of those nothing but the budget rules out: a trial that failed otherwise, at
        load say, says nothing of the memory, and one below the quality guard, or that failed when
        measured again, would not be picked under a larger budget either."""
        peaks = [r.peak_memory_bytes for r in self.records
                 if r.peak_memory_bytes and (r.status == worker.OK or r.out_of_budgeted_memory)
                 and not r.ruled_out_otherwise]
        return min(peaks) if peaks else None

    def why_no_best(self, budget_bytes: int, margin_bytes: int = 0, margin: str = "0") -> tuple[bool, str]:
        """Why the study has no best configuration, in the words the CLI and the report both say,
        and whether configs were measured and none can be picked within the budget (the CLI's
        exit 3), rather than none having run. A config that ran out of budgeted memory counts as
        measured for this: it needs more."""
        ran = [r for r in self.records if r.status == worker.OK]
        ran_out = any(r.out_of_budgeted_memory for r in self.records)
        if not ran and not ran_out:
            if not self.records:
                return False, "no trial completed a measurement" + (f" ({self.stop_reason})" if self.stop_reason else "")
            said = counts_text(Counter(r.status for r in self.records))
            on_host = sum(worker.ran_out_of_host_memory(r.result) for r in self.records)
            if on_host:
                said += f"; host memory ran short in {on_host}: the machine's limit, which the budget does not judge"
            first = self.records[0]
            return False, f"no configuration ran ({said}); trial {first.number}: {first.result.get('error', first.status)}"
        ruled_out = Counter(r.ruled_out_by for r in ran)
        otherwise = []  # what ruled out the configs that fit
        if ruled_out["quality"]:
            guard = f" {self.quality_guard['min_psnr_db']:g} dB" if self.quality_guard else ""
            otherwise.append(f"{ruled_out['quality']} that fit in memory fell below the quality guard's{guard} (--min-psnr)")
        if ruled_out["forbidden"]:
            otherwise.append(f"{ruled_out['forbidden']} that fit in memory broke a rule this autotune added "
                             "since they were measured")
        if ruled_out["failed again"]:
            otherwise.append(f"{ruled_out['failed again']} that fit in memory failed when measured again "
                             "(a crash or a timeout in the confirmation phase)")
        if not ruled_out["budget"] and not ran_out:
            return True, (f"no configuration can be picked within {format_size(budget_bytes)}: all that ran fit "
                          f"it, but {'; '.join(otherwise)}")
        smallest = self.smallest_peak_bytes
        # a trial stopped for memory records where it stopped: its peak was that at least
        stopped_there = smallest and not any(r.peak_memory_bytes == smallest for r in ran)
        # smallest_peak_bytes leaves out the configs ruled out otherwise: said, when some were
        left_out = {r.ruled_out_otherwise for r in ran if r.peak_memory_bytes}
        judged = ("config not ruled out otherwise" if left_out & {"failed again", "forbidden"} else
                  "config the quality guard passed" if "quality" in left_out else None)
        seen = (f"the smallest peak memory {f'of a {judged}' if judged else 'measured'} was "
                f"{'at least ' if stopped_there else ''}{format_size(smallest)}"
                if smallest else f"no {judged or 'trial'} recorded its peak memory")
        if smallest and margin_bytes:
            # a fit is peak plus margin within the budget: a peak under the budget may still miss
            seen += (f" plus the margin of {margin} ({format_size(margin_bytes)})" if str(margin).endswith("%")
                     else f" plus the margin of {format_size(margin_bytes)}")
        return True, f"no configuration fits {format_size(budget_bytes)}: {'; '.join([seen, *otherwise])}"


def violation(result: dict, budget_bytes: int, margin_bytes: int = 0) -> float:
    """Relative overshoot of the budget by peak memory plus the safety margin (> 0: infeasible)."""
    peak = result.get("peak_memory_bytes")
    over = (peak + margin_bytes - budget_bytes) / budget_bytes if peak else 0.0
    if result["status"] == worker.OK:
        return over
    return max(over, 0.0) + BROKEN


def _record(trial: optuna.Trial, memory: float, quality: float = 0.0) -> None:
    """What the sampler learns feasibility from: the relative overshoot of the memory budget and
    the relative shortfall of image quality (> 0: infeasible), as two constraints."""
    trial.set_user_attr("violation", max(memory, quality))
    trial.set_user_attr("violations", {"memory": memory, "quality": quality})
    trial.set_constraint("memory", memory)
    trial.set_constraint("quality", quality)


def make_sampler(seed: int | None) -> optuna.samplers.BaseSampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # multivariate + group: knobs interact (dtype x quantize x compile) and some are
        # conditional. Constraints need no hook: TPE reads each trial's own (Trial.set_constraint)
        # and models infeasible trials apart from feasible ones. n_ei_candidates=100 (default 24):
        # in a space of a few dozen configs more candidates put the proposal nearer the best
        # l(x)/g(x); on the tiny-sdxl CPU table (benchmarks/search_efficiency.py, 80 seeds) median
        # trials to the optimum 12 against 16 under a median budget, 14 against 14 without one.
        # constant_liar: trials other workers are measuring count as bad ones for now, so that a
        # shared study's workers are not all proposed the same config (Optuna 5's default, not 4's).
        return optuna.samplers.TPESampler(
            multivariate=True,
            group=True,
            constant_liar=True,
            n_startup_trials=5,
            n_ei_candidates=100,
            seed=seed,
        )


def _heartbeat(storage, trial) -> None:
    # RDB storages record heartbeats themselves (optuna keeps BaseHeartbeat private). Optuna's
    # journal storage has none, so for it the heartbeat is a trial attribute (a journal line).
    if hasattr(storage, "record_heartbeat"):
        storage.record_heartbeat(trial._trial_id)
    elif isinstance(storage, optuna.storages.JournalStorage):
        storage.set_trial_user_attr(trial._trial_id, "heartbeat_at", time.time())


def _ask(study: optuna.Study) -> optuna.Trial:
    """`study.ask()`, except that a waiting baseline, then a config queued again after its trial
    was interrupted or its worker died, go before the other waiting configs. Optuna hands out
    waiting trials lowest number first, and these are queued again behind the seeds: a resumed
    study would measure the seeds before the baseline that later trials are judged against, and
    with a model that does not load, fail every seed before the baseline stops the run. Claimed
    as `ask` claims a waiting trial: set running, which fails where another worker took it."""
    study._thread_local.cached_all_trials = None  # as ask does: the sampler reads the trials afresh
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    first = sorted((t for t in waiting if t.user_attrs.get("baseline") or t.user_attrs.get(QUEUED_AGAIN)
                    or "failed_trial" in t.system_attrs),  # Optuna's retry of a stale trial
                   key=lambda t: (not t.user_attrs.get("baseline"), t.number))
    for frozen in first:
        try:
            if study._storage.set_trial_state_values(frozen._trial_id, state=TrialState.RUNNING):
                return optuna.Trial(study, frozen._trial_id)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker measured it
    return study.ask()


def _fail_stale_trials(study: optuna.Study) -> None:
    """Fail, and queue again, the RUNNING trials whose worker is gone: a process of this machine
    that has ended (storages.is_gone) at once, others once their heartbeat is GRACE_S old."""
    storage = study._storage
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # RDB storages: heartbeats, then a retry
        retry = storages.RetryStaleTrial()
        journal = isinstance(storage, optuna.storages.JournalStorage)
        now = time.time()
        for frozen in _running(study):
            orphaned = _holder_gone(frozen) or _never_held(study, frozen)
            if journal and not orphaned:
                # A retried trial carries the dead one's heartbeat_at (Optuna's retry copies the
                # user attributes): its own start is the fresher sign of life until it beats itself.
                beat = max(frozen.user_attrs.get("heartbeat_at", 0.0), frozen.datetime_start.timestamp())
                orphaned = now - beat >= storages.GRACE_S
            if not orphaned:
                continue
            try:
                storage.set_trial_state_values(frozen._trial_id, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker failed it first
            retry(study, storage.get_trial(frozen._trial_id))


def _given_up(trials: list[optuna.trial.FrozenTrial]) -> list[Config]:
    """Of a study's `trials`, the configs whose trial was left running by a dead process
    MAX_RETRIES + 1 times, which Optuna's retry queues no more, and that no trial measured, runs or
    waits to measure since."""
    # A config waiting again (queued by _queue_again after a Ctrl-C, say) has no config_key yet:
    # its params, as queued, tell it.
    live = [t.system_attrs.get("fixed_params", t.params) for t in trials
            if t.state in (TrialState.WAITING, TrialState.RUNNING)]
    measured = _measured(trials)
    given_up = {}
    for frozen in trials:
        key = frozen.user_attrs.get("config_key")
        if (frozen.state == TrialState.FAIL and key and key not in measured and frozen.params not in live
                and len(frozen.system_attrs.get("retry_history", [])) >= storages.MAX_RETRIES
                and CONFIRMER not in frozen.user_attrs):
            given_up.setdefault(key, frozen.user_attrs["config"])
    return list(given_up.values())


def _holder_gone(frozen: optuna.trial.FrozenTrial) -> bool:
    """Whether the process of this machine that held this running trial has ended."""
    return storages.is_gone(frozen.user_attrs.get(PROCESS), frozen.number)


def _marked(frozen: optuna.trial.FrozenTrial) -> bool:
    """Whether a worker marked this trial its own (PROCESS, written for this trial number: a retry
    copies its dead trial's mark). None marks it too: written where /proc could not tell."""
    holder = frozen.user_attrs.get(PROCESS, "none")
    return holder is None or storages.written_for(holder, frozen.number)


# (storage, trial id): when this process first saw that trial running, unmarked
_UNMARKED_SINCE: dict[tuple, float] = {}


def _never_held(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> bool:
    """Whether this process has seen a running trial (or confirmation claim) for GRACE_S with no
    process marking it its own (PROCESS; one a retry copied from the dead trial is not its own):
    its worker died in the moment between taking it and marking it, before the first heartbeat
    of an RDB storage, and Optuna's fail_stale_trials, which reads only those, never failed it.
    Left running, it held every later confirmation phase waiting (helper-12). Timed on this
    process's own clock: the trial's start is dated by its worker's, which another machine's
    need not agree with (helper-14)."""
    key = (getattr(study._storage, "url", None) or id(study._storage), frozen._trial_id)  # RDB storages have a URL
    if _marked(frozen):
        _UNMARKED_SINCE.pop(key, None)
        return False
    first_seen = _UNMARKED_SINCE.setdefault(key, time.monotonic())
    return time.monotonic() - first_seen >= storages.GRACE_S


def _unmarked_since_start(frozen: optuna.trial.FrozenTrial) -> bool:
    """_never_held for a one-shot reader (export, report), which cannot watch a trial for GRACE_S:
    unmarked GRACE_S after its start, by this machine's clock (its worker's date, which another
    machine's clock may put off by its skew: only what is said of it depends on this)."""
    if _marked(frozen) or frozen.datetime_start is None:
        return False
    return (datetime.datetime.now() - frozen.datetime_start).total_seconds() >= storages.GRACE_S


def open_study(storage: str, study_name: str, seed: int | None = None) -> tuple[optuna.Study, bool]:
    """The study, and whether this call created it. Of several workers starting at once exactly
    one creates it (the storage refuses a second study of the same name): prepare then queues
    its baseline there (or a later run, where the creator stopped first: _baseline_lost)."""
    backend = storages.open_storage(storage)
    try:
        try:
            study = optuna.create_study(storage=backend, study_name=study_name, direction="minimize",
                                        sampler=make_sampler(seed))
            return study, True
        except optuna.exceptions.DuplicatedStudyError:
            return optuna.load_study(storage=backend, study_name=study_name, sampler=make_sampler(seed)), False
    except optuna.exceptions.StorageInternalError as exc:  # a read-only file or database, a full disk
        raise AutotuneError(f"storage {storages.display_url(storage)}: cannot write the study there "
                            f"({first_line(exc.__cause__ or exc)})") from None


def stored_violations(frozen: optuna.trial.FrozenTrial) -> dict:
    """A measured trial's violations by constraint ({"memory": ..., "quality": ...}); a trial of
    an autotune from before the quality guard stored only the memory one, as its violation."""
    attrs = frozen.user_attrs
    return dict(attrs.get("violations", {"memory": attrs["violation"]}))


def record_of(frozen: optuna.trial.FrozenTrial, confirmations: list[dict] | None = None,
              family: str | None = None) -> TrialRecord | None:
    """A measured trial as the study judges it, its `confirmations` and, given the study's model
    `family`, this autotune's rules included; None for a trial that measured nothing."""
    attrs = frozen.user_attrs
    if "result" not in attrs:
        return None
    confirmations = confirmations or []
    violations = stored_violations(frozen)
    # A confirmation that went over the budget, ran out of memory or broke makes the config
    # infeasible: the budget is a promise for every run, not for its luckiest one. (Host memory
    # running short under a GPU budget is a failure, not the budget's verdict; on a CPU, one
    # stopped while it held less than its budget, others having taken the memory, judges nothing.)
    judged = [c for c in confirmations if not worker.machine_was_short(c)]
    worst_again = max((c["violation"] for c in judged), default=-math.inf)
    judged_by_budget = [c for c in judged if c["status"] == worker.OK or worker.ran_out_of_budgeted_memory(c)]
    violations["memory"] = max([violations.get("memory", 0.0), *(c["violation"] for c in judged_by_budget)])
    if len(judged_by_budget) < len(judged):
        violations["failed_again"] = BROKEN  # a crash, a timeout, host memory under a GPU budget
    forbidden_now = _ruled_out_now(attrs["config"], family)
    return TrialRecord(
        number=frozen.number,
        config=attrs["config"],
        status=attrs["result"]["status"],
        result=attrs["result"],
        violation=max(attrs["violation"], worst_again, BROKEN if forbidden_now else -math.inf),
        violations=violations,
        baseline=attrs.get("baseline", False),
        seeded=bool(attrs.get("seed") or attrs.get("warm_start")),
        repair=attrs.get("repair"),
        duplicate_of=attrs.get("duplicate_of"),
        confirmations=confirmations,
        forbidden_now=forbidden_now,
    )


def _ruled_out_now(config: Config, family: str | None) -> str | None:
    """Why this autotune's rules forbid a stored config, if they do; None where it cannot tell (no
    family to judge by; a knob it does not know: a later autotune's config, which Profile says
    itself)."""
    if not family:
        return None
    try:
        return conflict(complete(config), family)
    except (KeyError, ValueError):
        return None


# What a trial's result records of the software that measured it (worker.run), compared across trials
MEASURED_WITH = (*fingerprint.SOFTWARE_KEYS, "autotune")


def software_note(records: list[TrialRecord]) -> str | None:
    """Which versions measured which trials, confirmation rounds included, where they differ (a
    study resumed, or joined by a worker, after an upgrade): its latencies are compared across
    them all the same. None where one set measured them all, or none recorded it (trials before
    2026-12-02 did not)."""
    measured = [t for r in records for t in (r.result, *r.confirmations)]
    recorded = [t["software"] for t in measured if isinstance(t.get("software"), dict)]
    varied = []
    for key in MEASURED_WITH:
        versions = Counter(str(software.get(key) or "none") for software in recorded)
        if len(versions) > 1:
            varied.append(f"{key} " + ", ".join(f"{v} ({count(n, 'trial')})" for v, n in versions.items()))
    unrecorded = len(measured) - len(recorded)
    if recorded and unrecorded:
        varied.append(f"{count(unrecorded, 'trial')} measured before trials recorded it")
    if not varied:
        return None
    return (f"its trials were measured under different software ({'; '.join(varied)}), and their latencies are "
            "compared all the same: a new --study-name measures under one")


def _software_changed(trials: list, study_name: str) -> str | None:
    """What differs between the software of a study's last measured trial and this run's, said
    before this run's trials mix with its; None where nothing does or it records none."""
    last = next((t.user_attrs["result"].get("software") for t in reversed(trials)
                 if t.state == TrialState.COMPLETE and isinstance(t.user_attrs.get("result"), dict)), None)
    if not isinstance(last, dict):
        return None
    here = fingerprint.software()
    differ = [f"{key} {last.get(key) or 'none'} there, {here.get(key) or 'none'} here"
              for key in MEASURED_WITH if last.get(key) != here.get(key)]
    if not differ:
        return None
    return (f"study {study_name} was last measured under other software ({'; '.join(differ)}): this run's trials "
            "and its are compared as one (a new --study-name measures under one)")


def summarize(study: optuna.Study, stop_reason: str = "", guard_asked: bool = False) -> StudyOutcome:
    """The study's measured trials, baseline, pick and front; `guard_asked`: the request runs with
    the quality guard, whose calibration the outcome then reports."""
    records = []
    attrs = study.user_attrs  # each read is a query and a deep copy
    confirmed = attrs.get(CONFIRMATIONS, {})
    trials = study.get_trials(deepcopy=False)  # one read of the storage: measured and not
    for frozen in (t for t in trials if t.state == TrialState.COMPLETE):
        record = record_of(frozen, confirmed.get(str(frozen.number)), (attrs.get("request") or {}).get("family"))
        if record and record.duplicate_of is None:
            records.append(record)
    feasible = [r for r in records if r.feasible]
    outcome = StudyOutcome(records=records, stop_reason=stop_reason, trials=trials)
    # A config measured under an earlier autotune whose rules a later one tightened (a resumed or
    # exported study) is infeasible now (record_of): said, as it may have been the pick before.
    forbidden = [r for r in records if r.forbidden_now and r.status == worker.OK]
    if forbidden:
        outcome.ruled_out_note = (f"left out of the pick and the front: {count(len(forbidden), 'measured config')} "
                                  f"that this autotune's rules now forbid (trial {forbidden[0].number}: "
                                  f"{forbidden[0].forbidden_now})")
    outcome.software_note = software_note(records)
    outcome.baseline = next((r for r in records if r.baseline), None)
    outcome.best, outcome.choice_note = choose_best(feasible)
    outcome.front = pareto_front(feasible)
    outcome.counts = {
        "trials": len(records),
        "complete": sum(r.status == worker.OK for r in records),
        "infeasible": sum(not r.feasible for r in records),
        "failed": sum(r.status != worker.OK for r in records),
        "by_status": dict(Counter(r.status for r in records)),
        # proposals that took a trial number and were not measured, by why
        "not_measured": dict(Counter(filter(None, map(_why_not_measured, trials)))),
    }
    outcome.guard_asked = guard_asked
    outcome.quality_guard = attrs.get("quality_guard") if guard_asked else None
    outcome.seed_note = attrs.get("seed_note")
    return outcome


# User attr of a study: the queued trials a run left when it stopped at its --trials (a
# --warm-start given to a study that held its trials): a study that ended, not one half done.
LEFT_PAST_TRIALS = "left_queued_past_trials"
# User attr of a study: why the last run's search stopped (study._why_stop, --patience), which
# `autotune export` says beside its own words; in a shared study, the last worker's to stop.
STOP_REASON = "stop_reason"
# User attr of a study: when it was created (time.time() on its creator's clock) and by which
# process (storages.this_process, for a trial numbered -1)
CREATOR = "creator"


def unfinished(study: optuna.Study) -> str | None:
    """What a study has not finished, for an export made meanwhile (None when nothing): trials
    running or queued (but those a run left queued past its --trials), a confirmation running,
    and trials left running by a process of this machine that has ended, or by a worker that
    stopped before it marked one its own (the next run measures them again)."""
    running = _running(study)
    left = [t for t in running if _holder_gone(t) or _unmarked_since_start(t)]
    measuring = [t.number for t in running if t not in left and CONFIRMER not in t.user_attrs]
    parts = []
    if measuring:
        parts.append(f"trial{'s' if len(measuring) > 1 else ''} {', '.join(map(str, measuring))} running")
    if any(CONFIRMER in t.user_attrs for t in running if t not in left):
        parts.append("a confirmation running")
    left_past = set(study.user_attrs.get(LEFT_PAST_TRIALS) or ())
    queued = len([t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                  if t.number not in left_past])
    if queued:
        parts.append(f"{queued} queued")
    if left:
        parts.append(f"{len(left)} left running by a run that ended")
    return ", ".join(parts) or None


class Settled(enum.Enum):
    """Why a proposal is told without being measured (_settle_without_measuring), in the words a
    trial's reason is said in (_why_not_measured)."""
    FORBIDDEN = "forbidden by the rules"
    BEING_MEASURED = "being measured by another worker"
    MEASURED = "measured already"
    KNOWN_NOT_TO_FIT = "known not to fit"
    CONFIRMING = "left for another worker's confirmation rounds, and queued again"


def _why_not_measured(frozen: optuna.trial.FrozenTrial) -> str | None:
    """Why the sampler's proposal in this trial was not measured; None for a measurement, a
    running trial or a confirmation phase's claim (`_claim_confirmation`)."""
    attrs = frozen.user_attrs
    if attrs.get("duplicate_of") is not None:
        return Settled.MEASURED.value
    if "duplicate_of_running" in attrs:
        return Settled.BEING_MEASURED.value
    if "forbidden" in attrs:
        return Settled.FORBIDDEN.value
    if "dominated_by" in attrs:
        return Settled.KNOWN_NOT_TO_FIT.value
    if STEPPED_BACK in attrs:
        return Settled.CONFIRMING.value
    if frozen.state == TrialState.FAIL and CONFIRMER not in attrs:
        return "stopped unfinished"  # Ctrl-C, a dead worker's, a model that did not load: queued again
    return None


def pareto_front(feasible: list[TrialRecord]) -> list[TrialRecord]:
    """Trials no other trial beats on both latency and peak memory, ordered by memory."""
    return _front(feasible, lambda r: r.peak_memory_bytes, lambda r: r.latency_s)


# How a trial is measured: (worker request, trial directory, heartbeat tick) -> worker result.
# The study measures in a child process; benchmarks/search_efficiency.py replays a stored table.
Measure = Callable[[dict, Path, Callable[[], None]], dict]


# On a CPU a trial holding this many times the budget in host memory is stopped as out of memory:
# it cannot fit, and a workload that large could run for hours. Not the reference calls, which
# need not fit (the quality guard compares with their output).
STOP_ABOVE_BUDGET = 2


def measure_in_child(req: TuneRequest) -> Measure:
    def measure(request: dict, trial_dir: Path, tick: Callable[[], None]) -> dict:
        cpu_trial = req.target.device == "cpu" and request.get("purpose") != "reference"
        return runner.run_trial(
            request,
            trial_dir,
            timeout_s=req.trial_timeout_s,
            tick=tick,
            tick_every_s=1.0,
            launcher=req.launcher,
            stop_above_bytes=STOP_ABOVE_BUDGET * req.budget_bytes if cpu_trial else None,
            stop_above_what=f"{STOP_ABOVE_BUDGET}x the {format_size(req.budget_bytes)} budget",
            # held past the budget less the margin, a trial cannot fit, however it was stopped
            may_hold_bytes=req.budget_bytes - req.margin_bytes if cpu_trial else None,
        )

    return measure


def trials_since_improvement(records: list[TrialRecord], by: float = 0.01) -> int:
    """Measured trials (`records`, summarize's) since the best feasible latency last improved by
    more than `by` (all of them when none is feasible yet)."""
    best, since = math.inf, 0
    for record in records:
        since += 1
        if record.feasible and record.latency_s < best * (1 - by):
            best, since = record.latency_s, 0
    return since


def ran_out_of_memory(record: TrialRecord) -> bool:
    """Whether a trial needed more memory than the budget allows (measured, or an OOM error)."""
    return record.out_of_budgeted_memory or record.over_budget


def memory_dominated(config: Config, records: list[TrialRecord]) -> TrialRecord | None:
    """A measured trial that ran out of memory with a config `config` can only need more memory
    than: equal in every knob except those whose choice here is known to need no less
    (Knob.memory_rank: float32 against bfloat16, no offload against offload). Measuring `config`
    would be a wasted trial."""
    def at_least(record: TrialRecord) -> bool:
        return all(
            knob.needs_no_less_memory(config.get(name, knob.default), record.config.get(name, knob.default))
            for name, knob in CATALOGUE.items()
        )

    return next((r for r in records if ran_out_of_memory(r) and at_least(r)), None)


def _one_call(req: TuneRequest, config: Config, output: Path) -> dict:
    """A request that makes one call, marked as a reference call (not a trial of the search)."""
    return req.trial_request(config, output, repeats=1, max_calls=1, warmup=1, max_warmup=1, purpose="reference")


def reference_calls(req: TuneRequest, measure: Measure, threshold: bool = True,
                    time_bfloat16: bool = False) -> dict:
    """The study's one-call runs, made once: the reference output (float32, nothing enabled)
    the quality guard compares with, and a bfloat16 call, whose PSNR sets the "auto" threshold
    and whose time says which precision the seeds take (machine_seeds). `threshold=False`: no
    threshold set; `time_bfloat16`: the bfloat16 call made whatever the threshold."""
    request = _one_call(req, baseline(), req.reference_path)
    result = _reference_call(measure, request, req.workdir / "reference")
    if worker.ran_out_of_budgeted_memory(result) and req.target.is_cuda:
        # float32 does not fit the card: the same precision, streamed from host memory.
        request["config"] = {**baseline(), "offload": "sequential"}
        result = _reference_call(measure, request, req.workdir / "reference-offloaded")
    if result["status"] != worker.OK:
        if did_not_load(result):
            raise model_did_not_load(result)
        if result["status"] == worker.TIMEOUT:
            hint = f"; the baseline needs longer than --trial-timeout {req.trial_timeout_s:g} s here: raise it"
        else:
            hint = "; --min-psnr 0 tunes without the quality guard" if req.min_psnr_db else ""
        raise AutotuneError(
            f"the reference output (float32, nothing enabled) could not be generated: "
            f"{result['status']}: {result.get('error', '')}{hint}"
        )
    guard = {"reference": str(req.reference_path.resolve()), "reference_config": request["config"],
             "noise": quality.NOISE,
             "float32_call_s": result.get("latency_s"), "float32_peak_bytes": result.get("peak_memory_bytes"),
             "cores_taken_by_others": result.get("cores_taken_by_others")}
    auto = threshold and req.min_psnr_db == "auto"
    if auto or time_bfloat16:
        half = {**request["config"], "dtype": "bfloat16"}
        probe = _reference_call(measure, _one_call(req, half, req.workdir / "precision" / "output.npy"),
                                req.workdir / "precision")
        if probe["status"] == worker.OK:
            guard["bfloat16_call_s"] = probe.get("latency_s")
            guard["cores_taken_by_others"] = max(guard["cores_taken_by_others"] or 0,
                                                 probe.get("cores_taken_by_others") or 0)
    measured = quality.assess(probe, req.reference_path) if auto else None
    if auto or time_bfloat16:  # its output said what it had to (12 MB at SDXL's 1024x1024)
        for output in req.workdir.glob("precision*/output.npy"):
            output.unlink(missing_ok=True)
    if not threshold:
        return guard
    if auto:
        if measured:
            guard["bfloat16_psnr_db"] = measured["psnr_db"]
        guard["min_psnr_db"] = quality.auto_threshold(measured["psnr_db"] if measured else None)
    else:
        guard["min_psnr_db"] = float(req.min_psnr_db)
    return guard


def _reference_call(measure: Measure, request: dict, trial_dir: Path) -> dict:
    """One reference call, made once more (in trial_dir-again) when a signal killed it or its
    fork server (the OOM killer for another process, a kill by hand): a stray signal would
    otherwise stop an unattended run for good, or set the "auto" threshold without its bfloat16
    PSNR. A second kill, or a crash that is not a signal's, is the call's own result."""
    result = measure(request, trial_dir, lambda: None)
    if result["status"] != worker.CRASHED or not (result.get("signal") or result.get(runner.SERVER_DIED)):
        return result
    return measure(request, trial_dir.with_name(trial_dir.name + "-again"), lambda: None)


def did_not_load(baseline_result: dict) -> bool:
    """Whether the default pipeline failed to build for a reason no config can change (a broken
    model folder, a missing component): not memory, which other configs may need less of."""
    return baseline_result.get("phase") == "load" and baseline_result["status"] not in (
        worker.OK, worker.OUT_OF_MEMORY, worker.TIMEOUT)


def model_did_not_load(result: dict, where: str = "") -> AutotuneError:
    return AutotuneError(f"the model did not load{where}: {result.get('error', '').removeprefix('load: ')} "
                         f"(log: {result.get('log')})")


def _request_attr(req: TuneRequest) -> dict:
    """What a study was measured under, kept with it: `export` rebuilds the profile from it."""
    return {
        "model": req.spec.to_dict(),
        "workload": req.workload.to_dict(),
        "budget_bytes": req.budget_bytes,
        "margin": req.margin,
        "margin_bytes": req.margin_bytes,
        "device": req.target.device,
        "family": req.target.family,
        "threads": req.threads,
        "warmup": req.warmup,
        "repeats": req.repeats,
        "max_calls": req.max_calls,
        "spread_limit": req.spread_limit,
        "min_psnr_db": req.min_psnr_db,
        "space": stored_form(req.space.dimensions),  # as searched here, after dropping what cannot run
    }


# What a study's measurements mean: a worker or a resumed run that asks for another of these
# would mix incomparable trials, or judge them against another budget (their feasibility is stored
# with them). The timing loop's settings (repeats, spread) only change precision: they may differ.
# The space too: a queued trial, or the sampler's history, holds choices another space lacks.
DEFINING = ("model", "workload", "budget_bytes", "margin_bytes", "device", "threads", "min_psnr_db", "space")


def _defining(request: dict) -> dict:
    # the device's type only: any GPU of the study's model may join it (the hardware check holds
    # the model), so cuda, cuda:0 and cuda:1 alike
    return {k: request[k].split(":")[0] if k == "device" else request[k] for k in DEFINING if k in request}


def _refuse_another_request(study: optuna.Study, asked: dict, dropped_here: tuple | list = ()) -> None:
    held = study.user_attrs.get("request") or {}
    shown = request_differences(held, asked)
    if shown:
        raise AutotuneError(f"study {study.study_name} was measured under other settings ({shown}): "
                            f"its trials do not mix with these; use another --study-name"
                            f"{_space_hint(held.get('space'), asked.get('space'), dropped_here)}")


def _space_hint(held: dict | None, asked: dict | None, dropped_here: tuple | list) -> str:
    """How to resume a study whose stored space (knob -> choices and condition) differs from this
    run's: with the --space it was measured under; unless the study's space, less what this
    machine leaves out, is this run's (narrowed as SearchSpace.restrict narrows it: a knob left
    with one choice is not searched), so that no --space brings it back: then why."""
    if held is None or held == asked:
        return ""
    # keyed through JSON, as the stored space holds choices (a tuple stored is a list)
    left_out = {(d.knob, json.dumps(d.value)): d for d in dropped_here}
    dims = [Dimension(knob, tuple(dim["choices"]), dim["when"]) for knob, dim in held.items()]
    if stored_form(searched(dims, lambda knob, value: (knob, json.dumps(value)) not in left_out)) != asked:
        return " (or resume with the --space it was measured under)"
    lacking = [str(left_out[knob, json.dumps(value)]) for knob, dim in held.items() for value in dim["choices"]
               if (knob, json.dumps(value)) in left_out]
    return f" (it searched what this machine now leaves out: {'; '.join(lacking)})"


def request_differences(held: dict, asked: dict) -> str:
    """What differs, of what a study's measurements mean (DEFINING), between the request `held`
    by a study and the one `asked` (each as _request_attr writes it): "" when nothing does.
    Only the keys `held` has: a study an older autotune wrote, before a key joined DEFINING (the
    space, min_psnr_db), resumes. settings_that_differ, between two stored requests, takes both's."""
    wanted = _defining(asked)
    differ = [k for k, value in _defining(held).items() if value != wanted.get(k)]
    return "; ".join(_space_difference(held[k], asked[k]) if k == "space" else
                     _fields_difference(k, held[k], asked[k]) if isinstance(held[k], dict) and isinstance(asked.get(k), dict)
                     else f"{k.removesuffix('_bytes')} {_shown(k, held[k])} there, {_shown(k, asked.get(k))} here"
                     for k in differ)


def _fields_difference(key: str, held: dict, asked: dict) -> str:
    """The fields that differ of a mapping (the model, the workload), not the whole of both."""
    return "; ".join(f"{key} {field} {held.get(field)} there, {asked.get(field)} here"
                     for field in sorted(set(held) | set(asked), key=str) if held.get(field) != asked.get(field))


def settings_that_differ(one: dict, other: dict) -> str:
    """The names of what differs, of what a study's measurements mean (DEFINING), between two
    stored requests (as _request_attr writes them), for a listing of studies side by side:
    "margin, the search space's attention, dtype"; "" when nothing does."""
    mine, theirs = _defining(one), _defining(other)
    names = []
    for k in sorted(set(mine) | set(theirs)):
        a, b = mine.get(k), theirs.get(k)
        if a == b:
            continue
        if k == "space" and isinstance(a, dict) and isinstance(b, dict):
            names.append(f"the search space's {', '.join(_knobs_searched_differently(a, b))}")
        elif isinstance(a, dict) and isinstance(b, dict):
            names += [f"{k} {field}" for field in sorted(set(a) | set(b), key=str) if a.get(field) != b.get(field)]
        else:
            names.append(k.removesuffix("_bytes"))
    return ", ".join(names)


def differences_from(study: optuna.Study, req: TuneRequest) -> str:
    """request_differences between what `study` was measured under and `req`."""
    return request_differences(study.user_attrs.get("request") or {}, _request_attr(req))


def _shown(key: str, value) -> str:
    return format_size(value) if key.endswith("_bytes") and isinstance(value, int) else str(value)


def _knobs_searched_differently(held: dict, asked: dict) -> list[str]:
    """The knobs two stored spaces (knob -> its choices and conditions) search differently."""
    return sorted(set(held) ^ set(asked) | {k for k in set(held) & set(asked) if held[k] != asked[k]})


def _space_difference(held: dict, asked: dict) -> str:
    # no guess at the cause: a --space of the user's, or an autotune update of the shipped spaces
    return f"the search space: {', '.join(_knobs_searched_differently(held, asked))} searched differently"


def request_of(study: optuna.Study, storage: str) -> TuneRequest:
    """The request a stored study was measured under (for writing its profile anywhere)."""
    from .models import ModelSpec
    from .workload import Workload

    attr = study.user_attrs.get("request")
    try:  # each key _request_attr writes, read where it is needed: one missing is another version's
        req = TuneRequest(
            spec=ModelSpec.from_dict(attr["model"]), workload=Workload.from_dict(attr["workload"]),
            budget_bytes=attr["budget_bytes"], space=SearchSpace([]),
            target=Target(device=attr["device"], family=attr["family"]), storage=storage,
            study_name=study.study_name, trials=0, workdir=Path("."), margin=attr["margin"],
            repeats=attr["repeats"], max_calls=attr["max_calls"], spread_limit=attr["spread_limit"],
            warmup=attr["warmup"], threads=attr["threads"], min_psnr_db=attr["min_psnr_db"],
            machine=study.user_attrs.get("machine"),
        )
    except (KeyError, TypeError):  # TypeError: no request at all (None)
        raise AutotuneError(f"study {study.study_name}: it records no autotune request (an Optuna study of "
                            "another tool, or one written by an older autotune)") from None
    except (AutotuneError, ValueError) as exc:  # a model or workload out of shape
        raise AutotuneError(f"study {study.study_name}: its stored request is malformed: {exc}") from None
    try:
        check_stored_request(attr)
    except ValueError as exc:
        raise AutotuneError(f"study {study.study_name}: its stored request is malformed: {exc}") from None
    return req


def check_stored_request(attr: dict) -> None:
    """The values of a stored request that its readers compute with (export's listing, the
    profile, the report): ValueError naming the first out of shape (an edited request's budget
    of "x" was a TypeError there, a list model an AttributeError in the report). A key it lacks
    is not checked: the report draws the partial requests of earlier autotunes."""
    if "model" in attr and not isinstance(attr["model"], dict):
        raise ValueError(f"model {attr['model']!r:.40} is not a mapping")
    if "workload" in attr:
        try:
            Workload.from_dict(attr["workload"]).check()  # its values too: a list height was a TypeError
        except ValueError as exc:
            raise ValueError(f"workload {exc}") from None
    budget = attr.get("budget_bytes")
    if "budget_bytes" in attr and (type(budget) is not int or not 0 < budget <= MAX_SIZE):
        raise ValueError(f"budget_bytes {budget!r:.40} is not a positive number of bytes")
    if "device" in attr and not is_device_name(attr["device"]):  # the listing reads its type (helper-23)
        raise ValueError(f"device {attr['device']!r:.40} is not cpu, cuda or cuda:N")
    if attr.get("margin") not in (None, ""):
        parse_margin(attr["margin"], budget or 0)  # as TuneRequest.margin_bytes parses it


def prepare(req: TuneRequest, measure: Measure | None = None,
            on_step: Callable[[str], None] | None = None) -> optuna.Study:
    """Open (or create) the study and set it up once: the device model it holds, the request,
    the first configs to measure, and the quality guard. Workers joining it later find it ready.
    `on_step` hears of the warm start, and of the reference calls before they start (minutes for
    a full-size model on a CPU, before any trial is reported)."""
    on_step = on_step or (lambda text: None)
    measure = measure or measure_in_child(req)
    study, created = open_study(req.storage, req.study_name, req.seed)
    if created:  # first: a worker joining sees from it whether the creator may still be setting up
        study.set_user_attr(CREATOR, {"at": time.time(), "process": storages.this_process(-1)})
    _hold_the_request(study, req)
    if not created:  # a resume, or a worker joining: said before anything is measured
        if study.user_attrs.get(LEFT_PAST_TRIALS):
            study.set_user_attr(LEFT_PAST_TRIALS, [])  # this run may measure them: unfinished until it stops
        trials = study.get_trials(deepcopy=False)
        kept = len(_measured(trials))
        on_step(f"study {req.study_name} exists in this storage: " + (
            f"its {count(kept, 'measured trial')} kept, as many as --trials {req.trials} asks: nothing more to "
            "search (a higher --trials searches on)" if kept >= req.trials > 0 else
            f"its {count(kept, 'measured trial')} kept, the search goes on from them" if kept
            else "no trial measured yet, the search starts there"))
        changed = _software_changed(trials, req.study_name)
        if changed:
            on_step(changed)
        for config in _given_up(trials):
            on_step(f"not measured again: [{config_changes(config)}], whose process died "
                    f"{storages.MAX_RETRIES + 1} times while measuring it (killed, or the machine's "
                    "out-of-memory killer?); the sampler may propose it again")
    with _setting_up_alone(req.workdir, on_step):
        _queue_baseline_and_warm_start(study, req, created, on_step)
        # The seeds are queued once per study, by the run that finds them not queued yet: the one
        # that created it, or the next one where that run stopped (Ctrl-C, an error, SIGKILL)
        # before it queued them all. (A study of an autotune before the mark: its seed trials say so.)
        mark = study.user_attrs.get(SEEDS_QUEUED)
        seeds_pending = mark is not True and (mark == SEEDS_QUEUEING or not any(
            t.user_attrs.get("seed") for t in study.get_trials(deepcopy=False)))
        # Whether the seeds' precision depends on this machine: they ask for bfloat16 and float32
        # is a choice (machine_seeds). Then the float32 and bfloat16 calls are made whatever the guard.
        seeds_in_bfloat16 = seeds_pending and "float32" in req.space.choices_of("dtype") and any(
            s.get("dtype") == "bfloat16" for s in req.space.seed_configs())
        calibration = _calibrate(study, req, measure, on_step, seeds_in_bfloat16)
        # Seeds go in after the calibration, whose two calls say which precision is fast here. A
        # run stopped in it (Ctrl-C, an error, SIGKILL) queues none, and the next run calibrates
        # and queues them. Read again: a worker on another machine may have queued them meanwhile.
        if seeds_pending and study.user_attrs.get(SEEDS_QUEUED) is not True:  # read from the storage
            _queue_seeds(study, req, calibration)
    return study


@contextlib.contextmanager
def _setting_up_alone(workdir: Path, on_step: Callable[[str], None]):
    """One worker at a time, of those sharing this folder, through the study's set-up: two
    started at once in one folder made their reference calls in the same folders (one run's
    clean-up could delete the other's result, a "crashed" call that stopped it) and each set the
    quality guard (helper-12). The one that waits then finds the reference made and the guard set. A file lock
    (filelock, which torch itself requires): the OS frees it when its holder dies, SIGKILL too.
    Where the folder's file system takes no lock (NFS without its lock daemon), the set-up goes
    on without it, as before there was one. The lock file stays in the folder: one removed on
    release could be the file a waiting worker has open, and two workers would hold two locks."""
    import filelock

    workdir.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(workdir / ".set-up.lock")
    held = True
    try:
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            on_step("another worker is setting this study up in this folder (its reference calls): waiting for it")
            lock.acquire()
    except (OSError, NotImplementedError):  # ENOLCK; filelock 3's word for a file system without flock
        held = False
    try:
        yield
    finally:
        if held:
            lock.release()


def _hold_the_request(study: optuna.Study, req: TuneRequest) -> None:
    """Refuse a study another tool made, and a worker whose device model or request (DEFINING)
    differs from what the study holds;
    record the device model where none is held yet, and this run's request (its timing settings
    may differ from an earlier run's: the latest is kept)."""
    # The trials read before the attributes: a worker that created the study writes its request
    # before it queues anything, so trials seen here mean a request there, if it is autotune's.
    trials = study.get_trials(deepcopy=False)
    ours = any(t.user_attrs.get("baseline") or "config_key" in t.user_attrs for t in trials)
    if "request" not in study.user_attrs and not ours and (
            trials or study.directions != [optuna.study.StudyDirection.MINIMIZE]):
        # Another tool's study: its trials would mix with these (or, with two objectives, every
        # trial fail). An empty minimizing one is autotune's own, stopped before its request.
        raise AutotuneError(f"study {req.study_name} in this storage was not made by autotune (it records no "
                            "request): use another --study-name")
    if req.hardware:
        held = study.user_attrs.get("hardware")
        if held and held != req.hardware:
            raise AutotuneError(
                f"study {req.study_name} holds measurements made on {held}; this worker's device is "
                f"{req.hardware}: timings of different models do not mix (use another --study-name)"
            )
        if not held:
            study.set_user_attr("hardware", req.hardware)
            study.set_user_attr("machine", req.machine)
    _refuse_another_request(study, _request_attr(req), req.space.dropped)
    study.set_user_attr("request", _request_attr(req))


def _queue_baseline_and_warm_start(study: optuna.Study, req: TuneRequest, created: bool,
                                   on_step: Callable[[str], None]) -> None:
    """Queue the baseline (in a new study, or one whose creator stopped before it queued it) and
    the --warm-start configs not queued or measured yet."""
    space = req.space
    if created or _baseline_lost(study):
        study.enqueue_trial(space.params(baseline()), user_attrs={"baseline": True})
    # On a study that exists too (a resume given --warm-start was silently left as it was): the
    # configs it has not measured, run or queued yet (Optuna compares the params).
    warm = space.fit(req.warm_start)
    for config in warm:
        study.enqueue_trial(space.params(config), user_attrs={"warm_start": True}, skip_if_exists=True)
    if req.warm_start:  # said: nothing else on the console tells a warm-started trial apart
        left = len(req.warm_start) - len(warm)
        # a resumed study that holds --trials measured already measures none of them
        full = len(_measured(study.get_trials(deepcopy=False))) >= req.trials > 0
        when = (f"queued, but not measured: the study holds --trials {req.trials} measured (a higher --trials "
                "measures them first)" if full else "measured first, after the baseline (unless measured already)")
        on_step(f"warm start: {count(len(warm), 'config')} of the earlier front {when}"
                + (f"; {left} left out: the baseline, forbidden here, or the same once reduced to this space"
                   if left else ""))


def _baseline_lost(study: optuna.Study) -> bool:
    """Whether a study another run created has no baseline, and will not get one from its
    creator: none queued, running or measured (one that stepped back from a racing twin, as two
    racing baselines both may, is none), and its creator gone (its process, on this machine) or
    GRACE_S past the creation. A creator stopped (Ctrl-C, SIGKILL) in the 70 ms between creating
    the study and queueing its baseline left a study without one for good: no speedup, none in its
    profile (helper-12). Within GRACE_S a creator on another machine may still be about to queue
    it: a worker that queued one too made two racing baselines (helper-14)."""
    for frozen in study.get_trials(deepcopy=False):
        if frozen.user_attrs.get("baseline") and "duplicate_of_running" not in frozen.user_attrs:
            return False
    # none recorded: a study made before autotune recorded it (it has its baseline), or one whose
    # creator stopped before recording it
    creator = study.user_attrs.get(CREATOR) or {}
    return storages.is_gone(creator.get("process"), -1) or time.time() - creator.get("at", 0.0) >= storages.GRACE_S


def _calibrate(study: optuna.Study, req: TuneRequest, measure: Measure, on_step: Callable[[str], None],
               seeds_in_bfloat16: bool) -> dict:
    """The reference calls where they are due, and their record: the quality guard's threshold and
    this machine's reference output, and the float32 and bfloat16 call times machine_seeds reads
    (`seeds_in_bfloat16`: the seeds wait on them). This run's calls, or those the study kept (a
    run that made them may have stopped before it queued the seeds)."""
    guard = study.user_attrs.get("quality_guard")
    if guard is not None and guard.get("noise") != quality.NOISE:
        guard = _guard_of_the_old_noise(study, guard)
    kept = guard or study.user_attrs.get("precision_probe") or {}
    if req.min_psnr_db and (guard is None or not quality.readable(req.reference_path)):
        # Each machine keeps its own reference output (the study may be shared), made again
        # when missing or cut short; the threshold is the study's, set by the first worker
        # to calibrate it.
        on_step("reference calls: the float32 output the quality guard compares with"
                + (", and one bfloat16 call" if guard is None and req.min_psnr_db == "auto" or seeds_in_bfloat16 else ""))
        calibration = reference_calls(req, measure, threshold=guard is None, time_bfloat16=seeds_in_bfloat16)
        _say_if_busy(calibration, on_step)
        if guard is None:
            _say_if_weak(calibration, on_step)
            study.set_user_attr("quality_guard", calibration)
        return calibration
    if seeds_in_bfloat16 and not kept.get("bfloat16_call_s"):
        # the two calls for their times alone: no guard, or one whose calls did not time bfloat16
        on_step("reference calls: one float32 and one bfloat16 call, whose times say which precision the seeds take")
        try:
            calibration = reference_calls(req, measure, threshold=False, time_bfloat16=True)
            _say_if_busy(calibration, on_step)
            study.set_user_attr("precision_probe", calibration)
            return calibration
        except AutotuneError:
            pass  # the seeds keep their precision; the baseline trial shows what fails here
    return kept


def _guard_of_the_old_noise(study: optuna.Study, guard: dict) -> dict:
    """The guard of a study measured before every config drew its starting noise in float32:
    kept, marked, where this torch draws the same noise in every precision; refused where it does
    not, as its half-precision trials were compared with an image of other noise (bfloat16 at
    13-14 dB on the tiny models with torch 2.11, and an "auto" threshold of about 7.5 dB)."""
    import torch

    if quality.precision_changes_the_draw():
        raise AutotuneError(
            f"study {study.study_name} was measured before autotune drew every config's starting noise "
            f"in float32: with this torch ({torch.__version__}) its half-precision trials started from "
            "other noise than the float32 reference, and their PSNR compared unrelated images; "
            "start a new study (--study-name)")
    guard = {**guard, "noise": quality.NOISE}
    study.set_user_attr("quality_guard", guard)
    return guard


def _say_if_weak(calibration: dict, on_step: Callable[[str], None]) -> None:
    """A line where bfloat16 alone scored so low against float32 that the "auto" guard calibrated
    on it lets most changes through: a scheduler that adds noise at each step (ancestral, SDE)
    draws it in the pipeline's dtype, which torch < 2.13 draws as other values per precision
    (27 dB on tiny-sd15 with EulerAncestral at 4 steps on torch 2.11, against 47 dB on 2.13).
    workload.initial_noise mends the starting noise only: the steps' draws are the scheduler's."""
    import torch

    scored = calibration.get("bfloat16_psnr_db")
    if scored is None or scored >= quality.WEAK_BFLOAT16_DB:
        return
    why = (f"; with this torch ({torch.__version__}) a scheduler that adds noise at each step (ancestral, SDE) "
           "draws other noise in each precision" if quality.precision_changes_the_draw() else "")
    on_step(f"  bfloat16 alone scored {scored:.1f} dB against float32, so the auto guard "
            f"({calibration['min_psnr_db']:.1f} dB) lets through what changes the image as much{why}; "
            "--min-psnr DB sets the guard by hand")


def _say_if_busy(calibration: dict, on_step: Callable[[str], None]) -> None:
    """A line where the reference calls were timed beside other processes' work, as a trial's line
    says it: their times then decide nothing (machine_seeds keeps the seeds' precision)."""
    busy = busy_cores(calibration)
    if busy:
        on_step(f"  the reference calls were timed while other processes took {busy:.1f} of the CPU cores: "
                "their times do not decide the seeds' precision")


def _queue_seeds(study: optuna.Study, req: TuneRequest, calibration: dict) -> None:
    """Queue the space's seeds as this machine takes them (machine_seeds), and mark them queued."""
    seeds, note = machine_seeds(req.space, calibration, req.budget_bytes - req.margin_bytes,
                                cpu=not req.target.is_cuda)
    study.set_user_attr(SEEDS_QUEUED, SEEDS_QUEUEING)  # stopped among them, a resume queues the rest
    for config in seeds:
        # skip_if_exists (Optuna compares the params of every trial, queued, running or ended): a
        # seed the warm start queued, or one of two workers that both found them pending
        study.enqueue_trial(req.space.params(config), user_attrs={"seed": True}, skip_if_exists=True)
    if note:
        study.set_user_attr("seed_note", note)
    study.set_user_attr(SEEDS_QUEUED, True)


# A trial whose last two warm calls (measure.too_slow) are this much slower than the fastest feasible trial so
# far stops there, their median its figure (worker.trial_request's cut_above_s; its first warm
# call alone does when far over it: measure.far_slower_at_once): it cannot be a
# contender (those are within 1 + CONTENDER_WITHIN of the fastest), and a precise median of a
# config that slow would cost minutes per trial for nothing (float16 on a CPU, sequential offload).
# Its peak memory is tracked through its calls, so it still counts for the Pareto front. Optuna's pruners do
# this for trials that report intermediate values; a trial here reports once, from its child.
CUT_SLOWER_THAN = 2.0


# bfloat16 this much slower than float32 in the study's reference calls (reference_calls): not a precision
# to seed with here (CPUs without bf16 instructions, GPUs before Ampere; 2.5x on a 2-core Xeon VM).
SLOW_BFLOAT16 = 1.2


def machine_seeds(space: SearchSpace, guard: dict | None, usable_bytes: int,
                  cpu: bool = False) -> tuple[list[Config], str | None]:
    """The space's seeds for this machine, and a note when they were changed. The shipped seeds
    are in bfloat16, the fast precision on current GPUs; where the calibration measured bfloat16
    clearly slower than float32, and float32 fits the budget (`usable_bytes`: the budget less the
    margin), the seeds keep their other settings in float32 instead. Where float32 does not fit,
    half precision is what makes a config fit at all: the seeds stay in bfloat16. On a CPU
    (`cpu`), each compiled seed is measured frozen too, first (`_frozen_on_cpu`)."""
    seeds = space.seed_configs()
    if cpu:
        seeds = space.fit([each for s in seeds for each in _frozen_on_cpu(s)])
    guard = guard or {}
    fp32, bf16 = guard.get("float32_call_s"), guard.get("bfloat16_call_s")
    if not seeds or not (fp32 and bf16 and bf16 > SLOW_BFLOAT16 * fp32):
        return seeds, None
    slower = f"bfloat16 ran {bf16 / fp32:.1f}x slower than float32 in the reference calls (one call each)"
    busy = busy_cores(guard)
    if busy:  # one call each, timed beside a busy neighbour: not this machine's speeds
        return seeds, (f"{slower}, but other processes took {busy:.1f} of its CPU cores meanwhile: the seeds "
                       "stay in bfloat16")
    fp32_peak = guard.get("float32_peak_bytes")
    # a reference made with offload means plain float32 ran out of device memory
    if guard.get("reference_config") != baseline() or (fp32_peak and fp32_peak > usable_bytes):
        return seeds, f"{slower}, but float32 does not fit the budget: the seeds stay in bfloat16"
    note = f"{slower}: the seeds keep their other settings in float32"
    return space.fit([{**s, "dtype": "float32"} if s.get("dtype") == "bfloat16" else s for s in seeds]), note


def _disturbed_out_of_the_running(result: dict, fastest: float | None, req: TuneRequest) -> bool:
    """Whether a trial timed while other processes took its CPU cores (measure.busy_cores) lost
    on that figure: it fits the budget and ran slower than the fastest feasible trial (the caller
    checks the quality guard too: _below_the_guard). A neighbour
    slows a trial by more than its own figures can tell (a run beside a test suite recorded a
    config at 2.1 s that measured 0.33 s in another study), and a config slower than the fastest is
    never measured again (only contenders are confirmed): it gets one more trial. A disturbed trial
    faster than the rest needs none: confirmation measures it again."""
    return (result.get("status") == worker.OK and busy_cores(result) is not None and fastest is not None
            and result["latency_s"] > fastest and violation(result, req.budget_bytes, req.margin_bytes) <= 0)


def _timed_quiet(result: dict) -> bool:
    """A trial that ran and was timed without busy neighbours (a failed one times nothing)."""
    return result.get("status") == worker.OK and busy_cores(result) is None


def _below_the_guard(result: dict, req: TuneRequest, min_psnr_db: float | None) -> bool:
    """Whether a trial's output is too far from the reference: it cannot be picked, whatever it
    timed. The assessment is kept in the result, which _tell_measured records."""
    if not min_psnr_db:
        return False
    result["quality"] = quality.assess(result, req.reference_path)
    return quality.violation(result["quality"], min_psnr_db) > 0


def _less_disturbed(first: dict, second: dict) -> dict:
    """Of a disturbed trial and its second measurement, the one other processes took fewer cores
    from, recording the other's figures (and which was kept); its peak memory the higher of the
    two, as a profile's peak is the highest of a config's trials. A second trial that failed (out
    of memory, crashed) stands, as a failed confirmation makes its config infeasible: the budget
    is a promise for every run. Not one stopped because the machine's memory ran short before the
    budget was reached: the first ran, and the second says only that others took the memory."""
    taken = [(r.get("cores_taken_by_others") or 0) for r in (first, second)]
    failed = second.get("status") != worker.OK and not worker.machine_was_short(second)
    keep_second = failed or (second.get("status") == worker.OK and taken[1] < taken[0])
    kept, other = (second, first) if keep_second else (first, second)
    if other.get("output"):
        Path(other["output"]).unlink(missing_ok=True)
    kept["measured_twice"] = {"kept": "second" if keep_second else "first",
                              **{k: other.get(k) for k in ("status", "latency_s", "peak_memory_bytes",
                                                           "cores_taken_by_others")}}
    if kept.get("status") == worker.OK and (other.get("peak_memory_bytes") or 0) > (kept.get("peak_memory_bytes") or 0):
        kept["peak_memory_bytes"] = other["peak_memory_bytes"]
        kept["peak_from"] = "the other of its two trials"  # the fields beside it describe this one
    return kept


def _queue_a_repair(req: TuneRequest, study: optuna.Study, outcome: StudyOutcome) -> bool:
    """Queue the next memory repair (repair.py) when nothing else waits to be measured (seeds and
    an earlier study's configs go first) and one more keeps repairs within their share of the trials
    (at most 2 of --trials 5).
    `outcome`: the study as just read (summarize). Whether a repair waits to be measured (queued
    now or before)."""
    trials, records, waiting = outcome.trials, outcome.records, outcome.waiting
    if waiting or not req.memory_repair or repair.count(trials) + 1 > req.trials * repair.SHARE:
        return any("repair" in t.user_attrs for t in waiting)
    running = {t.user_attrs.get("config_key") for t in trials if t.state == TrialState.RUNNING}
    found = repair.next_repair(records, running, req.space, req.target.is_cuda,
                               dominated_by=lambda config: memory_dominated(config, records))
    if found:
        study.enqueue_trial(req.space.params(found.config), user_attrs=found.marks)
    return found is not None


# What a queued config is marked with (prepare, _queue_a_repair), kept when it is queued again
QUEUE_MARKS = ("baseline", "seed", "warm_start", "repair")


def _queue_again(study: optuna.Study, trial: optuna.Trial) -> None:
    """Queue an unfinished trial's config again, with its marks, so the same command measures it
    first (_ask); Optuna's retry of a stale trial keeps them too."""
    study.enqueue_trial(trial.params, user_attrs={
        QUEUED_AGAIN: True, **{k: trial.user_attrs[k] for k in QUEUE_MARKS if k in trial.user_attrs}})


def _frozen_on_cpu(seed: Config) -> list[Config]:
    """A compiled seed with inductor's freezing, then as it is (space.fit then drops the frozen one
    where the space does not search freezing or a rule forbids it, as with regional compile): on
    a CPU, freezing is what lets inductor prepack the weights for oneDNN's kernels, and the
    compiled stack ran 1.7x faster with it on this project's 2-core CPU
    (benchmarks/results/versus_hand_tuning-epyc-freezing.md). Both: the frozen one holds about a
    GiB more (SD1.5), and in the #8 run the seed frozen alone fitted no budget the plain one did."""
    return [seed] if seed.get("compile", "none") == "none" else [{**seed, "compile_freezing": True}, seed]


def _measured(trials: list[optuna.trial.FrozenTrial]) -> dict[str, int]:
    """The configs measured by these trials of a study (a trial's own measurement, not a
    duplicate's): config key -> its trial number."""
    out: dict[str, int] = {}
    for frozen in trials:
        measured_here = "result" in frozen.user_attrs and frozen.user_attrs.get("duplicate_of") is None
        if frozen.state == TrialState.COMPLETE and measured_here:
            out.setdefault(frozen.user_attrs["config_key"], frozen.number)
    return out


def _running(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))


def _in_flight(trials: list[optuna.trial.FrozenTrial], besides: int | None = None) -> dict[str, int]:
    """Configs being measured now (`trials`, as read: the running ones count), by trials other
    than number `besides`: config key -> lowest trial number."""
    out: dict[str, int] = {}
    for frozen in trials:
        if frozen.state != TrialState.RUNNING or frozen.number == besides:
            continue
        key = frozen.user_attrs.get("config_key")
        if key and "duplicate_of_running" not in frozen.user_attrs:
            out[key] = min(out.get(key, frozen.number), frozen.number)
    return out


def tune(
    req: TuneRequest,
    on_trial: Callable[[TrialRecord], None] | None = None,
    measure: Measure | None = None,
    on_confirm: Callable[[TrialRecord, dict], None] | None = None,
    on_step: Callable[[str], None] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> StudyOutcome:
    """Run the study until it holds `req.trials` measured trials, `req.timeout_s` has passed, or
    the space is spent. Resumable: the same request continues a study where it stopped. Other
    workers may run the same request against the same storage at the same time. `on_start` hears,
    once, how many of the `req.trials` configs the study holds measured already (none, unless
    resumed or shared)."""
    measure = measure or measure_in_child(req)
    study = prepare(req, measure, on_step)
    storage = study._storage  # Optuna keeps no public handle for heartbeats in ask-and-tell
    guard = study.user_attrs.get("quality_guard")
    min_psnr_db = guard["min_psnr_db"] if req.min_psnr_db and guard else None
    n_configs = len(req.space.configs())
    deadline = time.monotonic() + req.timeout_s if req.timeout_s is not None else None  # --timeout
    unmeasured_in_a_row = 0
    twins_in_a_row = 0  # proposals of a config another worker is measuring
    measured_here = 0
    measure_disturbed_again = True  # until a second trial finds the machine still busy
    # an earlier run's reason no longer holds once this one measures (stopped by Ctrl-C, it says none)
    study.set_user_attr(STOP_REASON, None)

    while True:
        _fail_stale_trials(study)
        # One read of the storage for what this pass decides on: measured, known not to fit
        # without measuring, being measured by others, the records repair and patience judge.
        outcome = summarize(study)
        done = {}
        for record in outcome.records:
            done.setdefault(config_key(record.config), record.number)
        ruled_out = {t.user_attrs["config_key"] for t in outcome.trials
                     if t.state == TrialState.PRUNED and "dominated_by" in t.user_attrs}
        others = _in_flight(outcome.trials)
        settled = set(done) | ruled_out
        if on_start:
            on_start(len(done))
            on_start = None
        reason = _why_stop(req, outcome, len(done), len(settled), n_configs, deadline, unmeasured_in_a_row)
        if reason:
            if len(done) >= req.trials:  # what stays queued past --trials is left, not unfinished
                study.set_user_attr(LEFT_PAST_TRIALS, [t.number for t in outcome.waiting])
            break
        if others and (len(done) + len(others) >= req.trials or len(settled | set(others)) >= n_configs):
            time.sleep(1.0)  # what is left is being measured by other workers: wait for it
            continue
        if _confirmers(study):
            # another worker measures its contenders again: its rounds are timed with no trial of
            # ours beside them, as it waited for ours to end before it claimed (helper-21: one
            # searched on beside the other's confirmations)
            time.sleep(1.0)
            continue

        repairing = _queue_a_repair(req, study, outcome)
        stale = trials_since_improvement(outcome.records)
        # A repair chain improves the best only at its last step, if at all, and its root ran
        # faster than all that fits: patience waits while one has a step to measure (repairs
        # take at most repair.SHARE of the trials), and while any config waits that was queued
        # to be measured (a --warm-start given to a resumed study: stopped before it, each
        # rerun measured nothing).
        if req.patience and stale >= req.patience and not repairing and not outcome.waiting:
            reason = f"the best has not improved by 1% in the last {stale} trials (--patience {req.patience})"
            break

        with warnings.catch_warnings():
            # Optuna warns that heartbeats are meant for Study.optimize; in ask-and-tell this
            # loop records them itself (runner's tick), which is what the warning asks for.
            warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
            trial = _ask(study)
        _heartbeat(storage, trial)  # at once: a parent killed before its first tick leaves a stale trial
        trial.set_user_attr(PROCESS, storages.this_process(trial.number))
        config = req.space.suggest(trial)
        key = config_key(config)
        trial.set_user_attr("config", config)
        trial.set_user_attr("config_key", key)
        trial.set_user_attr("worker", WORKER)

        settled_as = _settle_without_measuring(req.space, study, trial, config, outcome.records)
        if settled_as is Settled.FORBIDDEN:  # says nothing of other workers: the twins' count stands
            unmeasured_in_a_row += 1
            continue
        if settled_as is Settled.BEING_MEASURED:
            # Not a config measured already (the space is not spent): another worker is measuring
            # it, and the sampler, which counts it as a bad one while it runs, may propose it
            # again. A pause, not a spin to MAX_UNMEASURED_IN_A_ROW within seconds; proposed
            # again and again, this worker waits for that trial to end (each proposal is a
            # trial in the storage).
            twins_in_a_row += 1
            twin = trial.user_attrs["duplicate_of_running"]
            time.sleep(1.0)
            while twins_in_a_row >= MAX_TWINS_IN_A_ROW and twin in _in_flight(_running(study)).values() and not _past(deadline):
                time.sleep(1.0)
                _fail_stale_trials(study)  # its worker may be gone
            continue
        twins_in_a_row = 0
        if settled_as:  # measured already, or known not to fit
            unmeasured_in_a_row += 1
            continue
        if _confirmers(study):
            # Another worker claimed the confirmation phase since the top of this pass. Its key
            # written, this trial is in flight for a claim made later, whose rounds wait for it;
            # read here, after the write, one of the two sees the other, as twins do. It steps
            # back, its config queued to be measured first once the rounds are done.
            trial.set_user_attr(STEPPED_BACK, True)
            study.tell(trial, state=TrialState.FAIL)
            _queue_again(study, trial)
            continue
        unmeasured_in_a_row = 0

        fastest = min((r.latency_s for r in outcome.records if r.feasible), default=None)
        try:
            result, measure_disturbed_again = _measure_trial(
                req, study, trial, config, measure, fastest, deadline, min_psnr_db, measure_disturbed_again)
        except KeyboardInterrupt:
            told = study._storage.get_trial(trial._trial_id)
            if on_trial and told.state == TrialState.COMPLETE:  # its first measurement stands: its line
                on_trial(record_of(told, family=req.target.family))
            raise
        if result is None or not _tell_measured(req, study, trial, result, min_psnr_db):
            continue  # given up as stale while it ran: another worker measures its config again
        measured_here += 1
        if on_trial:
            on_trial(record_of(study.trials[trial.number], family=req.target.family))

    confirmed_here = 0

    def count_confirmation(record: TrialRecord, entry: dict) -> None:
        nonlocal confirmed_here
        confirmed_here += 1
        if on_confirm:
            on_confirm(record, entry)

    study.set_user_attr(STOP_REASON, reason)  # for `autotune export`, which cannot tell
    if req.confirm_rounds:
        confirm_contenders(req, study, measure, count_confirmation, deadline)
    outcome = summarize(study, reason, guard_asked=bool(req.min_psnr_db))
    outcome.measured_here = measured_here
    outcome.confirmed_here = confirmed_here
    return outcome


def _why_stop(req: TuneRequest, outcome: StudyOutcome, n_done: int, n_settled: int, n_configs: int,
              deadline: float | None, unmeasured_in_a_row: int) -> str | None:
    """Why the search stops before asking for another trial (None: it goes on): enough measured
    trials, the space spent (measured, or known not to fit), --timeout, or a sampler that keeps
    proposing what needs no measurement. (--patience is judged after a repair is queued.)"""
    if n_done >= req.trials:
        reason = f"{count(n_done, 'trial')} measured (--trials {req.trials})"
        waiting = outcome.waiting
        if waiting:  # a --warm-start given to a study that holds its trials: not lost, said
            reason += f"; {count(len(waiting), 'queued config')} not measured: raise --trials to measure them"
        return reason
    if n_settled >= n_configs:
        return f"every one of the space's {n_configs} configurations is measured or known not to fit"
    if _past(deadline):
        return f"--timeout {req.timeout_s:g} s reached"
    if unmeasured_in_a_row >= MAX_UNMEASURED_IN_A_ROW:
        return "the sampler keeps proposing configurations measured already, forbidden or known not to fit"
    return None


def _settle_without_measuring(space: SearchSpace, study: optuna.Study, trial: optuna.Trial, config: Config,
                              records: list[TrialRecord]) -> Settled | None:
    """Tell the trial of a config that needs no measurement, and say why: forbidden by the
    space's rules, being measured by another worker now, measured already (the earlier result,
    as a duplicate), known not to fit (it saves less memory than a config that ran out of it;
    `records`: the measured trials as this pass read them). None: measure it."""
    forbidden = space.forbidden(config)
    if forbidden:
        _record(trial, BROKEN)
        trial.set_user_attr("forbidden", forbidden)
        study.tell(trial, state=TrialState.PRUNED)
        return Settled.FORBIDDEN
    key = config_key(config)
    # Another worker may have drawn the same config a moment ago. Each writes its key before
    # it looks (tune), so of two racing trials the one that wrote later sees the other, and
    # steps back; its number says nothing about when it wrote. When both wrote before either
    # looked, both step back, and the config is proposed again later.
    twin = _in_flight(_running(study), besides=trial.number).get(key)
    if twin is not None:
        trial.set_user_attr("duplicate_of_running", twin)
        study.tell(trial, state=TrialState.FAIL)  # samplers ignore failed trials
        return Settled.BEING_MEASURED
    # Read the measured configs again, after the running ones: a twin that finished since the
    # pass's read is running no more, and only this second read sees it done.
    done = _measured(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    if key in done:
        earlier = study.trials[done[key]]
        trial.set_user_attr("result", earlier.user_attrs["result"])
        _record(trial, **stored_violations(earlier))
        trial.set_user_attr("duplicate_of", earlier.number)
        study.tell(trial, earlier.value)
        return Settled.MEASURED
    # this pass's read: a trial another worker ends meanwhile counts next pass
    dominated_by = memory_dominated(config, records)
    if dominated_by is not None:
        _record(trial, memory=dominated_by.violations.get("memory", BROKEN))  # > 0: ran out
        trial.set_user_attr("dominated_by", dominated_by.number)
        study.tell(trial, state=TrialState.PRUNED)
        return Settled.KNOWN_NOT_TO_FIT
    return None


def _measure_trial(req: TuneRequest, study: optuna.Study, trial: optuna.Trial, config: Config, measure: Measure,
                   fastest: float | None, deadline: float | None, min_psnr_db: float | None,
                   measure_disturbed_again: bool) -> tuple[dict | None, bool]:
    """Measure a trial's config in a child (again, once, where busy neighbours may have cost it
    the race), beating the trial's heartbeat meanwhile. Returns (its result, whether a disturbed
    trial is still worth measuring again); the result is None where the trial was given up as
    stale meanwhile. A Ctrl-C fails the trial and queues its config again, for the same command
    to measure it first; one during a second measurement records the first."""
    storage = study._storage
    trial_dir = req.workdir / f"trial-{trial.number:05d}"
    cut_above_s = CUT_SLOWER_THAN * fastest if fastest else None
    request = req.trial_request(config, trial_dir / "output.npy", cut_above_s=cut_above_s)
    result = None
    try:
        result = measure(request, trial_dir, lambda: _heartbeat(storage, trial))
        if _timed_quiet(result):
            measure_disturbed_again = True  # the neighbour has left: a later disturbed trial is worth a second
        if measure_disturbed_again and not _past(deadline) and _disturbed_out_of_the_running(result, fastest, req) \
                and not _below_the_guard(result, req, min_psnr_db):
            again = trial_dir / "again"
            request = req.trial_request(config, again / "output.npy", cut_above_s=cut_above_s)
            second = measure(request, again, lambda: _heartbeat(storage, trial))
            # still disturbed (or failed: no sign it left): a second trial each would double the run
            measure_disturbed_again = _timed_quiet(second)
            result = _less_disturbed(result, second)
    except KeyboardInterrupt:
        # The child is dead already (runner killed its group).
        if storage.get_trial(trial._trial_id).state == TrialState.RUNNING:  # else: given up
            if result is not None:  # stopped in its second measurement: the first stands, said so
                _tell_measured(req, study, trial, {**result, worker.SECOND_TRIAL_STOPPED: True}, min_psnr_db)
            else:
                study.tell(trial, state=TrialState.FAIL)
                _queue_again(study, trial)
        raise
    except optuna.exceptions.UpdateFinishedTrialError:
        # A heartbeat found the trial given up: this process was paused past the grace period
        # (Ctrl-Z, a frozen VM) and another worker failed it and queued its config again.
        # The runner killed the child; the retry measures the config.
        return None, measure_disturbed_again
    return result, measure_disturbed_again


def _tell_measured(req: TuneRequest, study: optuna.Study, trial: optuna.Trial, result: dict,
                   min_psnr_db: float | None) -> bool:
    """Record a measured trial: its quality against the reference, its constraints, its latency
    told to the sampler. False where it was given up as stale while it ran (no heartbeat could
    say so). A baseline that did not load stops the run (ModelLoadError): every config starts
    from that pipeline."""
    if trial.user_attrs.get("baseline") and did_not_load(result):
        # Queued again: once the model is mended, the same command measures it first.
        study.tell(trial, state=TrialState.FAIL)
        _queue_again(study, trial)
        raise model_did_not_load(result, f" (the baseline, trial {trial.number})")
    if min_psnr_db and "quality" not in result:  # assessed already where _below_the_guard read it
        result["quality"] = quality.assess(result, req.reference_path)
    if result.get("output"):  # the PNG stays; the full-precision array was only for assess
        Path(result.pop("output")).unlink(missing_ok=True)
    try:
        trial.set_user_attr("result", result)
        _record(
            trial,
            memory=violation(result, req.budget_bytes, req.margin_bytes),
            quality=quality.violation(result.get("quality"), min_psnr_db),
        )
        latency = result.get("latency_s")
        study.tell(trial, latency if result["status"] == worker.OK else math.inf)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    return True


# ---- confirmation ---------------------------------------------------------------------------------
CONFIRMATIONS = "confirmations"  # study user attr: {trial number: [confirmation, ...]}
CONTENDERS = 3  # the fastest feasible configs that are measured again
# A config this much slower than the best in its one measurement is not a contender. On the
# 2-core VMs this was built on, one config's separate trials drifted by up to 36%.
CONTENDER_WITHIN = 0.5


def contenders(outcome: StudyOutcome) -> list[TrialRecord]:
    """The feasible configs that could be the fastest once measured again (fastest in the search
    first), and the baseline when it is feasible and that close: the config kept when no other
    is faster beyond the noise (`choose_best`). The baseline also when other processes took its
    cores while it was timed: its figure sets every speedup the study reports."""

    def first(record: TrialRecord) -> float:  # the search's measurement: the same set on a resume
        return record.result["latency_s"]

    feasible = sorted((r for r in outcome.records if r.feasible), key=first)
    if not feasible:
        return []
    limit = first(feasible[0]) * (1 + CONTENDER_WITHIN)
    chosen = [r for r in feasible if first(r) <= limit][:CONTENDERS]
    base = outcome.baseline
    if base and base.number not in {r.number for r in chosen}:
        if base.feasible and first(base) <= limit or base.status == worker.OK and busy_cores(base.result):
            chosen.append(base)
    # Measured again, contenders' figures rise (the lowest of many noisy measurements is biased
    # low): a config left out on its one figure may now beat them all. It is measured again too,
    # else it would sit on the profile's Pareto front faster than the pick on evidence that
    # confirmation discounted, and a smaller budget would pick it.
    # Of the feasible: a baseline over the budget, here for its figure, sets no bar (its
    # quiet median kept a faster config off the pick and left it alone on the front; helper-12).
    medians = [r.latency_s for r in chosen if r.confirmations and r.feasible]
    if medians:
        taken = {r.number for r in chosen}
        chosen += [r for r in feasible if r.number not in taken and first(r) < min(medians)]
    # A config timed only while other processes took its cores may have run many times slower
    # than it does (a bfloat16 seed timed at 8.4 s beside a test suite ran 0.46 s quiet, and the
    # baseline was picked): its one figure does not rule it out. The seeds first (what this machine
    # is expected to run fastest), then the fastest figures; CONTENDERS of them at most.
    taken = {r.number for r in chosen}
    disturbed = sorted((r for r in feasible if r.number not in taken and busy_cores(r.result)),
                       key=lambda r: (not r.seeded, first(r)))
    return chosen + disturbed[:CONTENDERS]


def _knobs_changed(config: Config) -> str:
    return f"{count(changes(config), 'knob')} changed"


def choose_best(feasible: list[TrialRecord]) -> tuple[TrialRecord | None, str | None]:
    """The study's pick, and why when it is not the lowest median.

    Without confirmations: the lowest latency. With them: the confirmed config with the lowest
    median, unless a confirmed config that changes fewer knobs from the default has a median no
    higher than that config's slowest trial (of its quiet ones: TrialRecord.quiet_trials); then
    the one that changes fewest (then the lowest median). A difference inside the fastest config's own spread is not evidence, and each knob
    set has costs of its own (cold start, one more thing a driver or library update can break).
    This is the one-standard-error rule of model selection, with the observed range in place of
    a standard error: on this project's 2-core VMs the trials of one config drifted by up to 36%,
    and a float32 config picked for a lower median ran 1.10x the default's latency measured
    alternately. What the choice can cost is bounded by the fastest config's own spread.
    A config faster than every confirmed median that was not measured again (confirmation cut
    short by --timeout, or a resume with --confirm 0) is the pick on its one figure
    (choice.pick): else the pick would stand off the front, slower than a point beside it."""
    if not feasible:
        return None, None
    # the spread of its quiet trials: a trial timed beside busy neighbours widened it to 3x the
    # median, and kept the float32 default over a config faster in both of its quiet trials
    best = pick(feasible, lambda r: r.latency_s, lambda r: r.quiet_latencies_s, lambda r: r.config,
                confirmed=lambda r: bool(r.confirmations))
    fastest = min(feasible, key=lambda r: r.latency_s)
    if best is fastest:
        return best, None
    return best, (
        f"kept trial {best.number} ({_knobs_changed(best.config)}, median {best.latency_s:.3f} s) "
        f"over trial {fastest.number} ({_knobs_changed(fastest.config)}, median {fastest.latency_s:.3f} s, "
        f"slowest trial {max(fastest.quiet_latencies_s):.3f} s): the difference is within the faster one's own spread"
    )


def confirm_contenders(
    req: TuneRequest,
    study: optuna.Study,
    measure: Measure,
    on_confirm: Callable[[TrialRecord, dict], None] | None = None,
    deadline: float | None = None,
) -> None:
    """Measure the contenders again in fresh trials, `req.confirm_rounds` times each, in
    alternation so that a drift of the machine hits them alike. The study's pick is then made on
    each config's median over its trials, not on the lowest single measurement, which among many
    noisy ones is biased low (on this project's CPU machines a single fast measurement of a
    float32 config beat the default by 19%; measured again, it was 4% slower). Kept in the study,
    so an interrupted confirmation resumes where it stopped. In a shared study it starts once no
    other worker's trial is running, and one worker at a time confirms (`_claim_confirmation`);
    the others wait, so that every worker reports the same pick and no two confirmations run at
    once. No round starts after `deadline` (time.monotonic(); --timeout): the pick is then made
    among the configs confirmed by then, unless one not measured again is faster (choose_best)."""
    while True:
        _fail_stale_trials(study)  # a worker that died frees its trial or its claim
        if _past(deadline) or not _unconfirmed(study, req.confirm_rounds):
            return
        claim = None if _in_flight(_running(study)) else _claim_confirmation(study)
        if claim is None:
            time.sleep(1.0)  # another worker's trial or confirmation is running
            continue
        try:
            _confirm_while_held(req, study, measure, claim, on_confirm, deadline)
        finally:
            # not a measurement: samplers ignore failed trials; another worker may have failed it
            # as stale already (a paused process), which only means it was given up
            study.tell(claim, state=TrialState.FAIL, skip_if_finished=True)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _confirm_while_held(req, study, measure, claim, on_confirm, deadline=None) -> None:
    """Measure the next unconfirmed (contender, round) until none is left or the claim was lost.
    The list is read again after each: a contender that a confirmation made infeasible drops out,
    and the next one comes in, as on a resumed run. A round may stop after its warm calls
    (_round_cut)."""
    storage = study._storage
    lost = []

    def tick() -> None:
        try:
            _heartbeat(storage, claim)
        except optuna.exceptions.UpdateFinishedTrialError:
            lost.append(True)  # failed as stale by another worker: it confirms now

    while not lost and not _past(deadline) and (slots := _unconfirmed(study, req.confirm_rounds)):
        # A worker that read no claim a moment before this one claimed may have started a trial
        # since: each round waits for such trials to end (searching workers wait for the claim)
        while _in_flight(_running(study)) and not lost and not _past(deadline):
            tick()
            time.sleep(1.0)
            _fail_stale_trials(study)
        if lost or _past(deadline):
            return
        record, round_, cut_above_s = slots[0]
        trial_dir = req.workdir / f"confirm-{record.number:05d}-{round_}"
        # no output kept: the trial's first output was assessed already
        result = measure(req.trial_request(record.config, confirmation=round_ + 1, cut_above_s=cut_above_s),
                         trial_dir, tick)
        if lost or study._storage.get_trial(claim._trial_id).state != TrialState.RUNNING:
            return  # the claim went to another worker, who measures this round again
        entry = {
            "latency_s": result.get("latency_s") if result["status"] == worker.OK else None,
            "p90_s": result.get("p90_s") if result["status"] == worker.OK else None,
            "peak_memory_bytes": result.get("peak_memory_bytes"),
            "status": result["status"],
            # why it failed, for the console's line and a later reading of the study
            **({"error": str(result.get("error", ""))[:300]} if result["status"] != worker.OK else {}),
            **{k: result[k] for k in (worker.OUT_OF_MEMORY_ON, worker.HELD_WITHIN_BUDGET) if k in result},
            "violation": violation(result, req.budget_bytes, req.margin_bytes),
            "cores_taken_by_others": result.get("cores_taken_by_others"),
            "cold_start_s": result.get("cold_start_s"),  # a profile's figures come from quiet trials
            "spread": result.get("spread"),
            **({"cut_short": result["cut_short"]} if result.get("cut_short") else {}),
            **({"software": result["software"]} if "software" in result else {}),  # software_note
        }
        confirmed = study.user_attrs.get(CONFIRMATIONS, {})
        confirmed.setdefault(str(record.number), []).append(entry)
        study.set_user_attr(CONFIRMATIONS, confirmed)
        if on_confirm:
            on_confirm(record, entry)


def _unconfirmed(study: optuna.Study, rounds: int) -> list[tuple[TrialRecord, int, float]]:
    """(contender, round, the round's cut: _round_cut) still to measure, round by round, fastest
    first within a round."""
    candidates = contenders(summarize(study))
    if len(candidates) < 2:
        return []  # nothing to choose between
    confirmed = study.user_attrs.get(CONFIRMATIONS, {})
    fastest = min(min(r.latencies_s) for r in candidates)  # each ran (a baseline over the budget too)
    quiet_seen = any(r.quiet_medians_s for r in candidates)
    wanted = {r.number: _rounds_of(r, rounds, quiet_seen) for r in candidates}
    return [(record, round_, _round_cut(record, fastest)) for round_ in range(max(wanted.values()))
            for record in candidates if round_ < wanted[record.number]
            and _rounds_done(confirmed.get(str(record.number), []), wanted[record.number]) <= round_]


UNDER_LOAD_ROUNDS = 4  # the confirmation rounds a contender timed under load in every trial may get


def _rounds_of(record: TrialRecord, rounds: int, quiet_seen: bool = False) -> int:
    """The confirmation rounds a contender gets: `rounds`, and two at least for one whose search
    trial was timed beside busy neighbours. Its median over two trials would be the mean of its
    disturbed figure and its quiet one (8.4 and 0.46 s: 4.43 s, and the default was picked).
    One timed under load in every trial so far, where another contender was timed quiet
    (`quiet_seen`: the load comes and goes), gets one more round for each of its trials timed
    under load (its search trial's included), until one is quiet, UNDER_LOAD_ROUNDS in all at most
    (or `rounds`, if more): its figures were all slowed, and its rivals' were not (in a run whose
    load came and went, bfloat16 + fused QKV + channels_last was timed at 4.7-11.4 s in each of
    its trials, and could not be picked over bfloat16 alone, timed quiet once at 0.47 s). Rounds
    that failed or found the machine short of memory add none. A round is cut at twice the lower
    of its own figure and the contenders' (_round_cut): the baseline's at its own, which under load
    lets its added rounds run longer. On a machine never quiet no round is added."""
    if not rounds:
        return 0
    wanted = max(rounds, 2) if busy_cores(record.result) else rounds
    if quiet_seen and not record.quiet_medians_s:
        wanted = max(wanted, min(len(record.under_load_medians_s), UNDER_LOAD_ROUNDS))
    return wanted


def _round_cut(record: TrialRecord, fastest: float) -> float:
    """The bound a confirmation round of `record` stops at after its warm calls, as a slow search
    trial does (worker.trial_request's cut_above_s): CUT_SLOWER_THAN times the lower of its own
    fastest figure and the contenders' (`fastest`). Beside a busy neighbour, rounds ran to their
    last timed call, 10 s a call, for figures their medians left aside; and a config timed only
    under load has no figure of its own to bound it by. The baseline's own alone: its figure sets
    every speedup the study reports, and it may be many times the fastest."""
    own = min(record.latencies_s)
    return CUT_SLOWER_THAN * (own if record.baseline else min(own, fastest))


def _rounds_done(entries: list[dict], rounds: int) -> int:
    """Confirmation rounds a contender has had: a round stopped because other processes took the
    machine's memory (worker.machine_was_short) judged nothing, and is measured again, up to
    `rounds` such rounds (a machine that stays short does not hold the phase for ever)."""
    short = sum(worker.machine_was_short(e) for e in entries)
    return len(entries) - short if short < rounds else len(entries)


CONFIRMER = "confirmer"  # user attr of the trial that holds a shared study's confirmation phase
STEPPED_BACK = "stepped_back_for_confirmation"  # user attr of a trial that met another's claim
WITHDRAWN = "withdrawn"  # user attr of a claim that lost the race to another worker's


def _confirmers(study: optuna.Study) -> list[int]:
    return sorted(t.number for t in _running(study)
                  if CONFIRMER in t.user_attrs)


def _claim_confirmation(study: optuna.Study) -> optuna.Trial | None:
    """A running trial that says this worker confirms now, or None when another worker holds
    one. Optuna storages have no lock, but they create a trial, its number and its attributes
    in one write: of two racing claims the later-numbered one sees the other and withdraws. The
    claim carries no config and keeps heartbeats like a trial; a worker killed while confirming
    leaves it stale, and the next worker to look fails it and goes on."""
    if _confirmers(study):
        return None
    storage = study._storage
    template = optuna.trial.create_trial(
        state=TrialState.RUNNING,
        # the journal's heartbeat is an attribute: written with the claim, never missing
        user_attrs={CONFIRMER: WORKER, "heartbeat_at": time.time()},
        # A full retry history: the stale-trial callback must not queue a claim again as a trial.
        system_attrs={"retry_history": [-1] * (storages.MAX_RETRIES + 1)},
    )
    trial = optuna.Trial(study, storage.create_new_trial(study._study_id, template_trial=template))
    _heartbeat(storage, trial)  # RDB storages: their own heartbeat table
    trial.set_user_attr(PROCESS, storages.this_process(trial.number))
    if _confirmers(study)[0] != trial.number:
        trial.set_user_attr(WITHDRAWN, True)  # never held the phase: no bar on a report's timeline
        study.tell(trial, state=TrialState.FAIL)
        return None
    return trial
