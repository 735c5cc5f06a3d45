"""Compare studies: charts, a table and an HTML page from several studies or profiles.

    from autotune import report
    studies = report.load("A@sqlite:///autotune-studies/studies.db tiny-sdxl-2GB.yaml")
    report.plot_fronts(studies)            # a matplotlib Figure: feasible Pareto fronts, budgets
    report.write_report(studies, "out/")   # every chart as PNG, and index.html listing them

A source is `NAME@STORAGE_URL` (one study; in a string of several, quoted where the name holds
spaces), a bare storage URL (every study in it), a SQLite or journal file (the same as its URL),
or a profile file (its best, baseline and front; its study's
trials too when the storage it names is found). A file or study given twice is compared once.
The notebook notebooks/compare_studies.ipynb calls these functions; so does `autotune report`.

Charts are `matplotlib.figure.Figure` objects (None where no study has a measurement) made
without pyplot: no global state, no GUI backend, and each drawn artist carries a gid ("front:LABEL",
"trial:LABEL:NUMBER:CLASS", ...) so scripts and tests can read back what was drawn.
"""

from __future__ import annotations

import functools
import html
import os
import shlex
import statistics
import textwrap
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from . import worker
from .choice import pareto_front
from .console import RULED_OUT_SAID, config_changes, count
from .errors import AutotuneError, os_reason
from .sizes import parse_margin, smallest_budget
from .storages import (DEFAULT_WORKDIR, HEARTBEAT_S, WORKDIR_HINT, as_storage_url, check_file, check_url,
                       default_storage, display_url, export_command, is_masked, is_storage_url, open_storage,
                       storage_file, study_and_storage, with_storage_file)

DEFAULT_REPORT_DIR = "autotune-report"  # beside autotune-studies/, in the current folder
MIN_IMPORTANCE_TRIALS = 4  # measured (ok) trials needed before ranking knobs means anything
# A figure that ranges less than this over a study's trials is not ranked: a floor, within the
# noise between trials of one config (peak memory 0.8-3.9% on the tiny models, 5-6% in a tiny-flux
# run, glibc's placement of freed blocks; latency medians 2.9-36%:
# benchmarks/results/measurement_stability.md). PED-ANOVA ranks by order, however small the gaps.
IMPORTANCE_NOISE = 0.05
# What the importance bars say, under them: PED-ANOVA compares a knob's values in the best trials
# with its values in all of them, which is not what the knob gains.
IMPORTANCE_READING = ("A knob ranks by how its values in the best trials differ from its values in all: one most "
                      "trials share (bfloat16, once the seeds find it fast) ranks low however much it gains; "
                      "the speedups chart says what the pick gains over the default.")
DPI = 100

# Timeline classes, in legend order: how each trial ended.
CLASS_COLORS = {
    worker.OK: "#2ca02c",
    "over budget": "#ff7f0e",
    "low quality": "#bcbd22",  # ran, but its output is too far from the float32 reference
    "failed again": "#ad494a",  # ran and fit, but a confirmation of it failed (crashed, timed out, host memory)
    "forbidden now": "#8c6d31",  # ran and fit under an earlier autotune, whose rules this one tightened
    worker.OUT_OF_MEMORY: "#d62728",
    worker.UNSUPPORTED: "#7f7f7f",
    worker.COMPILE_ERROR: "#9467bd",
    worker.NAN_OUTPUT: "#8c564b",
    worker.BLANK_OUTPUT: "#a0522d",
    worker.ERROR: "#800000",
    worker.TIMEOUT: "#e377c2",
    worker.CRASHED: "#000000",
    "interrupted": "#555555",
    "duplicate": "#c7c7c7",
    "forbidden": "#dbdb8d",
    "known not to fit": "#f7b6d2",  # a config that saves less memory than one that ran out of it
    "confirmation": "#1f77b4",  # the confirmation phase: contenders measured again, in alternation
}
# How a class is said in the legend and the overview: "ok" beside "ok 16" on the console (every
# trial that ran) would read as the same count; a study's confirmation phase is one bar, its
# trials counted beside it.
CLASS_NAMES = {worker.OK: "ran and fits", "confirmation": "confirmation phase", "failed again": "failed when measured again"}
# timeline bars that are not the search's measurements: an interrupted trial's config is queued
# again and measured in a later trial
NOT_MEASURED = ("duplicate", "forbidden", "known not to fit", "confirmation", "interrupted")
FAILURES = worker.FAILED_STATUSES


class ReportError(AutotuneError):
    """A source cannot be read: a missing storage, an unknown study, a bad profile."""


# ---- the data -----------------------------------------------------------------------------------
@dataclass
class Point:
    """One measurement: a configuration's latency and peak memory."""

    trial: int | None
    config: dict
    latency_s: float | None
    peak_memory_bytes: int | None
    status: str = worker.OK
    feasible: bool = True
    baseline: bool = False
    result: dict = field(default_factory=dict)
    ruled_out_otherwise: str | None = None  # TrialRecord's: below the quality guard, or failed again


@dataclass
class Span:
    """One trial on the timeline: seconds since the study's first trial started."""

    trial: int
    start_s: float
    end_s: float
    kind: str  # a CLASS_COLORS key
    cut: bool = False  # given up as stale, no heartbeat recorded: drawn to the next trial's start


@dataclass
class StudyData:
    label: str
    name: str
    storage: str | None
    model: dict
    workload: dict
    device: str
    budget_bytes: int | None
    margin: str = "0"  # as given (5%, 512MB): at another budget a share is another size
    points: list[Point] = field(default_factory=list)  # measured trials (no duplicates)
    front: list[Point] = field(default_factory=list)  # feasible Pareto front, by memory
    best: Point | None = None
    baseline: Point | None = None
    timeline: list[Span] = field(default_factory=list)
    measured_again: int = 0  # the confirmation phase's trials: contenders measured again
    choice_note: str | None = None  # why a simpler config was kept over a lower median (study.choose_best)
    source: str = "study"  # or "profile"
    origin: str = ""  # the profile file's name, for a profile
    image_root: Path | None = None  # where relative result["image"] paths start
    notes: list[str] = field(default_factory=list)
    no_best: str | None = None  # StudyOutcome.why_no_best's words, for a study without a best
    trials: list = field(default_factory=list, repr=False)  # measured optuna FrozenTrials

    @property
    def speedup(self) -> float | None:
        if self.best and self.baseline and self.baseline.latency_s and self.best.latency_s:
            return self.baseline.latency_s / self.best.latency_s
        return None

    @property
    def measured(self) -> bool:
        """Whether any configuration ran and was timed: a study stopped (Ctrl-C) before its first
        trial ended, or whose every trial timed out or ran out of memory, has nothing to draw and
        is left out of the charts."""
        return any(p.status == worker.OK and p.latency_s for p in self.points)

    def why_no_best(self) -> str:
        """Why the study has no best configuration, in the words of the CLI's error."""
        return self.no_best or "no trial completed a measurement"

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(span.kind for span in self.timeline))


def _point(record) -> Point:
    return Point(
        trial=record.number, config=record.config, latency_s=record.latency_s,
        peak_memory_bytes=record.peak_memory_bytes, status=record.status,
        feasible=record.feasible, baseline=record.baseline, result=record.result,
        ruled_out_otherwise=record.ruled_out_otherwise,
    )


def _profile_point(p: dict | None, baseline: bool = False) -> Point | None:
    if not p:
        return None
    return Point(trial=p.get("trial"), config=p["config"], latency_s=p["latency_s"],
                 peak_memory_bytes=p["peak_memory_bytes"], baseline=baseline, result=dict(p))


