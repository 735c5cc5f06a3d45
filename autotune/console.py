"""Human output: the space on this machine, live progress, the end-of-study summary, profiles."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .sizes import format_size
from .worker import OK, SECOND_TRIAL_STOPPED, ran_out_of_host_memory

# knobs (and torch with them) are imported where used: reports and notebooks import this module
# for `count` alone.


def count(n: int, word: str, plural: str | None = None) -> str:
    """"1 study", "2 studies": a count with its noun in the right number."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


# C0 and C1 control characters, ESC among them, which rich passes through: "\x1b]0;...\x07" in a
# profile's machine name retitled the terminal of whoever ran `show`, "\x1b[2J" cleared it.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text) -> str:
    """`text` with each control character written as its escape (\\x1b, \\n), as repr writes it."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


# Piped into a file, a pager or grep, rich lays tables out at 80 columns, and the knob table
# (--list-knobs) folds each help text over several lines; this keeps a row on one line.
PIPED_WIDTH = 160
# A COLUMNS below this, or no number, is ignored: rich took COLUMNS=0 and printed nothing at all.
MIN_COLUMNS = 20


def terminal() -> Console:
    # No rich markup or emoji codes: what autotune prints holds paths, names and configs in
    # brackets (a file "[/x].yaml", "[dtype=bfloat16]"), which markup would swallow or fail on,
    # and a name with ":cross_mark:" in it is a name.
    columns = os.environ.get("COLUMNS", "")
    asked = columns.isdigit() and int(columns) >= MIN_COLUMNS  # COLUMNS: the user's own width wins
    # rich reads COLUMNS from the environment it is given (rich's _environ, as its own tests give one)
    environ = os.environ if asked else {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = Console(stderr=False, highlight=False, soft_wrap=True, markup=False, emoji=False, _environ=environ)
    if not out.is_terminal and not asked:
        out.width = PIPED_WIDTH
    return out


def config_changes(config: dict) -> str:
    """The knobs a config sets away from the baseline, as `name=value` pairs."""
    from .knobs import changed

    return ", ".join(f"{k}={v}" for k, v in changed(config).items()) or "baseline (float32, nothing enabled)"


def _rule_text(rule: dict) -> str:
    """A partial config as `knob=value` pairs, a knob's several values joined by '|'."""
    return " with ".join(f"{name}={'|'.join(map(str, v)) if isinstance(v, list) else v}"
                         for name, v in rule.items())


def print_space(space, target, out: Console | None = None) -> None:
    from .knobs import CATALOGUE
    from .space import when_text

    out = out or terminal()
    table = Table(title=f"search space {space.source} on {target.device} ({target.family})")
    searched = {d.name: d for d in space.dimensions}
    # Names are copied into space files: never cut short ("…"); the searched column is at least as
    # wide as the longest choice, and long help words fold onto the next line.
    longest = max((len(str(c)) + 1 for d in space.dimensions for c in d.choices), default=8)
    names = max(map(len, CATALOGUE))
    table.add_column("knob", no_wrap=True)
    table.add_column("searched", min_width=longest, overflow="fold")
    # what the others leave (less borders and padding): rich alone let the table overflow the width
    table.add_column("help", overflow="fold", max_width=max(12, out.width - names - longest - 10))
    dropped = {d.knob for d in space.dropped}
    for name, knob in CATALOGUE.items():
        dim = searched.get(name)
        # why a knob is not searched: the space leaves it out, or this machine cannot run its choices
        why = "its other choices dropped, below" if name in dropped else f"not searched in {Path(space.source).name}"
        text = ", ".join(map(str, dim.choices)) if dim else f"fixed at {knob.default} ({why})"
        if dim and dim.when:
            text += f"  (when {when_text(dim.when)})"
        table.add_row(name, text, knob.help)
    out.print(table)
    if space.dropped:
        out.print("dropped here, each with its reason:")
        for d in space.dropped:
            out.print(f"  - {d}")
    rules = [_rule_text(r) for r in space.forbid]
    if rules:
        out.print("forbidden combinations: " + "; ".join(rules))
    conflicts = space.conflicts_here()
    if conflicts:
        out.print("never measured together (known conflicts among the choices searched here):")
        for rule, reason in conflicts:
            out.print(f"  - {_rule_text(rule)}: {reason}")
    seeds = space.seed_configs()
    if seeds:
        out.print("seeds (the space's starting configs), measured first after the baseline: "
                  + "; ".join(config_changes(c) for c in seeds))
    if len(seeds) < len(space.seeds):  # said, not silent: a seed naming what is not searched here
        out.print(f"{len(space.seeds) - len(seeds)} of the space's {len(space.seeds)} seeds not measured here: "
                  "reduced to the choices this machine searches, each is the baseline, forbidden, or another seed")


def _workload_text(w) -> str:
    return f"{w.height}x{w.width}, {count(w.steps, 'step')}, batch {w.batch_size}"


def print_header(out: Console, request, space) -> None:
    w = request.workload
    out.print(
        f"autotune: {request.spec.name} ({request.spec.kind}) on {request.target.device}, "
        f"{_workload_text(w)}; budget "
        f"{format_size(request.budget_bytes)} with a margin of {request.margin} "
        f"({format_size(request.margin_bytes)}); {count(request.threads, 'CPU thread')}; study {request.study_name}"
    )
    for d in space.dropped:
        out.print(f"  dropped {d}")


class RuledOutWords(NamedTuple):
    trial_line: str  # after a trial's status on its line
    counted: str  # after a count, in the summary
    timeline: str  # the report's timeline class (a report.CLASS_COLORS key)


# TrialRecord.ruled_out_by's reasons, in the words of each place that says them (study.why_no_best
# says them in sentences of its own, with the guard's threshold)
RULED_OUT_SAID = {"budget": RuledOutWords("over budget", "over the budget", "over budget"),
                  "forbidden": RuledOutWords("a combination this autotune now forbids",
                                             "fit but are now forbidden by the rules", "forbidden now"),
                  "quality": RuledOutWords("below the quality guard", "fit but fell below the quality guard", "low quality"),
                  "failed again": RuledOutWords("failed when measured again", "fit but failed when measured again",
                                                "failed again")}


class TrialProgress:
    """A live bar (trial count, current best, ETA) and one line per finished trial."""

    def __init__(self, out: Console, total: int):
        self.out = out
        self.best = None
        self.baseline = None
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=out,
            transient=True,
        )
        self.task = self.progress.add_task("tuning", total=total)
        self.confirming = False  # the confirmation phase's heading printed

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def update(self, record) -> None:
        if record.baseline and record.latency_s:
            self.baseline = record
        if record.feasible and (self.best is None or record.latency_s < self.best.latency_s):
            self.best = record
        r = record.result
        if record.status == OK:
            what = f"{record.latency_s:.3f} s, {format_size(record.peak_memory_bytes)}"
            q = r.get("quality")
            if q:
                what += f", PSNR {q['psnr_db']:.1f} dB"
            if record.ruled_out_by:
                what += f" ({RULED_OUT_SAID[record.ruled_out_by].trial_line})"
            if r.get("cut_short"):
                what += f" (cut short: far slower than the best, {count(r.get('calls', 2), 'warm call')})"
            what += _busy_note(r)
            if r.get(SECOND_TRIAL_STOPPED):
                what += " (its second trial, for the load beside it, was stopped by the interrupt: this one stands)"
            other = r.get("measured_twice")
            if other and other.get("latency_s") is not None:
                what += (f" (measured twice: its first trial, {other['latency_s']:.3f} s, was timed while other "
                         f"processes took {other.get('cores_taken_by_others') or 0:.1f} of its CPU cores)"
                         if other.get("kept") == "second"
                         else f" (measured twice: its second trial took {other['latency_s']:.3f} s)")
        else:
            what = f"{record.status}: {r.get('error', '')}"[:160]
            if ran_out_of_host_memory(r):
                what += " (host memory ran short: this machine's RAM stopped it, not the budget)"
            if r.get("measured_twice"):
                what += f" (its second trial; the first, disturbed, took {r['measured_twice']['latency_s']:.3f} s)"
        if record.repair:  # repair.py
            what += f" (trial {record.repair['of']} over the budget, with {record.repair['adds']} added)"
        self.out.print(f"trial {record.number:3d}  {what}  [{config_changes(record.config)}]")
        desc = "tuning"
        if self.best:
            desc = f"best {self.best.latency_s:.3f} s"
            if self.baseline:
                desc += f" ({self.baseline.latency_s / self.best.latency_s:.2f}x)"
        self.progress.update(self.task, advance=1, description=desc)

    def start(self, measured: int) -> None:
        """The bar counts from the configs a resumed study holds measured, as --trials does."""
        self.progress.update(self.task, completed=measured)

    def step(self, text: str) -> None:
        """A line for a step that reports no trial (the study's reference calls)."""
        self.out.print(text)

    def confirmed(self, record, entry: dict) -> None:
        """One line per confirmation (a contender measured again in a fresh trial), under a
        heading that says what these lines are."""
        if not self.confirming:
            self.confirming = True
            self.out.print("confirming: the fastest configs that fit, each measured again in fresh trials, in "
                           "alternation (`again N`: trial N's config); each counts with its median")
        if entry["latency_s"] is not None:
            what = f"{entry['latency_s']:.3f} s, {format_size(entry['peak_memory_bytes'])}"
            if entry["violation"] > 0:
                what += " (over budget)"
            if entry.get("cut_short"):
                what += f" (cut short: {entry['cut_short']})"  # the worker's words: its calls and the bound
            what += _busy_note(entry)
        else:
            what = f"{entry['status']}: {entry['error']}"[:160] if entry.get("error") else entry["status"]
            if ran_out_of_host_memory(entry):
                what += " (host memory ran short: this machine's RAM stopped it, not the budget)"
        self.out.print(f"again {record.number:3d}  {what}  [{config_changes(record.config)}]")