def trial_class(frozen, record=None) -> str | None:
    """How a trial ended, for the timeline; None for one still running or waiting. `record`: the
    trial as the study's summary reads it (study.record_of), its confirmations included: a trial
    whose config went over the budget or failed when measured again is classed so, as the summary
    rules it out, not as its own measurement alone would have it."""
    from optuna.trial import TrialState

    from .study import CONFIRMER, WITHDRAWN, record_of

    if CONFIRMER in frozen.user_attrs:  # a worker's claim on the confirmation phase: start to end
        return None if frozen.user_attrs.get(WITHDRAWN) else "confirmation"
    if frozen.user_attrs.get("duplicate_of_running") is not None:
        return "duplicate"  # of a config another worker was measuring: told FAIL, measured nothing
    if frozen.state == TrialState.PRUNED:  # a proposal not measured: study._why_not_measured's words
        return "known not to fit" if "dominated_by" in frozen.user_attrs else "forbidden"
    if frozen.state == TrialState.FAIL:
        return "interrupted"
    if frozen.state != TrialState.COMPLETE:
        return None
    attrs = frozen.user_attrs
    if attrs.get("duplicate_of") is not None:
        return "duplicate"
    result = attrs.get("result")
    if not result:
        return "error"
    if result["status"] == worker.OK:
        ruled_out_by = (record or record_of(frozen)).ruled_out_by
        return RULED_OUT_SAID[ruled_out_by].timeline if ruled_out_by else worker.OK
    return result["status"] if result["status"] in CLASS_COLORS else "error"


def _timeline(trials, records=()) -> list[Span]:
    """The trials as timeline bars; `records`: the study's TrialRecords (study.summarize), which
    class a trial by its confirmations too."""
    by_number = {r.number: r for r in records}
    starts = [t.datetime_start for t in trials if t.datetime_start]
    if not starts:
        return []
    t0: datetime = min(starts)
    # Optuna's retry of a trial given up as stale lists it (RetryHeartbeatStaleTrialCallback;
    # "failed_trial" names only the first of a chain of retries)
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    spans = []
    for t in trials:
        kind = trial_class(t, by_number.get(t.number))
        if kind is None or not t.datetime_start or not t.datetime_complete:
            continue
        end, cut = t.datetime_complete, False
        if kind == "interrupted" or kind == "confirmation" and _beat_since_start(t):
            end, cut = _stale_end(t, retried, starts)
        spans.append(Span(t.number, (t.datetime_start - t0).total_seconds(), (end - t0).total_seconds(), kind, cut))
    return spans


def _beat_since_start(t) -> bool:
    """Whether a trial's heartbeat_at moved after its start: a journal storage's confirming claim
    beats there (an RDB storage's beats in Optuna's own table, and heartbeat_at stays its start)."""
    beat = t.user_attrs.get("heartbeat_at")
    return beat is not None and beat > t.datetime_start.timestamp() + 1


def _stale_end(t, retried: set, starts: list[datetime]) -> tuple[datetime, bool]:
    """Where a failed trial ended, and whether that is a guess (cut). A trial whose run was
    killed (SIGKILL) stays RUNNING until a later run gives it up as stale: its datetime_complete
    is that later moment, and its bar overlapped the later run's trials. It ended at its last
    heartbeat where one is recorded (heartbeat_at: journal storages); else it is cut at the next
    trial's start, which its killed run did not make (the latest it can have ended, alone)."""
    beat = t.user_attrs.get("heartbeat_at")
    complete = t.datetime_complete
    if beat is not None and complete.timestamp() - beat > 2 * HEARTBEAT_S:  # dead before failed
        return min(max(datetime.fromtimestamp(beat), t.datetime_start), complete), False
    if t.number not in retried or beat is not None:
        return complete, False  # stopped by its own run (Ctrl-C): failed as it ended
    return min([complete, *(s for s in starts if s > t.datetime_start)]), True


def _checked(check, *args, **kwargs):
    """`check`'s answer, its AutotuneError as a ReportError."""
    try:
        return check(*args, **kwargs)
    except AutotuneError as exc:
        raise ReportError(str(exc)) from None


def _open_storage(url: str):
    return _checked(open_storage, url, existing=True)  # a missing file is an error, not created


def load_study(url: str, name: str, label: str | None = None, storage=None) -> StudyData:
    """One study of a storage, as measured: points, front, best, baseline, timeline.
    `storage`: the storage of `url` opened already (a report reading several of its studies)."""
    import optuna

    from .study import check_stored_request, summarize, unfinished

    if storage is None:
        storage = _open_storage(url)
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        known = [s.study_name for s in storage.get_all_studies()]
        raise ReportError(f"storage {display_url(url)}: no study named '{name}' (it holds: "
                          f"{', '.join(known) or 'none'})") from None
    request = study.user_attrs.get("request")
    if not isinstance(request, dict):
        raise ReportError(f"storage {display_url(url)}: study '{name}' was not made by autotune "
                          "(it records no request)")
    try:
        check_stored_request(request)
    except ValueError as exc:
        raise ReportError(f"storage {display_url(url)}: study '{name}': its stored request is malformed: {exc}") from None
    margin = request.get("margin")
    margin = "0" if margin in (None, "") else str(margin)
    outcome = summarize(study, guard_asked=bool(request.get("min_psnr_db")))
    measured = {r.number for r in outcome.records}
    trials = outcome.trials
    path = storage_file(url)
    data = StudyData(
        label=label or "", name=name, storage=url, model=request.get("model", {}),
        workload=request.get("workload", {}), device=request.get("device", "?"),
        budget_bytes=request.get("budget_bytes"), margin=margin,
        points=[_point(r) for r in outcome.records], front=[_point(r) for r in outcome.front],
        best=_point(outcome.best) if outcome.best else None,
        baseline=_point(outcome.baseline) if outcome.baseline else None,
        timeline=_timeline(trials, outcome.records),
        measured_again=sum(len(r.confirmations) for r in outcome.records),
        choice_note=outcome.choice_note,
        image_root=path.resolve().parent if path else None,
        trials=[t for t in trials if t.number in measured],
    )
    if outcome.best is None:  # the CLI's words, for the note, the table and the speedups chart
        data.no_best = outcome.why_no_best(data.budget_bytes or 0, parse_margin(margin, data.budget_bytes or 0), data.margin)[1]
        data.notes.append(f"{name}: {data.why_no_best()}" + ("" if data.measured else " (left out of the charts)"))
    if outcome.ruled_out_note:  # the summary's note: why a pick may differ from an earlier one
        data.notes.append(f"{name}: {outcome.ruled_out_note}")
    if outcome.software_note:  # a study resumed after an upgrade: its latencies compare versions too
        data.notes.append(f"{name}: {outcome.software_note}")
    left = unfinished(study)
    if left:  # stopped (Ctrl-C), or running now: its figures are those of a study half done
        data.notes.append(f"{name}: unfinished ({left}); its figures are as they stand, and the command "
                          "that ran it measures the rest")
    return data


def load_profile_source(path: str | Path, label: str | None = None) -> StudyData:
    """A profile's best, baseline and front; the trials of its study when its storage is found
    (a relative SQLite or journal path is tried from the profile's folder and from here: the
    first that holds its study)."""
    from .profile import load_profile

    path = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a profile from another machine is the point of comparing
        profile = load_profile(path)
    d = profile.data
    study = d.get("study") or {}
    data = StudyData(
        # the storage it was read from, once its study is (keys the de-duplication in `load`:
        # two machines' profiles may record one relative storage path and one study name)
        label=label or "", name=study.get("name") or path.stem, storage=None,
        model=d["model"], workload=d["workload"], device=d["machine"].get("device", "?"),
        budget_bytes=d["budget"]["memory_bytes"], margin=profile.margin, front=[_profile_point(p) for p in d["pareto"]], best=_profile_point(d["best"]),
        baseline=_profile_point(d.get("baseline"), baseline=True), source="profile", origin=path.name,
        choice_note=study.get("choice"),
    )
    if data.baseline:  # the front and best fit by construction; the baseline may not
        data.baseline.feasible = profile.fits(data.baseline.peak_memory_bytes)
    candidates = _storage_candidates(study.get("storage"), path.parent)
    if candidates and study.get("name"):
        failures = []
        for url in candidates:
            try:
                measured = load_study(url, study["name"])
            except ReportError as exc:
                failures.append(str(exc))
                continue
            if not _measured_there(data.best, measured.trials):
                # the same command run elsewhere makes the same study name: a relative storage
                # path read from another folder, or another machine's copy, holds another run
                failures.append(f"{display_url(url)} holds another run of study {study['name']} (its trial "
                                f"{data.best.trial} is not the profile's best)")
                continue
            data.points, data.timeline, data.trials = measured.points, measured.timeline, measured.trials
            data.measured_again = measured.measured_again
            data.image_root, data.storage = measured.image_root, url
            picked = measured.best.trial if measured.best else None
            if data.best.trial is not None and picked != data.best.trial:
                # measured on after the profile was written (a resume, a worker, confirmations):
                # the charts show the study's trials beside a best it no longer picks
                now = f"trial {picked} ({measured.best.latency_s:.3f} s)" if measured.best else "no configuration"
                data.notes.append(f"{path.name}: its study picks {now} now, not the profile's trial {data.best.trial} "
                                  f"({data.best.latency_s:.3f} s): it was measured further after the profile was "
                                  f"written; {export_command(study['name'], url)} writes its pick")
            elif data.best.trial is not None:
                own = next((p for p in measured.points if p.trial == data.best.trial), None)
                if own and own.latency_s != data.best.latency_s:
                    data.notes.append(f"{path.name}: its best's median ({data.best.latency_s:.3f} s) is not its study's "
                                      f"for trial {data.best.trial} ({own.latency_s:.3f} s): edited by hand, or "
                                      "measured again since")
            break
        else:
            data.notes.append(f"{path.name}: trials not shown ({'; '.join(failures)})")
    elif is_masked(str(study.get("storage"))):  # the profile records no password: trying *** could lock the account
        data.notes.append(f"{path.name}: its study storage {study.get('storage')} is recorded without its password: "
                          "front and best from the profile only; give NAME@STORAGE_URL for its trials")
    else:
        where = (f"its study storage {display_url(str(study['storage']))} is not here" if study.get("storage")
                 else "it records no study storage")
        data.notes.append(f"{path.name}: {where}: front and best from the profile only, no timeline or knob importance")
    if not data.points:  # the profile's own points stand in for the measurements
        data.points = [p for p in [data.baseline, *data.front] if p]
    return data


def _measured_there(best: Point | None, trials: list) -> bool:
    """Whether a profile's best was measured in this study: the study's trial of that number
    timed one of the latencies the profile records for it (its own, then its confirmations').
    Latencies are floats written whole (YAML and JSON round-trip them), so two runs never share
    one; a profile that records none to compare (no best, no trial number) is taken as it is."""
    if best is None or best.trial is None:
        return True
    own = next((t for t in trials if t.number == best.trial), None)
    measured = (own.user_attrs.get("result") or {}).get("latency_s") if own is not None else None
    return measured is not None and measured in (best.result.get("latencies_s") or [best.latency_s])


def _storage_candidates(url: str | None, profile_dir: Path) -> list[str]:
    """Where a profile's study may be: its storage URL, and for a relative file the same path
    from the profile's folder first (where a run with the default -o wrote both), then from here;
    only files that exist."""
    if not url or is_masked(url):
        return []
    path = storage_file(url)
    if path is None:
        return [url]  # a database server: try it
    beside = [] if path.is_absolute() else [profile_dir / path]
    found = dict.fromkeys(p.resolve() for p in [*beside, path] if p.is_file())
    return [with_storage_file(url, p) for p in found]


def _entries(sources: str) -> list[str]:
    """One string of sources as its entries: separated by spaces or newlines, an entry holding
    spaces (a study name) quoted as a shell would. Without quotes, or with quotes a shell would
    not close (a path's apostrophe: /tmp/O'Brien/s.db), split at whitespace alone, as written."""
    if any(quote in sources for quote in "'\""):
        try:
            return shlex.split(sources)
        except ValueError:  # "No closing quotation"
            pass
    return sources.split()


def load(sources, storage: str | None = None, studies: list[str] | None = None) -> list[StudyData]:
    """Studies to compare, from `sources`: a list, or one string of entries separated by spaces
    or newlines (quote one that holds spaces); each `NAME@STORAGE_URL`, a storage URL (all its
    studies), a SQLite or journal file (the same), or a profile path. `studies` names studies in `storage` (default: default_storage())
    besides. A profile file or a study given twice is compared once."""
    if isinstance(sources, str):
        sources = _entries(sources)
    elif isinstance(sources, os.PathLike):  # one path, spaces and all
        sources = [sources]
    sources = [os.fspath(s) for s in sources or []]
    if storage is not None:  # always a storage, never a profile: a path gets the URL to write
        _checked(check_url, storage)
    out: list[StudyData] = []
    for name in studies or []:
        sources.append(name if study_and_storage(name) else f"{name}@{storage or default_storage()}")
    if storage and not studies:
        sources.append(storage)
    seen: dict[tuple, StudyData] = {}  # what the sources resolved to: profile files, studies

    def add(keys: list[tuple], entry: str, read) -> None:
        # A source that resolves to a profile file or a study read already (a path and ./path, a
        # storage and one of its studies, a profile and its study) is not compared with itself.
        twin = next((seen[k] for k in keys if k in seen), None)
        if twin is None:
            data = read()
            keys = [*keys, *_resolved(data)]
            twin = next((seen[k] for k in keys if k in seen and _says_the_same(seen[k], data)), None)
            if twin is None:
                seen.update(dict.fromkeys(keys, data))
                out.append(data)
                return
        note = f"{twin.name}: given again ({entry}), compared once"
        if note not in twin.notes:
            twin.notes.append(note)

    for entry in sources:
        study_at = study_and_storage(entry)
        if study_at:  # its key known before loading: a study given twice is loaded once
            name, url = study_at
            add([_study_key(url, name)], f"{name}@{display_url(url)}", lambda: load_study(url, name))
        elif is_storage_url(as_url := as_storage_url(entry)):
            entry = as_url
            # autotune's studies only: a storage may hold other Optuna studies beside them
            backend = _open_storage(entry)  # opened once for all its studies
            names = [s.study_name for s in backend.get_all_studies() if "request" in s.user_attrs]
            if not names:
                raise ReportError(f"storage {display_url(entry)}: it holds no study made by autotune")
            for n in names:
                add([_study_key(entry, n)], display_url(entry),
                    lambda n=n: load_study(entry, n, storage=backend))
        elif entry.endswith((".yaml", ".yml")) or os.path.isfile(entry):  # False where it cannot be read
            add([("profile", Path(entry).resolve())], entry, lambda: load_profile_source(entry))
        else:
            raise ReportError(f"'{entry}': expected NAME@STORAGE_URL, a storage URL "
                              "(sqlite:///FILE, journal:FILE, ...), a SQLite or journal file, or a profile file")
    out = _without_moved_twins(out)
    if not out:
        raise ReportError("nothing to compare: give studies (NAME@STORAGE_URL), a storage or profiles")
    _label(out)
    return out


def _without_moved_twins(loaded: list[StudyData]) -> list[StudyData]:
    """A profile whose study was not found where it records it (its storage moved), given beside
    that study read from where it is now: one study, compared once. A study's name says its
    request, not its run (the same command on two machines makes one name): the profile's best
    must have been measured in that study (_measured_there)."""
    read = {d.name: d for d in loaded if d.source == "study"}
    kept = []
    for d in loaded:
        twin = read.get(d.name) if d.source == "profile" and d.storage is None else None
        if twin is None or not _measured_there(d.best, twin.trials):
            kept.append(d)
        else:
            twin.notes.append(f"{d.name}: given again (profile {d.origin}, whose recorded storage is not "
                              "here), compared once")
    return kept