def _busy_note(result: dict) -> str:
    from .measure import busy_cores

    busy = busy_cores(result)
    return f" (timed while other processes took {busy:.1f} of its CPU cores)" if busy else ""


def busy_timings(outcome) -> str | None:
    """A warning when trials were timed beside other processes' work, or None."""
    from .measure import busy_cores

    results = [r.result for r in outcome.records] + [c for r in outcome.records for c in r.confirmations]
    busy = [b for b in map(busy_cores, results) if b]
    if not busy:
        return None
    return (f"warning: timings taken while other processes took the trials' CPU cores (up to {max(busy):.1f}): "
            f"{len(busy)} of {len(results)}, slower and noisier than on a quiet machine; the study keeps them "
            "(run a new --study-name when the machine is quiet to measure anew)")


def status_counts(outcome) -> str:
    """How the study's measured trials ended: "ok 6, out_of_memory 2"."""
    return counts_text(outcome.counts.get("by_status", {}))


def counts_text(counts: dict) -> str:
    """Counts by status, as the summary and the report say them: "ok 6, out_of_memory 2"."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _medians_said(rec) -> str:
    """The trials a confirmed config's median is of: its quiet ones where it has any, the others
    said apart (TrialRecord.latency_s)."""
    quiet, others = rec.quiet_medians_s, rec.under_load_medians_s
    listed = lambda values: ", ".join(f"{x:.3f}" for x in values) + " s"  # noqa: E731
    every, kept = rec.latencies_s, rec.quiet_latencies_s
    if not others or not quiet and len(kept) == len(every):
        return f"median of {count(len(every), 'trial')}: " + listed(every)
    if not quiet:  # all timed under load: the two least disturbed
        aside = list(every)
        for x in kept:
            aside.remove(x)
        return (f"median of the {len(kept)} least disturbed of {len(every)} trials, all timed under load: "
                + listed(kept) + "; left aside: " + listed(aside))
    said = "1 quiet trial" if len(quiet) == 1 else f"median of {len(quiet)} quiet trials"
    return f"{said}: " + listed(quiet) + f"; {len(others)} timed under load left aside: " + listed(others)


def _median_range(rec) -> str:
    """The range of the trials a confirmed config's median is of (TrialRecord.latency_s), and how
    many timed under load it leaves aside: the range of all read 0.372-9.896 s for a median of 0.396 s."""
    of = rec.quiet_latencies_s or rec.latencies_s
    aside = len(rec.latencies_s) - len(of)
    return f"{min(of):.3f}-{max(of):.3f}" + (f"; {aside} under load left aside" if aside > 0 else "")


def print_share(out: Console, outcome) -> None:
    """What this run measured, when it did not measure all of the study: a resume, or a study
    shared by several workers."""
    total = len(outcome.records)
    if outcome.measured_here == total:
        return
    n = outcome.confirmed_here
    confirmations = count(n, "confirmation trial") if n else ""
    if outcome.measured_here:
        out.print(f"this run measured {outcome.measured_here} of the study's {count(total, 'trial')}"
                  + (f" and {confirmations}" if n else "")
                  + "; the rest were measured by an earlier run or by other workers sharing the study")
    else:
        out.print(f"this run measured {confirmations or 'nothing'}; the study's {count(total, 'trial')} "
                  f"{'was' if total == 1 else 'were'} measured by an earlier run or by other workers sharing it")


def print_summary(out: Console, outcome, budget_bytes: int, margin_bytes: int = 0) -> None:
    out.print(f"stopped: {outcome.stop_reason}")
    guard = outcome.quality_guard
    if guard:
        calibrated = guard.get("bfloat16_psnr_db")
        out.print(f"quality guard: PSNR against the float32 reference at least {guard['min_psnr_db']:.1f} dB"
                  + (f" (bfloat16 alone: {calibrated:.1f} dB)" if calibrated is not None else ""))
    elif outcome.guard_asked:
        out.print("quality guard: not calibrated (the study stopped before its reference calls)")
    else:
        out.print("quality guard: off")
    if outcome.seed_note:
        out.print(f"seeds: {outcome.seed_note}")
    by_status = status_counts(outcome)
    skipped = outcome.counts.get("not_measured") or {}
    # Trial numbers are Optuna's and count these too: this line says where the gaps come from
    # (a confirmation phase's claim takes a number as well, after the search's).
    n_skipped = sum(skipped.values())
    not_measured = (f"; not measured: {count(n_skipped, 'more proposal')} ("
                    + ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())) + ")") if skipped else ""
    # of those that ran: what ruled them out of the pick (an "ok" status says only that it ran),
    # one reason each (TrialRecord.ruled_out_by), as the no-fit error counts them
    by_reason = Counter(r.ruled_out_by for r in outcome.records)
    ruled_out = [f"{by_reason[reason]} {said.counted}" for reason, said in RULED_OUT_SAID.items() if by_reason[reason]]
    statuses = f" ({by_status}{'; of those, ' + ', '.join(ruled_out) if ruled_out else ''})" if by_status else ""
    out.print(f"trials measured: {outcome.counts.get('trials', 0)}{statuses}{not_measured}")
    table = Table(title=f"baseline vs best within {format_size(budget_bytes)} "
                  f"(peak + {format_size(margin_bytes)} margin)")
    for col in ("", "latency", "p90", "peak", "headroom", "cold", "speedup"):
        # figures whole; the headroom's note wraps: at 80 columns (a pipe, a log) rich cut them to "…"
        table.add_column(col, no_wrap=col != "headroom", min_width=len(col))
    base = outcome.baseline
    rows = [("baseline", base)] + ([("best", outcome.best)] if outcome.best else [])
    configs = []
    for label, rec in rows:
        if rec is None or rec.latency_s is None:
            # a failed trial's peak is where it stopped: at least that much (an out-of-memory one)
            peak = f">= {format_size(rec.peak_memory_bytes)}" if rec and rec.peak_memory_bytes else "-"
            table.add_row(label, "-", "-", peak, "-", "-", "-")
            configs.append(f"{label}: {rec.status if rec else 'not measured'}")
            continue
        speedup = f"{base.latency_s / rec.latency_s:.2f}x" if base and base.latency_s else "-"
        cold = rec.across_trials("cold_start_s")  # as the profile records it
        p90 = rec.p90_s
        table.add_row(
            label, f"{rec.latency_s:.3f} s", f"{p90:.3f} s" if p90 else "-",
            format_size(rec.peak_memory_bytes), _headroom(budget_bytes - rec.peak_memory_bytes, margin_bytes),
            f"{cold:.1f} s" if cold else "-", speedup,
        )
        q = rec.result.get("quality") or {}
        guard = f", PSNR {q['psnr_db']:.1f} dB, SSIM {q['ssim']:.3f}" if q else ""
        measured = _medians_said(rec) if rec.confirmations else f"{rec.result.get('calls', '?')} timed calls"
        configs.append(f"{label} (trial {rec.number}, {measured}{guard}): {config_changes(rec.config)}")
    out.print(table)
    for line in configs:
        out.print(line)
    confirmed = sorted((r for r in outcome.records if r.confirmations and r.latency_s is not None),
                       key=lambda r: r.latency_s)
    if confirmed:  # why a config that fits lost: its median, not only the pick's
        out.print("measured again (each config's median, and the range of the trials it is of): " + "; ".join(
            f"trial {r.number} {r.latency_s:.3f} s ({_median_range(r)})"
            + (f" {RULED_OUT_SAID[r.ruled_out_by].trial_line}" if r.ruled_out_by else "")
            + (" (the pick)" if outcome.best is not None and r.number == outcome.best.number else "")
            for r in confirmed))
    if getattr(outcome, "choice_note", None):
        out.print(f"choice: {outcome.choice_note}")
    if getattr(outcome, "ruled_out_note", None):
        out.print(f"note: {outcome.ruled_out_note}")
    if getattr(outcome, "software_note", None):
        out.print(f"note: {outcome.software_note}")
    if outcome.front:  # printed with one point too: its absence read as a summary cut short
        sizes = front_sizes([r.peak_memory_bytes for r in outcome.front])
        off_front = outcome.best is not None and outcome.best.number not in {r.number for r in outcome.front}
        out.print("feasible Pareto front (memory -> latency): " + "; ".join(
            f"{size} -> {r.latency_s:.3f} s" for size, r in zip(sizes, outcome.front))
            + (f" (the pick, trial {outcome.best.number}, is not on it: kept within noise, as the choice line says)"
               if off_front else ""))
    busy = busy_timings(outcome)
    if busy:
        out.print(busy)


def _headroom(left: int, margin_bytes: int) -> str:
    """What a peak leaves under the budget; short of the margin, that config does not fit."""
    return format_size(left) + (" (over budget)" if left < 0 else " (< margin)" if left < margin_bytes else "")


def print_verification(out: Console, profile, result: dict, fits: bool | None = None,
                       margin_bytes: int = 0) -> None:
    """Recorded against replayed figures, and the verdict cli.py computed: whether the replayed
    peak plus the profile's margin is within its budget (None: the replay failed, no verdict)."""
    best, budget = profile.best, profile.budget_bytes
    # how the replay ended, not a verdict (that is the budget's line): "(ok)" over figures 12x the
    # recorded read as one; "(ran)" said nothing to a newcomer (helper-10)
    how = "in a fresh process" if result.get("status") == OK else f"(failed: {result.get('status')})"
    table = Table(title=f"replay of {profile.path} {how}")
    for col in ("", "recorded", "replayed", "replayed / recorded"):
        table.add_column(col)
    for label, key, fmt in (
        ("latency (median)", "latency_s", lambda v: f"{v:.3f} s"),
        ("latency (p90)", "p90_s", lambda v: f"{v:.3f} s"),
        ("peak memory", "peak_memory_bytes", format_size),
        ("cold start", "cold_start_s", lambda v: f"{v:.2f} s"),  # 0.1 s beside 0.1 s read 1.4x
    ):
        # a replay that failed measured nothing comparable: its peak is where it stopped
        old, new = best.get(key), result.get(key) if result.get("status") == OK else None
        ratio = f"{new / old:.3f}x" if old and new else "-"
        table.add_row(label, fmt(old) if old else "-", fmt(new) if new else "-", ratio)
    out.print(table)
    if result.get("status") == OK and _busy_note(result):  # as a trial's line says it
        out.print(f"warning: replayed{_busy_note(result)}: the replayed latency reflects their load as "
                  "much as the profile's settings; verify again when they are done")
    if fits is None:
        return
    peak = result.get("peak_memory_bytes") or 0
    out.print(f"budget {format_size(budget)}, margin {profile.margin}: replayed peak {format_size(peak)} "
              + ("fits" if fits else "DOES NOT FIT")
              # headroom as the profile counts it (budget - peak), the margin part of it
              + f" (headroom {format_size(budget - peak)}: the margin and "
                f"{format_size(budget - margin_bytes - peak)} more)" * fits)