def _says_the_same(a: StudyData, b: StudyData) -> bool:
    """Whether two sources of one study are one thing to compare: not two profiles of it written
    at different times, whose bests differ (one exported halfway, one at the end: the later one
    was dropped as "given again", and the earlier one's figures drawn; helper-16)."""
    if a.source == b.source == "profile":
        def said(d):
            return d.best and (d.best.trial, d.best.latency_s, d.best.peak_memory_bytes)

        return said(a) == said(b)
    return True


def _study_key(url: str, name: str) -> tuple:
    """What a study source resolves to: its storage file (however the path is written) and name."""
    path = storage_file(url)
    return ("study", str(path.resolve()) if path else url, name)


def _resolved(data: StudyData) -> list[tuple]:
    """The study a loaded source is (a profile's: the one it records)."""
    return [_study_key(data.storage, data.name)] if data.storage else []


# How a label names a workload that differs between studies: size and steps as one phrase.
WORKLOAD_PARTS = (
    (("height", "width", "steps"), lambda w: f"{w.get('height')}x{w.get('width')} {w.get('steps')} steps"),
    (("batch_size",), lambda w: f"batch {w.get('batch_size')}"),
    (("seed",), lambda w: f"seed {w.get('seed')}"),
)


def _label(studies: list[StudyData]) -> None:
    """Short, distinct labels: model, budget, device; then the workload where workloads differ
    among the studies (names of nine studies that differ by steps alone told less), on every
    label (added only where labels collided, a 1GB study at 4 steps stood unlabelled beside two
    2GB ones at 4 and 2 steps; helper-16); the study name where those collide too."""
    from .sizes import short_size

    for s in studies:
        if not s.label:
            budget = short_size(s.budget_bytes) if s.budget_bytes else "?"
            s.label = f"{s.model.get('name', '?')} {budget} {s.device}"
    parts = [fmt for keys, fmt in WORKLOAD_PARTS
             if len({tuple(s.workload.get(k) for k in keys) for s in studies}) > 1]
    for s in studies if parts else []:
        s.label = f"{s.label} {' '.join(fmt(s.workload) for fmt in parts)}"
    seen: dict[str, int] = {}
    for s in studies:
        seen[s.label] = seen.get(s.label, 0) + 1
    for s in studies:
        if seen[s.label] > 1:
            s.label = f"{s.label} [{s.origin if s.source == 'profile' else s.name}]"
    labels = [s.label for s in studies]
    for i, s in enumerate(studies):
        if labels.count(s.label) > 1:
            s.label = f"{s.label} #{i + 1}"


# ---- numbers ------------------------------------------------------------------------------------
def memory_unit(values) -> tuple[str, int]:
    """MiB below 2 GiB, GiB above: the unit the charts draw memory in."""
    top = max([v for v in values if v] or [0])
    return ("GiB", 2**30) if top >= 2 * 2**30 else ("MiB", 2**20)


def fits_from(study: StudyData, point: Point) -> int:
    """The smallest budget at which `point` fits: its peak and the study's margin at that budget
    (a share of it, or a size), as a profile's fits() judges."""
    return smallest_budget(point.peak_memory_bytes, study.margin)


def best_under(study: StudyData, budget_bytes: int) -> Point | None:
    """The fastest feasible measured point that fits `budget_bytes` with the study's margin (the
    fastest measured: a profile's choose() may keep a simpler one within noise)."""
    fitting = [p for p in study.front if fits_from(study, p) <= budget_bytes]
    return min(fitting, key=lambda p: p.latency_s, default=None)


def _unbudgeted_front(points: list[Point]) -> list[Point]:
    """The Pareto front of every successful measurement that only the budget rules out, the
    budget ignored: one below the quality guard, or that failed when measured again, would not
    be picked with more memory either."""
    ok = [p for p in points if p.status == worker.OK and p.latency_s and p.peak_memory_bytes
          and not p.ruled_out_otherwise]
    return pareto_front(ok, lambda p: p.peak_memory_bytes, lambda p: p.latency_s)


def knob_importance(study: StudyData, target: str = "latency") -> tuple[dict[str, float], str | None]:
    """Which knobs set the fastest (or smallest) trials apart from the rest: optuna's PED-ANOVA
    evaluator over the study's measured, successful, non-duplicate trials (IMPORTANCE_READING). Returns (importances, note); the note
    says why there are none (none measured, too few, nothing varied, the figure within noise over
    them: IMPORTANCE_NOISE, a profile without its study)."""
    import optuna
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    key = {"latency": "latency_s", "memory": "peak_memory_bytes"}[target]
    trials = [t for t in study.trials
              if t.user_attrs.get("result", {}).get("status") == worker.OK
              and t.user_attrs["result"].get(key) is not None and t.params]
    if not study.trials:
        why = "a profile without its study" if study.source == "profile" else "none measured"
        return {}, f"{study.label}: no trials to rank knobs from ({why})"
    if len(trials) < MIN_IMPORTANCE_TRIALS:
        return {}, (f"{study.label}: {count(len(trials), 'successful trial')}; ranking knobs needs at "
                    f"least {MIN_IMPORTANCE_TRIALS}")
    # Every knob drawn in any trial: a conditional one (a compile mode) is absent from the
    # baseline and wherever its condition is off, and optuna 5's PED-ANOVA ranks it over the
    # trials that drew it. Optuna 4's kept only the trials holding every knob named: there, the
    # knobs all trials hold.
    names = dict.fromkeys(name for t in trials for name in t.params)
    if int(optuna.__version__.split(".")[0]) < 5:
        names = {name: None for name in names if all(name in t.params for t in trials)}
    varied = [name for name in names if len({repr(t.params[name]) for t in trials if name in t.params}) > 1]
    if not varied:
        return {}, f"{study.label}: no knob took two values in the measured trials"
    values = [float(t.user_attrs["result"][key]) for t in trials]
    ranged = (max(values) - min(values)) / statistics.median(values) if statistics.median(values) > 0 else 0.0
    if ranged < IMPORTANCE_NOISE:
        what = "latency" if target == "latency" else "peak memory"
        return {}, (f"{study.label}: {what} ranged {ranged:.1%} over the measured trials, under the "
                    f"{IMPORTANCE_NOISE:.0%} below which it is within the noise between trials: no knob ranked for it")
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        scratch = optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction="minimize")
        scratch.add_trials(trials)
        # The top quantile must hold at least two trials for the comparison to mean anything.
        quantile = min(0.5, max(0.1, 2 / len(trials)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = get_param_importances(
                scratch, evaluator=PedAnovaImportanceEvaluator(target_quantile=quantile),
                params=varied, target=lambda t: float(t.user_attrs["result"][key]),
            )
    finally:
        optuna.logging.set_verbosity(level)
    return dict(result), None


def resolve_image(study: StudyData, point: Point) -> Path | None:
    """The PNG a trial kept (result["image"]: absolute, or relative to the storage file's
    folder), when the key is there and so is the file."""
    image = (point.result or {}).get("image")
    if not image:
        return None
    path = Path(image)
    if not path.is_absolute() and study.image_root is not None:
        path = study.image_root / path
    return path if path.is_file() else None


def chosen_images(study: StudyData) -> list[tuple[str, Path]]:
    """(caption, PNG) for the baseline, the best and the rest of the front, where kept."""
    by_trial = {p.trial: p for p in study.points}
    out, seen = [], set()
    chosen = [("baseline", study.baseline), ("best", study.best)] + [("front", p) for p in study.front]
    for role, p in chosen:
        if p is None or p.trial in seen:
            continue
        seen.add(p.trial)
        measured = by_trial.get(p.trial, p)  # a profile's point carries no result: its trial does
        path = resolve_image(study, measured)
        if path:
            caption = f"{role} (trial {p.trial}): {p.latency_s:.3f} s\n{config_changes(p.config)}"
            out.append((caption, path))
    return out


# ---- charts -------------------------------------------------------------------------------------
def _labels_as_written(plot):
    """matplotlib reads text between two '$' as a formula: a study named 'cost $5 and $10' lost
    its dollars, and one with '$\\foo$' in its name raised. Each chart shows names as written."""

    @functools.wraps(plot)
    def plotted(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context({"text.parse_math": False}):  # read as each text is made
            return plot(*args, **kwargs)

    return plotted


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    return fig


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _charted(studies: list[StudyData]) -> list[StudyData]:
    """The studies the charts draw: those with a measurement. A study with none has nothing to
    draw, and two dozen of them (runs stopped before a trial ended) crowded out the rest."""
    return [s for s in studies if s.measured]


def _drawn_when_measured(plot):
    """A chart that is None where no study has a measurement: a notebook given only studies
    stopped before their first trial drew empty axes (-0.04 to 0.04) and a legend of nothing."""
    @functools.wraps(plot)
    def drawn(studies: list[StudyData]):
        return plot(studies) if _charted(studies) else None

    return drawn


def _size_text(size: int | None) -> str:
    from .sizes import format_size

    return format_size(size)


@_drawn_when_measured
@_labels_as_written
def plot_fronts(studies: list[StudyData]):
    """Latency against peak memory: every measured configuration (faint), each study's feasible
    Pareto front (line), its best (star), baseline (square) and budget (dashed line)."""
    studies = _charted(studies)
    fig = _figure(12, 5.5)  # wide: the legend stands beside the axes
    ax = fig.add_subplot()
    values = [p.peak_memory_bytes for s in studies for p in s.points + s.front]
    unit, scale = memory_unit(values)
    top = max([v for v in values if v] or [1])
    for s, color in zip(studies, _colors(len(studies))):
        ok = [p for p in s.points if p.status == worker.OK and p.latency_s and p.peak_memory_bytes]
        fit = [p for p in ok if p.feasible]
        if fit:
            ax.scatter([p.peak_memory_bytes / scale for p in fit], [p.latency_s for p in fit],
                       color=color, alpha=0.3, s=25, gid=f"points:{s.label}")
        over = [p for p in ok if not p.feasible]  # over the budget with its margin, or below the guard
        if over:
            # labelled where no front is: else the study's colour had no key in the legend
            ax.scatter([p.peak_memory_bytes / scale for p in over], [p.latency_s for p in over],
                       color=color, alpha=0.5, s=25, marker="x", gid=f"infeasible:{s.label}",
                       label=None if s.front else f"{s.label}: nothing fits")
        if s.front:
            ax.plot([p.peak_memory_bytes / scale for p in s.front], [p.latency_s for p in s.front],
                    color=color, marker="o", drawstyle="steps-post", label=f"{s.label}: front",
                    gid=f"front:{s.label}")
        if s.best:
            ax.plot([s.best.peak_memory_bytes / scale], [s.best.latency_s], marker="*", ms=16,
                    color=color, markeredgecolor="black", ls="none", gid=f"best:{s.label}")
        if s.baseline and s.baseline.latency_s:
            ax.plot([s.baseline.peak_memory_bytes / scale], [s.baseline.latency_s], marker="s",
                    ms=9, mfc="none", color=color, mew=2, ls="none", gid=f"baseline:{s.label}")
        if s.budget_bytes:
            text = f"budget {_size_text(s.budget_bytes)}"
            if s.budget_bytes <= 1.5 * top:
                ax.axvline(s.budget_bytes / scale, color=color, ls="--", lw=1.5,
                           label=f"{s.label}: {text}", gid=f"budget:{s.label}")
                margin = parse_margin(s.margin, s.budget_bytes)
                if margin:  # a peak fits left of this line, not the budget's: it leaves the margin free
                    ax.axvline((s.budget_bytes - margin) / scale, color=color, ls=":", lw=1,
                               label=f"{s.label}: budget less its margin of {s.margin}", gid=f"fits-below:{s.label}")
            else:  # far right of every point: said in the legend instead of squashing the chart
                ax.plot([], [], color=color, ls="--", lw=1.5, label=f"{s.label}: {text} (right of the chart)",
                        gid=f"budget:{s.label}")
    ax.plot([], [], marker="*", ms=12, color="grey", markeredgecolor="black", ls="none", label="best")
    ax.plot([], [], marker="s", ms=8, mfc="none", color="grey", mew=2, ls="none", label="baseline")
    ax.plot([], [], marker="x", color="grey", ls="none", label="over the budget with its margin, or below the quality guard")
    ax.set_xlabel(f"peak memory ({unit})")
    _latency_axis(ax, [p.latency_s for s in studies for p in s.points if p.latency_s], "latency per call (s)")
    ax.set_title("Feasible Pareto fronts: lower left is better")
    ax.grid(alpha=0.3)
    _legend_beside(ax)
    return fig


def _latency_axis(ax, latencies: list[float], label: str) -> None:
    """A log scale where one latency is 10x another (float16 on a CPU, 100 s beside 0.4 s, had
    flattened every other point onto the axis), its ticks written as plain seconds (0.2, not 2x10^-1)."""
    from matplotlib.ticker import FuncFormatter

    log = bool(latencies) and max(latencies) > 10 * min(latencies)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        # between the powers of ten, 2 and 5 only (0.2, 0.5): all eight crowded into one another
        ax.yaxis.set_minor_formatter(FuncFormatter(
            lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "25" else ""))
    ax.set_ylabel(label + (", log scale" if log else ""))
    if not log:
        _at_least_a_tenth(ax)


def _at_least_a_tenth(ax) -> None:
    """A linear latency axis (drawn already) spanning at least 10% of its values: two latencies
    0.03 ms apart were drawn a full axis apart, under tick labels written as an offset (+9.23e-2)."""
    low, high = ax.get_ylim()
    if low > 0 and high < 1.1 * low:
        middle = (low + high) / 2
        ax.set_ylim(middle * 0.95, middle * 1.05)
    ax.ticklabel_format(axis="y", useOffset=False)


def _legend_beside(ax) -> None:
    """The legend right of the axes: inside, it covered fronts, stars and baselines."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)


def _annotate_apart(ax, labels: list[tuple]) -> None:
    """Write each (text, xy, leftwards, color) label beside its point, raised a line at a time
    while it would cover one written before: studies of equal budgets and close latencies wrote
    theirs on top of each other. (adjustText does this for many labels, by iteration and with a
    dependency; a handful stacked in order needs neither.)"""
    written = []
    for text, xy, leftwards, color in labels:
        rise = 5
        while True:
            label = ax.annotate(text, xy, xytext=(-5 if leftwards else 5, rise), textcoords="offset points",
                                fontsize=8, color=color, ha="right" if leftwards else "left")
            box = label.get_window_extent()  # the figure's own renderer, as it will draw
            if not any(box.overlaps(other) for other in written) or rise > 5 + 10 * len(labels):
                break
            label.remove()
            rise += 10  # a line of 8-point text and a little space
        written.append(box)


@_drawn_when_measured
@_labels_as_written
def plot_best_vs_budget(studies: list[StudyData]):
    """The best latency each study measured for any budget: solid within the study's budget,
    dotted beyond it (over-budget measurements: what more memory would buy). A dot marks the
    study's own budget, labelled with its speedup over its baseline."""
    studies = _charted(studies)
    fig = _figure(12, 5)  # wide: the legend stands beside the axes
    ax = fig.add_subplot()

    top = max([fits_from(s, p) for s in studies for p in s.points + s.front if p.peak_memory_bytes] or [1])
    shown = [s.budget_bytes for s in studies if s.budget_bytes and s.budget_bytes <= 1.5 * top]
    # budgets far beyond every point are not drawn; curves run on to here, past the last step
    edge = max([1.05 * top, *shown])
    unit, scale = memory_unit([edge])
    drawn: list[float] = []  # the latencies on the chart: they choose its scale
    labels: list[tuple] = []  # the budget dots' labels: written once the scale is known
    dotted = False  # the title explains the dotted lines only where one is drawn (helper-10)
    for s, color in zip(studies, _colors(len(studies))):
        off_axis = ""  # a budget far right of every point: its dot would squeeze the curves, so said here
        if s.budget_bytes and s.budget_bytes > 1.5 * top:
            off_axis = f"\n(budget {_size_text(s.budget_bytes)}, off the axis" + (
                f": picked {s.best.latency_s:.3f} s)" if s.best else ")")
        if s.front:
            right = min(s.budget_bytes or edge, edge)
            xs = [fits_from(s, p) for p in s.front] + [max(right, fits_from(s, s.front[-1]))]
            ys = [p.latency_s for p in s.front] + [s.front[-1].latency_s]
            ax.plot([x / scale for x in xs], ys, color=color, drawstyle="steps-post", lw=2,
                    label=s.label + off_axis, gid=f"budget-curve:{s.label}")
            drawn += ys
            last = s.front[-1]  # measured over the budget: what more memory would buy, from here
            over = [last] + [p for p in _unbudgeted_front(s.points)
                             if p.peak_memory_bytes > last.peak_memory_bytes and p.latency_s < last.latency_s]
        else:  # nothing fits: only the over-budget line (it drew nothing)
            over = _unbudgeted_front(s.points)
        if len(over) > (1 if s.front else 0):
            ax.plot([fits_from(s, p) / scale for p in over], [p.latency_s for p in over], color=color,
                    ls=":", drawstyle="steps-post", marker=".",  # the last step has no width: its point shows
                    label=None if s.front else f"{s.label}: nothing fits{off_axis}", gid=f"over-budget:{s.label}")
            drawn += [p.latency_s for p in over]
            dotted = True
        if s.budget_bytes and s.best and s.budget_bytes <= 1.5 * top:
            ax.plot([s.budget_bytes / scale], [s.best.latency_s], "o", color=color, ms=8,
                    gid=f"at-budget:{s.label}")
            drawn.append(s.best.latency_s)
            speed = f" ({s.speedup:.2f}x baseline)" if s.speedup else ""
            fastest = best_under(s, s.budget_bytes)
            kept = ""  # why the dot stands above the curve: kept within noise, or the faster one not confirmed
            if fastest and fastest.trial != s.best.trial and fastest.latency_s < s.best.latency_s:
                kept = (f"\npicked within noise of trial {fastest.trial}'s {fastest.latency_s:.3f} s" if s.choice_note
                        else f"\ntrial {fastest.trial}'s {fastest.latency_s:.3f} s was not measured again")
            labels.append((f"{s.best.latency_s:.3f} s{speed}{kept}", (s.budget_bytes / scale, s.best.latency_s),
                           s.budget_bytes > edge / 2, color))  # leftwards right of the middle: not cut off
    ax.set_xlabel(f"memory budget ({unit}): a configuration fits from its peak plus the study's margin")
    _latency_axis(ax, drawn, "best latency per call (s)")
    _annotate_apart(ax, labels)
    ax.set_title("Fastest measured latency against budget" + (" (dotted: measured over the budget)" if dotted else ""))
    ax.grid(alpha=0.3)
    if studies:  # none measured: an empty legend would only warn
        _legend_beside(ax)
    return fig


def best_table(studies: list[StudyData]) -> list[dict]:
    """One row per study: its best configuration, and the speedup over its own baseline."""
    rows = []
    for s in studies:
        w = s.workload
        rows.append({
            "study": s.label,
            "name": s.name,
            "model": s.model.get("name", "?"),
            "workload": f"{w.get('height')}x{w.get('width')}, {w.get('steps')} steps, batch {w.get('batch_size')}",
            "device": s.device,
            "budget": _size_text(s.budget_bytes),
            "trial": s.best.trial if s.best else None,
            "best_latency_s": s.best.latency_s if s.best else None,
            "best_peak": _size_text(s.best.peak_memory_bytes) if s.best else "-",
            "baseline_latency_s": s.baseline.latency_s if s.baseline else None,
            "speedup": s.speedup,
            "configuration": config_changes(s.best.config) if s.best else s.why_no_best(),
            "measured_trials": len(s.trials) if s.trials else None,
        })
    return rows


def best_table_html(studies: list[StudyData]) -> str:
    heads = ("study", "model", "workload", "device", "budget", "best latency", "peak memory",
             "baseline latency", "speedup", "configuration", "trial")
    cells = []
    for r in best_table(studies):
        fmt = lambda v, f: f.format(v) if v is not None else "-"  # noqa: E731
        cells.append([r["study"], r["model"], r["workload"], r["device"], r["budget"],
                      fmt(r["best_latency_s"], "{:.3f} s"), r["best_peak"],
                      fmt(r["baseline_latency_s"], "{:.3f} s"), fmt(r["speedup"], "{:.2f}x"),
                      r["configuration"], fmt(r["trial"], "{}")])
    head = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in cells)
    return f'<table class="autotune-best"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


@_drawn_when_measured
@_labels_as_written
def plot_speedups(studies: list[StudyData]):
    """Speedup of each study's best over its baseline, with the configuration that gave it."""
    studies = _charted(studies)
    fig = _figure(9, 1.2 + 0.7 * len(studies))
    ax = fig.add_subplot()
    colors = _colors(len(studies))
    # a row's words within the figure, beside the longest study label
    room = max(60, 140 - max(len(s.label) for s in studies))
    for i, (s, color) in enumerate(zip(studies, colors)):
        value = s.speedup or 0.0
        bar = ax.barh(i - 0.12, value, height=0.45, color=color, alpha=0.8)
        bar.patches[0].set_gid(f"speedup:{s.label}")
        text = (f"{value:.2f}x: {s.best.latency_s:.3f} s, {_size_text(s.best.peak_memory_bytes)}  "
                f"[{config_changes(s.best.config)}]" if s.speedup else s.why_no_best() if s.best is None else
                f"no speedup: the baseline ended {s.baseline.status}" if s.baseline else "no baseline measured")
        text = textwrap.shorten(text, room, placeholder=" …")  # the whole config is in the table of bests
        # under its bar, on white: the 1.0x line ran through the words
        ax.text(0.01, i + 0.27, text, va="center", ha="left", fontsize=8, transform=ax.get_yaxis_transform(),
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0}, zorder=3)
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.set_yticks([i - 0.12 for i in range(len(studies))], [s.label for s in studies], fontsize=8)
    ax.set_ylim(len(studies) - 0.4, -0.55)  # the first study on top; room for the last one's words
    ax.set_xlabel("speedup of the best configuration over the study's baseline (x)")
    ax.set_title("Best configuration per study")
    ax.set_xlim(0, max([s.speedup or 0 for s in studies] + [1.0]) * 1.15)
    return fig


@_drawn_when_measured
@_labels_as_written
def plot_importances(studies: list[StudyData]):
    """Knob importance for latency and for peak memory (PED-ANOVA), one bar per study; a study
    with too few trials gets a note instead of bars. None where no study has its trials (the
    overview's notes say why)."""
    studies = _charted(studies)
    if not any(s.trials for s in studies):
        return None
    results = {t: [knob_importance(s, t) for s in studies] for t in ("latency", "memory")}
    knobs = sorted({k for t in results for imp, _ in results[t] for k in imp})
    notes = sorted({note for t in results for _, note in results[t] if note})
    if knobs:  # a newcomer read "what moves latency" as what each knob gains (helper-10)
        notes.insert(0, IMPORTANCE_READING)
    # one note a line where it fits the figure's width (8-point text: about 150 characters in 10 inches)
    notes = [line for note in notes for line in textwrap.wrap(note, 150)]
    # The notes get their own strip below the axes: in a fixed-height figure, a dozen of them
    # squeezed the axes to nothing (matplotlib warned that constrained_layout collapsed).
    notes_height = 0.14 * len(notes) + 0.15 if notes else 0  # inches: 8-point lines
    fig = _figure(12 if knobs else 10, 5 + notes_height)  # wider for the legend, right of the axes
    axes = fig.subplots(1, 2, sharey=True)
    colors = _colors(len(studies))
    height = 0.8 / max(1, len(studies))
    for ax, target in zip(axes, ("latency", "memory")):
        for i, (s, color, (imp, note)) in enumerate(zip(studies, colors, results[target])):
            if not imp:
                continue
            ys = [k * 1.0 + i * height for k in range(len(knobs))]
            bars = ax.barh(ys, [imp.get(k, 0.0) for k in knobs], height=height, color=color,
                           label=s.label)
            for knob, patch in zip(knobs, bars.patches):
                patch.set_gid(f"importance:{target}:{s.label}:{knob}")
        ax.set_title("latency: what sets the fastest trials apart" if target == "latency"
                     else "peak memory: what sets the smallest apart")
        ax.set_xlabel("importance (sums to 1 per study)")
        ax.set_xlim(0, 1)
        ax.grid(axis="x", alpha=0.3)
    if knobs:
        axes[0].set_yticks([k + 0.4 - height / 2 for k in range(len(knobs))], knobs)
        axes[0].invert_yaxis()
        handles, labels = axes[0].get_legend_handles_labels()
        if not handles:
            handles, labels = axes[1].get_legend_handles_labels()
        # right of the axes (constrained layout makes room): inside them, a dozen studies'
        # entries covered the bars; a figure legend would cover the notes or the title
        axes[1].legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    else:
        axes[0].set_yticks([])
    if notes:
        fig.text(0.01, 0.005, "\n".join(notes), fontsize=8, va="bottom", color="dimgray",
                 gid="importance-notes")
        bottom = notes_height / (5 + notes_height)
        fig.get_layout_engine().set(rect=(0, bottom, 1, 1 - bottom))
    fig.suptitle("Which knobs set the best trials apart (optuna PED-ANOVA over the measured trials)")
    return fig


def _counted(kind: str, bars: int, measured_again: int) -> str:
    """A timeline class's count as said: a confirmation phase is one bar of many trials (a shared
    study may hold several phases; "confirmation phase 1: 6 trials" left a newcomer guessing)."""
    if kind != "confirmation":
        return str(bars)
    return f"{count(measured_again, 'trial')} measured again" + (f", {bars} phases" if bars > 1 else "")


@_drawn_when_measured
@_labels_as_written
def plot_timeline(studies: list[StudyData]):
    """Each trial as a bar from its start to its end, one row per study, coloured by how it
    ended (ok, over budget, each failure class, duplicate, forbidden, known not to fit), and the confirmation
    phase as one bar; counts in the legend. None where no study has its trials (profiles without
    their studies: an empty chart, its one note over the title; helper-10)."""
    studies = _charted(studies)
    if not any(s.timeline for s in studies):
        return None
    fig = _figure(10, 1.5 + 0.8 * len(studies))
    ax = fig.add_subplot()
    total: dict[str, int] = {}
    longest = max([sp.end_s for s in studies for sp in s.timeline] or [1.0])
    tick = longest / 400  # instantaneous trials (duplicates, forbidden) stay visible
    cut = 0
    for row, s in enumerate(studies):
        for sp in s.timeline:
            total[sp.kind] = total.get(sp.kind, 0) + 1
            cut += sp.cut
            patch = ax.barh(row, max(sp.end_s - sp.start_s, tick), left=sp.start_s, height=0.6,
                            color=CLASS_COLORS[sp.kind], edgecolor="white", linewidth=0.5,
                            hatch="///" if sp.cut else None)
            patch.patches[0].set_gid(f"trial:{s.label}:{sp.trial}:{sp.kind}" + (":cut" if sp.cut else ""))
        if not s.timeline:
            ax.text(0, row, "  no trials here (a profile without its study)", va="center", fontsize=8)
    from matplotlib.patches import Patch

    again = sum(s.measured_again for s in studies)
    handles = [Patch(color=CLASS_COLORS[k], label=f"{CLASS_NAMES.get(k, k)} ({_counted(k, total[k], again)})")
               for k in CLASS_COLORS if k in total]
    if cut:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                             label=f"cut: run killed, end unknown ({cut})"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    ticks = [f"{s.label}\n{count(sum(n for k, n in s.counts.items() if k not in NOT_MEASURED), 'trial')}, "
             f"{sum(n for k, n in s.counts.items() if k in FAILURES)} failed" for s in studies]
    ax.set_yticks(range(len(studies)), ticks, fontsize=8)
    ax.set_ylim(len(studies) - 0.5, -0.5)  # top down, each row whole: a row with no bars set no limits
    ax.set_xlabel("seconds since the study's first trial started")
    ax.set_title("Trial timeline: how each trial ended")
    ax.grid(axis="x", alpha=0.3)
    return fig


@_labels_as_written
def plot_images(studies: list[StudyData]):
    """The output images of the chosen configurations, where the trials kept them; None when
    no study has any."""
    studies = _charted(studies)
    rows = [(s, chosen_images(s)) for s in studies]
    rows = [(s, imgs) for s, imgs in rows if imgs]
    if not rows:
        return None
    from PIL import Image

    cols = max(len(imgs) for _, imgs in rows)
    fig = _figure(min(3.2 * cols, 16), 3.6 * len(rows))
    axes = fig.subplots(len(rows), cols, squeeze=False)
    for r, (s, imgs) in enumerate(rows):
        for c in range(cols):
            ax = axes[r][c]
            ax.axis("off")
            if c >= len(imgs):
                continue
            caption, path = imgs[c]
            try:
                with Image.open(path) as im:
                    pixels = im.convert("RGB")  # reads it whole: a file cut short fails here
            except OSError as exc:  # cut short, empty, not an image (PIL's UnidentifiedImageError is one)
                ax.text(0.5, 0.5, f"unreadable image\n{path.name}\n({str(exc)[:50]})", ha="center", va="center",
                        fontsize=7, transform=ax.transAxes, gid=f"unreadable:{s.label}:{path.name}")
            else:
                ax.imshow(pixels, gid=f"image:{s.label}:{path.name}")
            # wrapped to the image's width: a long configuration ran past the figure's edge, and
            # so may a label that holds the workload and the study's name
            ax.set_title(f"{textwrap.fill(s.label, 56)}\n{textwrap.fill(caption, 44)}", fontsize=7)
    fig.suptitle("Output images of the chosen configurations (fixed seed)")
    return fig


CHARTS = {
    "fronts": plot_fronts,
    "best_vs_budget": plot_best_vs_budget,
    "speedups": plot_speedups,
    "importance": plot_importances,
    "timeline": plot_timeline,
    "images": plot_images,
}


def figures(studies: list[StudyData]) -> dict:
    """Every chart by name (images only when some trial kept one); none when no study has a
    measurement."""
    out = {}
    if not _charted(studies):
        return out
    for name, plot in CHARTS.items():
        fig = plot(studies)
        if fig is not None:
            out[name] = fig
    return out


def overview_html(studies: list[StudyData]) -> str:
    """What was loaded: one line per study, and the notes (missing storages, too few trials)."""
    items = []
    for s in studies:
        counts = ", ".join(f"{CLASS_NAMES.get(k, k)}{':' * (k == 'confirmation')} {_counted(k, n, s.measured_again)}"
                           for k, n in sorted(s.counts.items())) or "no trials"
        where = display_url(s.storage) if s.storage else "no storage"  # never a password
        items.append(f"<li><b>{html.escape(s.label)}</b>: study {html.escape(s.name)} in "
                     f"{html.escape(where)} ({s.source}); {html.escape(counts)}</li>")
    notes = [n for s in studies for n in s.notes]
    notes += [note for s in _charted(studies) for note in [knob_importance(s, "latency")[1]] if note]
    note_html = "".join(f"<li>{html.escape(n)}</li>" for n in dict.fromkeys(notes))
    return f"<ul>{''.join(items)}</ul>" + (f"<p>Notes:</p><ul>{note_html}</ul>" if note_html else "")


@contextmanager
def _writing(path: Path, what: str = "write it"):
    """An OSError while writing `path` (a folder that cannot be made, a full disk) as one line."""
    try:
        yield
    except OSError as exc:
        raise ReportError(f"report {path}: cannot {what} ({os_reason(exc)})") from None


# What marks an index.html as a report's: the generator tag, or before it (2026-11-29) the page's style.
REPORT_MARKS = ('<meta name="generator" content="autotune report">',
                "<style>body{font-family:sans-serif;margin:2em}img{max-width:100%}")


def _check_ours_to_replace(out: Path) -> None:
    """A report replaces index.html and its charts, and removes charts it does not draw again:
    only in a folder whose index.html a report wrote. `--out .` in a folder holding a user's
    timeline.png or index.html deleted or replaced them (helper-16)."""
    index = out / "index.html"
    with _writing(index, "read it"):
        head = index.read_text(encoding="utf-8", errors="replace")[:4000] if index.is_file() else ""
    if any(mark in head for mark in REPORT_MARKS):
        return
    theirs = [p.name for p in (index, *(out / f"{name}.png" for name in CHARTS)) if p.exists()]
    if theirs:
        raise ReportError(f"report {out}: it holds {', '.join(theirs)}, which no autotune report wrote there: "
                          "give --out an empty or new folder")


def write_report(studies: list[StudyData], out_dir: str | Path, title: str = "autotune: compared studies") -> list[Path]:
    """Every chart as PNG in `out_dir`, and index.html showing them with the table of bests.
    Returns the files written, index.html last."""
    out = Path(out_dir)
    with _writing(out, "create the folder"):  # before drawing anything: an unusable --out fails at once
        out.mkdir(parents=True, exist_ok=True)
    _check_ours_to_replace(out)
    written = []
    sections = []
    for name, fig in figures(studies).items():
        path = out / f"{name}.png"
        with _writing(path):
            fig.savefig(path, dpi=DPI)
        written.append(path)
        sections.append(f'<h2>{html.escape(name.replace("_", " "))}</h2>\n<img src="{path.name}" alt="{name}">')
        if name == "speedups":
            sections.append(best_table_html(studies))
    if not written:  # no study measured anything: no charts, the table says so
        sections.append(best_table_html(studies))
    _remove_charts_not_drawn(out, CHARTS, written)
    page = (
        f"<!doctype html>\n<html><head><meta charset='utf-8'>{REPORT_MARKS[0]}<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}img{max-width:100%}"
        "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:4px}</style>"
        f"</head><body>\n<h1>{html.escape(title)}</h1>\n{overview_html(studies)}\n"
        + "\n".join(sections) + "\n</body></html>\n"
    )
    index = out / "index.html"
    with _writing(index):
        index.write_text(page, encoding="utf-8")
    written.append(index)
    return written


# ---- notebooks ----------------------------------------------------------------------------------
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "compare_studies.ipynb"


def run_notebook(sources: str, notebook: str | Path = NOTEBOOK, out: str | Path | None = None,
                 figures_dir: str | Path | None = None, cwd: str | Path | None = None,
                 extra_cells: list[str] = (), timeout: int = 300):
    """Execute the comparison notebook on `sources` (it reads AUTOTUNE_STUDIES) with nbclient;
    write the executed notebook to `out` and its PNG outputs to `figures_dir`. Returns the
    executed notebook (nbformat), `extra_cells` (run after the notebook's own) included. Needs the
    `notebook` extra (nbclient, nbformat, ipykernel)."""
    import base64

    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError as exc:
        raise ReportError(f"run_notebook needs {exc.name}: pip install \"autotune[notebook]\"") from None
    if not Path(notebook).is_file():  # installed from a wheel: the notebook stays in the repository
        raise ReportError(f"no notebook at {notebook}: it ships with the repository "
                          "(notebooks/compare_studies.ipynb), not the installed package; pass notebook=PATH")

    nb = nbformat.read(str(notebook), as_version=4)
    for source in extra_cells:
        nb.cells.append(nbformat.v4.new_code_cell(source))
    from .runner import environment

    with environment(AUTOTUNE_STUDIES=sources):  # the kernel inherits it
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(cwd or Path.cwd())}}).execute()
    if out:  # the notebook as shipped, executed: without the extra cells
        shipped = nbformat.from_dict(nb)
        shipped.cells = nb.cells[: len(nb.cells) - len(extra_cells)]
        nbformat.write(shipped, str(out))
    if figures_dir:
        folder = Path(figures_dir)
        folder.mkdir(parents=True, exist_ok=True)
        drawn, names = [], []
        for cell in nb.cells:
            name = cell.get("metadata", {}).get("autotune_figure")
            pngs = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
            names += [name] if name else []
            if name and pngs:
                (folder / f"{name}.png").write_bytes(base64.b64decode(pngs[-1]))
                drawn.append(folder / f"{name}.png")
        _remove_charts_not_drawn(folder, names, drawn)
    return nb