def front_sizes(peaks: list[int]) -> list[str]:
    """The peaks of a front (by memory) as sizes, each that would read as the one before it
    ("859.52 MiB" twice, a few KiB apart) with what it holds more: a faster point listed at the
    same size looked like a front that kept a dominated point."""
    sizes = [format_size(p) for p in peaks]
    return [f"{size} (+{format_size(peak - peaks[i - 1])})" if i and size == sizes[i - 1] and peak > peaks[i - 1]
            else size
            for i, (size, peak) in enumerate(zip(sizes, peaks))]


def print_profile(out: Console, profile) -> None:
    d = profile.data

    def say(text: str) -> None:  # a profile's text is anyone's: no terminal escapes from it
        out.print(printable(text))

    m, w = profile.model, profile.workload  # with their defaults (batch_size may be left out)
    say(f"profile {profile.path}")
    say(f"  model: {m.name} ({m.kind}, {m.family})  workload: {_workload_text(w)}")
    budget = d["budget"]
    say(f"  budget: {format_size(budget['memory_bytes'])} (margin {budget.get('margin', '0')})  "
        f"machine: {d['machine'].get('name')} ({d['machine'].get('device')})"
        + (f", {count(profile.threads, 'CPU thread')}" if profile.threads else ""))
    best = d["best"]
    speed = best.get("speedup_vs_baseline")
    say(f"  best: {best['latency_s']:.3f} s, {format_size(best['peak_memory_bytes'])}, "
        f"{format_size(budget['memory_bytes'] - best['peak_memory_bytes'])} headroom"
        + (f", {speed:.2f}x the baseline" if speed else "")
        + f"  [{config_changes(best['config'])}]")
    if d["study"].get("choice"):
        say(f"  choice: {d['study']['choice']}")
    # The pick is off the front when it was kept over a faster config within noise (the choice
    # line says why): it gets its row too, so the table holds what "best" names.
    # Configs compared complete: a knob left at its default may be deleted from the best by hand
    # (a documented edit), and its front point is still the best. (knobs imports torch: here, so
    # this module stays light.)
    from .knobs import complete

    def is_best(point) -> bool:  # by trial where both name one (a best edited without it was listed twice)
        trials = {point.get("trial"), best.get("trial")} - {None}
        return len(trials) <= 1 and complete(point["config"]) == complete(best["config"])

    rows = list(d["pareto"])
    off_front = not any(map(is_best, rows))
    if off_front:
        rows = sorted([*rows, best], key=lambda p: p["peak_memory_bytes"])
    table = Table(title="feasible Pareto front" + (", and the best (kept within noise, not on it)" if off_front else ""))
    for col in ("trial", "latency", "peak memory", "configuration"):
        table.add_column(col)
    for p, size in zip(rows, front_sizes([p["peak_memory_bytes"] for p in rows])):
        table.add_row(*map(printable, (f"{p.get('trial', '')}{' (best)' if is_best(p) else ''}",
                                        f"{p['latency_s']:.3f} s", size, config_changes(p["config"]))))
    out.print(table)
    s = d["study"]  # the figures a hand-edited profile lacks are left out, not shown as None
    # in the summary's words: a trial measured, and of those the ones that cannot be picked
    counts = ", ".join(count(s[key], noun) + " measured" if noun else
                       f"{s[key]} of them failed or cannot be picked (over the budget, below the quality guard, "
                       "failed when measured again, or now forbidden)"
                       for key, noun in (("trials", "trial"), ("infeasible", None)) if s.get(key) is not None)
    say(f"  study: {s.get('name', '?')}" + (f" in {s['storage']}" if s.get("storage") else "")
        + (f": {counts}" if counts else ""))


__all__ = ["terminal", "print_space", "print_header", "TrialProgress", "print_summary", "print_profile"]