def _remove_charts_not_drawn(folder: Path, names, drawn: list[Path]) -> None:
    """A chart an earlier report wrote into this folder and this one did not draw (its studies
    kept no image, measured nothing) went on standing beside the new ones, unlinked, as if of
    these studies: removed. Only the charts' own names; nothing else in the folder is touched."""
    for name in names:
        stale = folder / f"{name}.png"
        if stale not in drawn:
            with _writing(stale, "remove an earlier report's chart"):
                stale.unlink(missing_ok=True)


# ---- `autotune report` --------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")  # no display needed, none tried
    from .cli import Parser, a_path, a_storage_url

    p = Parser(
        prog="autotune report",
        description="Compare studies: write their charts as PNG and an index.html page.",
        epilog="Examples: autotune report  (every study in the default storage, into autotune-report/); "
        "autotune report --storage sqlite:///s.db --study A --study B --out report/; "
        "autotune report a.yaml b.yaml --out report/",
    )
    p.add_argument("sources", nargs="*", metavar="SOURCE",
                   help="a profile file, NAME@STORAGE_URL, or a storage URL, SQLite or journal file (all its studies)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--storage", type=a_storage_url, help="storage URL of the --study names (default: sqlite:///WORKDIR/studies.db)")
    where.add_argument("--workdir", type=a_path,
                       help=f"the --workdir the studies ran with, to find their default storage (default: {DEFAULT_WORKDIR})")
    p.add_argument("--study", action="append", default=[], metavar="NAME",
                   help="a study in --storage; repeat to compare several")
    p.add_argument("--profile", action="append", default=[], type=a_path, help="a profile file; repeatable")
    p.add_argument("--out", type=a_path, default=Path(DEFAULT_REPORT_DIR),
                   help=f"folder for the PNGs and index.html (default: ./{DEFAULT_REPORT_DIR})")
    p.add_argument("--title", default="autotune: compared studies")
    args = p.parse_args(argv)
    sources = [*args.sources, *map(str, args.profile)]
    storage = args.storage or (default_storage(args.workdir) if args.workdir else None)
    if not storage and (any(not study_and_storage(name) for name in args.study) or not (sources or args.study)):
        storage = default_storage()  # the storage of --study names without @URL, or every study in it
    if storage and not args.storage and not args.workdir:  # the default one, not one named: a hint
        _checked(check_file, storage, hint=WORKDIR_HINT)
    studies = load(sources, storage=storage, studies=args.study)
    written = write_report(studies, args.out, title=args.title)
    for s in studies:
        for note in s.notes:
            print(f"note: {note}")
    print(f"compared {count(len(studies), 'study', 'studies')}: " + ", ".join(s.label for s in studies))
    print(f"wrote {count(len(written) - 1, 'chart')} and {written[-1]}")
    return 0


__all__ = [
    "ReportError", "StudyData", "Point", "Span", "load", "load_study", "load_profile_source",
    "best_under", "best_table", "best_table_html", "knob_importance", "chosen_images",
    "plot_fronts", "plot_best_vs_budget", "plot_speedups", "plot_importances", "plot_timeline",
    "plot_images", "figures", "overview_html", "write_report", "run_notebook", "main",
]
