"""Comparing studies: two real tiny studies, the notebook executed on them, `autotune report`.

The charts are checked against the studies' data read straight from the Optuna storage here (not
through autotune.report): the drawn fronts, budgets, timeline bars and importance bars must hold
the measured trials."""

import base64
import io
import json
import re
import statistics
import textwrap
import warnings
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune import storages
from autotune.sizes import smallest_budget
from helpers import run_cli

SPACE = "knobs:\n  dtype: [float32, bfloat16]\n  channels_last: [false, true]\n  attention: [sdpa, sliced]\n"
# Two studies in one storage: a roomy budget with enough trials to rank knobs, and a tight one with
# too few (the importance chart must say so instead of failing). One thread per trial: two threads
# on a 2-core machine shared with other processes spun and ran 50x slower here.
STUDIES = {
    "roomy": ["--vram", "2GB", "--trials", "5", "--sampler-seed", "0"],
    "tight": ["--vram", "400MiB", "--trials", "3", "--sampler-seed", "3"],
}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """Two studies tuned for real by the CLI (tiny-sd15, 64x64, one step, one timed call)."""
    folder = tmp_path_factory.mktemp("studies")
    (folder / "space.yaml").write_text(SPACE)
    url = f"sqlite:///{folder / 'studies.db'}"
    for name, args in STUDIES.items():
        proc = run_cli("--model", "tiny-sd15", "--height", "64", "--width", "64", "--steps", "1",
                       "--repeats", "1", "--warmup", "1", "--threads", "1", "--space", "space.yaml", "--storage", url,
                       "--study-name", name, "--output", f"{name}.yaml", *args, cwd=folder)
        # 3: nothing fitted the tight budget; the study is there all the same
        assert proc.returncode in (0, 3), proc.stderr + proc.stdout
    return folder, url


def expected(url, name):
    """What the charts must show, computed here from the storage."""
    study = optuna.load_study(study_name=name, storage=url)
    measured = [t for t in study.trials if t.state == TrialState.COMPLETE and "result" in t.user_attrs
                and t.user_attrs.get("duplicate_of") is None]
    # a config measured again (--confirm): the median of its trials' latencies, the highest peak,
    # feasible only if every one of its trials was
    again = study.user_attrs.get("confirmations", {})

    def latency(t):
        runs = [t.user_attrs["result"]] + [c for c in again.get(str(t.number), []) if c["latency_s"] is not None]
        # those timed with a quarter core or more taken by other processes only where none was quiet
        quiet = [r["latency_s"] for r in runs if (r.get("cores_taken_by_others") or 0) < 0.25]
        return statistics.median(quiet or [r["latency_s"] for r in runs]) if len(runs) > 1 else runs[0]["latency_s"]

    def peak(t):
        return max([t.user_attrs["result"]["peak_memory_bytes"]] +
                   [c["peak_memory_bytes"] for c in again.get(str(t.number), []) if c["peak_memory_bytes"]])

    feasible = [t for t in measured if t.user_attrs["result"]["status"] == "ok" and t.user_attrs["violation"] <= 0
                and all(c["violation"] <= 0 for c in again.get(str(t.number), []))]
    front = []
    for t in sorted(feasible, key=lambda t: (peak(t), latency(t))):
        if not front or latency(t) < front[-1][1]:
            front.append((peak(t), latency(t)))
    timeline = {}
    for t in study.trials:
        if "confirmer" in t.user_attrs:
            kind = "confirmation"  # the claim on the confirmation phase: one bar for it
        elif t.state == TrialState.PRUNED:
            kind = "known not to fit" if "dominated_by" in t.user_attrs else "forbidden"
        elif t.state == TrialState.FAIL:
            kind = "interrupted"
        elif t.user_attrs.get("duplicate_of") is not None:
            kind = "duplicate"
        elif t.user_attrs["result"]["status"] != "ok":
            kind = t.user_attrs["result"]["status"]
        else:  # as the summary rules the config out: its confirmations too
            runs = [{"status": "ok", "violation": t.user_attrs["violation"]}] + again.get(str(t.number), [])
            judged = [r for r in runs if r["status"] in ("ok", "out_of_memory")]  # a crash says nothing of memory
            kind = ("over budget" if any(r["violation"] > 0 for r in judged) else
                    "failed again" if len(judged) < len(runs) else "ok")
        timeline[t.number] = kind
    ok = [t for t in measured if t.user_attrs["result"]["status"] == "ok"]
    return {
        "budget": study.user_attrs["request"]["budget_bytes"],
        "margin": study.user_attrs["request"]["margin"],  # "5%": a share of each budget
        "front": front,
        "timeline": timeline,
        "ok_trials": len(ok),
        "images": any("image" in t.user_attrs["result"] for t in measured),
    }


# Runs in the kernel after the notebook's own cells: reads back what its charts drew.
PROBE = textwrap.dedent(
    """
    import json as _json
    def _drawn(fig):
        out = {}
        for ax in fig.axes:
            for a in [*ax.lines, *ax.collections, *ax.patches, *ax.texts, *ax.images]:
                gid = a.get_gid()
                if not gid:
                    continue
                if hasattr(a, "get_xdata"):
                    out[gid] = [[float(v) for v in a.get_xdata()], [float(v) for v in a.get_ydata()]]
                elif hasattr(a, "get_offsets"):
                    out[gid] = [[float(x), float(y)] for x, y in a.get_offsets()]
                elif hasattr(a, "get_width"):
                    out[gid] = [float(a.get_x()), float(a.get_width())]
                else:
                    out[gid] = True
        out["texts"] = [t.get_text() for t in fig.texts]
        out["xlabels"] = [ax.get_xlabel() for ax in fig.axes]
        return out
    print("PROBE" + _json.dumps({
        "labels": {s.name: s.label for s in studies},
        "fronts": _drawn(fronts), "best_vs_budget": _drawn(best_vs_budget), "speedups": _drawn(speedups),
        "importance": _drawn(importance), "timeline": _drawn(timeline),
        "images": _drawn(images) if images is not None else None,
    }))
    """
)


def unit_of(label):
    return {"MiB": 2**20, "GiB": 2**30}[re.search(r"\((MiB|GiB)\)", label).group(1)]


def test_the_notebook_runs_on_two_studies_and_its_charts_hold_their_data(studies, tmp_path):
    from autotune.report import run_notebook

    folder, url = studies
    nb = run_notebook(url, out=tmp_path / "executed.ipynb", figures_dir=tmp_path / "figures",
                      cwd=folder, extra_cells=[PROBE])
    # Every chart cell showed a PNG, and it was exported.
    charts = ["fronts", "best_vs_budget", "speedups", "importance", "timeline"]
    shown = {c.metadata.get("autotune_figure"): [o for o in c.outputs if "image/png" in o.get("data", {})]
             for c in nb.cells if c.cell_type == "code"}
    for name in charts:
        assert shown[name], f"cell {name} showed no image"
        assert base64.b64decode(shown[name][-1]["data"]["image/png"]).startswith(PNG)
        assert (tmp_path / "figures" / f"{name}.png").read_bytes().startswith(PNG)
    assert "table" in str([o.get("data", {}).get("text/html") for c in nb.cells for o in c.get("outputs", [])])

    # The probe cell ran after them and printed what the charts drew.
    probe = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    probe_out = probe[probe.index("PROBE") + len("PROBE"):]
    drawn = json.loads(probe_out)
    assert set(drawn["labels"]) == set(STUDIES)
    for name in STUDIES:
        exp = expected(url, name)
        label = drawn["labels"][name]
        fronts = drawn["fronts"]
        scale = unit_of(fronts["xlabels"][0])
        if exp["front"]:
            xs, ys = fronts[f"front:{label}"]
            assert xs == pytest.approx([m / scale for m, _ in exp["front"]])
            assert ys == pytest.approx([lat for _, lat in exp["front"]])
            cx, cy = drawn["best_vs_budget"][f"budget-curve:{label}"]
            bscale = unit_of(drawn["best_vs_budget"]["xlabels"][0])
            # each step where its config fits: its peak and the study's margin at that budget
            # (5% of it, not of the study's budget: as a profile's fits() judges)
            assert cx[:-1] == pytest.approx([smallest_budget(m, exp["margin"]) / bscale for m, _ in exp["front"]])
            assert all(m + 0.05 * x * bscale <= x * bscale + 1 for (m, _), x in zip(exp["front"], cx))
            assert cy[:-1] == pytest.approx([lat for _, lat in exp["front"]])
            assert f"speedup:{label}" in drawn["speedups"]
        else:
            assert f"front:{label}" not in fronts
        budget = fronts[f"budget:{label}"]
        if budget[0]:  # a dashed line at the budget (none drawn for a budget far right of every point)
            assert budget[0] == pytest.approx([exp["budget"] / scale] * 2)
        # One timeline bar per trial, in its class.
        bars = {int(g.split(":")[2]): g.split(":")[3] for g in drawn["timeline"] if g.startswith(f"trial:{label}:")}
        assert bars == exp["timeline"]
        # Importance: bars for the study with enough trials, a note for the other.
        ranked = [g for g in drawn["importance"] if g.startswith(f"importance:latency:{label}:")]
        if exp["ok_trials"] >= 4:
            assert ranked
            assert sum(drawn["importance"][g][1] for g in ranked) == pytest.approx(1.0)
        else:
            assert not ranked
            assert any(label in t and "ranking knobs needs at least" in t for t in drawn["importance"]["texts"])
        assert (drawn["images"] is not None) >= exp["images"]


def test_report_command_writes_the_charts_and_an_index(studies, tmp_path):
    folder, url = studies
    out = tmp_path / "report"
    proc = run_cli("report", "--storage", url, "--out", out, cwd=folder)
    assert proc.returncode == 0, proc.stderr
    assert "compared 2 studies" in proc.stdout
    index = (out / "index.html").read_text()
    for name in ("fronts", "best_vs_budget", "speedups", "importance", "timeline"):
        assert (out / f"{name}.png").read_bytes().startswith(PNG)
        assert f'src="{name}.png"' in index
    assert "tiny-sd15 2GB cpu" in index and "tiny-sd15 400MB cpu" in index
    assert "autotune-best" in index  # the table of bests
    # without --out, into ./autotune-report (--out was required: a user's first `autotune report` failed)
    proc = run_cli("report", "--storage", url, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith(f"and {Path('autotune-report') / 'index.html'}\n"), proc.stdout
    assert (tmp_path / "autotune-report" / "fronts.png").read_bytes().startswith(PNG)

    # A profile and a study named explicitly, mixed.
    profile = folder / "roomy.yaml"
    out2 = tmp_path / "mixed"
    proc = run_cli("report", profile, "--storage", url, "--study", "tight", "--out", out2, cwd=folder)
    assert proc.returncode == 0, proc.stderr
    assert (out2 / "fronts.png").exists() and "compared 2 studies" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--storage", "sqlite:///nowhere.db", "--out", "o"], "no such file"),
        (["--storage", "{url}", "--study", "nope", "--out", "o"], "no study named 'nope'"),
        (["missing.yaml", "--out", "o"], "no such file"),
        (["what-is-this", "--out", "o"], "expected NAME@STORAGE_URL"),
        # a path given to --storage is a storage, never a profile ("not UTF-8 text" before)
        (["--storage", "{path}", "--out", "o"], "storage {path}: not a storage URL; for a SQLite file write {url}"),
        (["--storage", "{path}", "--study", "roomy", "--out", "o"], "for a SQLite file write {url}"),
        # no storage in this folder: export's hint, said only where the storage was not named
        (["--out", "o"], "no such file autotune-studies/studies.db (tuned with --workdir? give the same here)"),
        (["--study", "roomy", "--out", "o"], "(tuned with --workdir? give the same here)"),
    ],
)
def test_report_bad_input_is_one_line(studies, tmp_path, args, message):
    folder, url = studies
    path = url[len("sqlite:///"):]
    proc = run_cli("report", *[a.format(url=url, path=path) for a in args], cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(lines) == 1 and message.format(url=url, path=path) in lines[0], proc.stderr
    assert "--workdir" not in lines[0] or "--storage" not in args


# ---- images and failure classes: a study written here, with what the worker records ----------
def synthetic_study(tmp_path, images, fits=True):
    """A study in a SQLite file, shaped as study.tune writes it: a baseline, a faster config, an
    out-of-memory trial, a forbidden one; `images` maps trial number to a result["image"].
    `fits=False`: the two measured configs are over the budget."""
    url = f"sqlite:///{tmp_path / 'db' / 's.db'}"
    (tmp_path / "db").mkdir(exist_ok=True)
    study = optuna.create_study(study_name="synthetic", storage=url)
    study.set_user_attr("request", {"model": {"name": "tiny-sdxl"}, "workload": {"height": 64, "width": 64,
                        "steps": 1, "batch_size": 1}, "budget_bytes": 2**30, "device": "cpu"})
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"])}
    base = {"fuse_qkv": False, "quantize": "none", "channels_last": False, "attention": "sdpa",
            "vae_slicing": False, "vae_tiling": False, "offload": "none", "compile": "none"}
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    rows = [  # dtype, status, latency, peak, baseline
        ("float32", "ok", 2.0, 600 * 2**20, True),
        ("bfloat16", "ok", 1.0, 500 * 2**20, False),
        ("float32", "out_of_memory", None, None, False),
    ]
    for n, (dtype, status, latency, peak, is_base) in enumerate(rows):
        result = {"status": status, "latency_s": latency, "peak_memory_bytes": peak}
        if n in images:
            result["image"] = images[n]
        trial = optuna.trial.create_trial(
            params={"dtype": dtype}, distributions=dist, value=latency if latency else float("inf"),
            user_attrs={"config": {"dtype": dtype, **base}, "result": result, "baseline": is_base,
                        "violation": -0.5 if status == "ok" and fits else 1.0,
                        "violations": {"memory": -0.5 if status == "ok" and fits else 1.0}},
        )
        trial.datetime_start, trial.datetime_complete = t0 + timedelta(seconds=10 * n), t0 + timedelta(seconds=10 * n + 7)
        study.add_trial(trial)
    pruned = optuna.trial.create_trial(params={"dtype": "bfloat16"}, distributions=dist, state=TrialState.PRUNED,
                                       user_attrs={"config": {"dtype": "bfloat16", **base}, "forbidden": "x"})
    pruned.datetime_start = pruned.datetime_complete = t0 + timedelta(seconds=40)
    study.add_trial(pruned)
    # saves less memory than a config that ran out of it: not measured, and not forbidden either
    dominated = optuna.trial.create_trial(params={"dtype": "float32"}, distributions=dist, state=TrialState.PRUNED,
                                          user_attrs={"config": {"dtype": "float32", "vae_tiling": True}, "dominated_by": 0})
    dominated.datetime_start = dominated.datetime_complete = t0 + timedelta(seconds=41)
    study.add_trial(dominated)
    return url


def write_png(path, color):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), color).save(path)
    return path


def test_images_are_shown_where_kept_relative_or_absolute_and_missing_ones_are_skipped(tmp_path):
    from autotune import report

    absolute = write_png(tmp_path / "elsewhere" / "best.png", "red")
    write_png(tmp_path / "db" / "images" / "base.png", "blue")  # relative to the storage's folder
    url = synthetic_study(tmp_path, {0: "images/base.png", 1: str(absolute), 2: "images/gone.png"})
    (study,) = report.load(f"synthetic@{url}")
    chosen = report.chosen_images(study)
    assert [p for _, p in chosen] == [(tmp_path / "db" / "images" / "base.png").resolve(), absolute]
    assert chosen[1][0].startswith("best (trial 1)")
    fig = report.plot_images([study])
    shown = [im for ax in fig.axes for im in ax.images]
    assert len(shown) == 2 and shown[1].get_array()[0, 0].tolist() == [255, 0, 0]
    # a label holding a workload and a study's name stays inside the figure, wrapped
    study.label = "tiny-sd15 8GB cpu 1024x768 30 steps batch 2 [tiny-sd15-cpu-8GB-1024x768-30s-b2-0123abcd]"
    fig = report.plot_images([study])
    fig.canvas.draw()
    titles = [ax.title for ax in fig.axes if ax.images]
    assert all(fig.bbox.x0 <= t.get_window_extent().x0 and t.get_window_extent().x1 <= fig.bbox.x1 for t in titles)

    # Failure classes on the timeline, and a study without images is no error.
    timeline = report.plot_timeline([study])
    kinds = sorted(p.get_gid().split(":")[3] for ax in timeline.axes for p in ax.patches if p.get_gid())
    assert kinds == ["forbidden", "known not to fit", "ok", "ok", "out_of_memory"]  # "forbidden" twice before
    legend = [t.get_text() for t in timeline.axes[0].get_legend().get_texts()]
    assert "out_of_memory (1)" in legend and "known not to fit (1)" in legend and "forbidden (1)" in legend


def test_an_image_cut_short_or_not_an_image_is_said_unreadable_where_it_would_be(tmp_path):
    # the report stopped with a traceback on a trial's PNG cut short ("image file is truncated"),
    # an empty one, or a profile's image naming another kind of file (helper-11)
    import numpy as np
    from PIL import Image

    from autotune import report

    whole = write_png(tmp_path / "db" / "images" / "base.png", "blue")
    cut = tmp_path / "db" / "images" / "cut.png"
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)  # no run compresses away
    Image.fromarray(noise).save(cut)
    cut.write_bytes(cut.read_bytes()[:len(cut.read_bytes()) // 2])  # the header whole, half the pixels
    (tmp_path / "db" / "images" / "empty.png").write_bytes(b"")
    url = synthetic_study(tmp_path, {0: str(whole), 1: "images/cut.png", 2: "images/empty.png"})
    (study,) = report.load(f"synthetic@{url}")
    fig = report.plot_images([study])
    assert len([im for ax in fig.axes for im in ax.images]) == 1
    unreadable = [t.get_gid() for ax in fig.axes for t in ax.texts if (t.get_gid() or "").startswith("unreadable")]
    assert unreadable == [f"unreadable:{study.label}:cut.png"]  # trial 2 is not a chosen one


def test_the_timeline_draws_the_confirmation_phase_and_counts_only_the_searchs_trials(tmp_path):
    """A study's confirmation phase (the claim a worker holds while it measures the contenders
    again) is one bar, and neither it nor the proposals not measured count as trials."""
    from autotune import report

    url = synthetic_study(tmp_path, {})
    study = optuna.load_study(study_name="synthetic", storage=url)
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    # its heartbeat_at as on SQLite: the moment it was claimed, never updated (RDB heartbeats are Optuna's)
    claim = optuna.trial.create_trial(params={}, distributions={}, state=TrialState.FAIL,
                                      user_attrs={"confirmer": "host:1", "heartbeat_at": (t0 + timedelta(seconds=41)).timestamp()})
    claim.datetime_start, claim.datetime_complete = t0 + timedelta(seconds=41), t0 + timedelta(seconds=60)
    study.add_trial(claim)
    # a claim that lost the race to another worker's: it never held the phase
    lost = optuna.trial.create_trial(params={}, distributions={}, state=TrialState.FAIL,
                                     user_attrs={"confirmer": "host:2", "withdrawn": True,
                                                 "heartbeat_at": (t0 + timedelta(seconds=41)).timestamp()})
    lost.datetime_start = lost.datetime_complete = t0 + timedelta(seconds=41)
    study.add_trial(lost)
    # a duplicate of a config another worker was measuring (told FAIL): not a failed trial
    twin = optuna.trial.create_trial(params={"dtype": "bfloat16"}, distributions=study.trials[1].distributions,
                                     state=TrialState.FAIL, user_attrs={"duplicate_of_running": 1})
    twin.datetime_start = twin.datetime_complete = t0 + timedelta(seconds=12)
    study.add_trial(twin)
    # a trial stopped by Ctrl-C: it measured nothing, and its config was queued again
    stopped = optuna.trial.create_trial(params={"dtype": "bfloat16"}, distributions=study.trials[1].distributions,
                                        state=TrialState.FAIL, user_attrs={})
    stopped.datetime_start, stopped.datetime_complete = t0 + timedelta(seconds=30), t0 + timedelta(seconds=35)
    study.add_trial(stopped)
    fitted = {"status": "ok", "latency_s": 1.0, "peak_memory_bytes": 500 * 2**20, "violation": -0.5}
    study.set_user_attr("confirmations", {"0": [fitted, fitted], "1": [fitted, fitted]})  # the phase's trials
    (data,) = report.load(f"synthetic@{url}")
    spans = {sp.trial: (sp.kind, sp.start_s, sp.end_s) for sp in data.timeline}
    assert spans[4][0] == "known not to fit"  # synthetic_study's last trial
    assert spans[5] == ("confirmation", 41.0, 60.0) and 6 not in spans and spans[7][0] == "duplicate"
    assert spans[8][0] == "interrupted"
    fig = report.plot_timeline([data])
    # not 8 trials, 3 failed: the interrupted one measured nothing, and failed at nothing
    assert fig.axes[0].get_yticklabels()[0].get_text().endswith("3 trials, 1 failed")
    # one bar, and the four trials it measured again (it counted as one)
    assert "confirmation phase (4 trials measured again)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "confirmation phase: 4 trials measured again" in report.overview_html([data])


def test_the_timeline_classes_a_trial_as_its_confirmations_rule_its_config_out(tmp_path):
    """A trial that fit, whose config went over the budget or crashed when measured again, is not
    "ran and fits" on the timeline: the summary (and the console) rule it out (it was before)."""
    from autotune import report

    url = synthetic_study(tmp_path, {})
    study = optuna.load_study(study_name="synthetic", storage=url)
    fitted = {"status": "ok", "latency_s": 1.0, "peak_memory_bytes": 500 * 2**20, "violation": -0.5}
    study.set_user_attr("confirmations", {
        "0": [fitted, {**fitted, "violation": 0.1}],  # the baseline, over the budget once
        "1": [fitted, {"status": "crashed", "latency_s": None, "peak_memory_bytes": None, "violation": 1.0}],
    })
    (data,) = report.load(f"synthetic@{url}")
    spans = {sp.trial: sp.kind for sp in data.timeline}
    assert spans[0] == "over budget" and spans[1] == "failed again"
    assert data.best is None and "failed when measured again" in data.no_best
    legend = [t.get_text() for t in report.plot_timeline([data]).axes[0].get_legend().get_texts()]
    assert "failed when measured again (1)" in legend and not any(t.startswith("ran and fits") for t in legend)
    from autotune.console import RULED_OUT_SAID  # every reason has a class the timeline colours
    assert {said.timeline for said in RULED_OUT_SAID.values()} <= set(report.CLASS_COLORS)


def test_best_under_a_budget_is_the_fastest_of_the_front_that_fits_it(tmp_path):
    """report.best_under, for a notebook's "what would this study pick at 6 GB": the fastest
    point of the feasible front whose peak plus the study's margin is within that budget."""
    from autotune import report

    (data,) = report.load(f"synthetic@{synthetic_study(tmp_path, {})}")
    (fastest,) = data.front  # bfloat16 (500 MiB, 1.0 s) dominates the baseline (600 MiB, 2.0 s)
    assert report.best_under(data, 2**30) is fastest and report.best_under(data, 500 * 2**20) is fastest
    assert report.best_under(data, 500 * 2**20 - 1) is None
    data.margin = "10%"  # a share of each budget: 500 MiB fits from 555.6 MiB on
    assert report.best_under(data, 555 * 2**20) is None and report.best_under(data, 556 * 2**20) is fastest


def test_the_speedup_words_lie_beside_their_bar_and_over_the_one_x_line(tmp_path):
    # they were written across the bar, and the dashed 1.0x line ran through them
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from autotune import report

    (data,) = report.load(f"synthetic@{synthetic_study(tmp_path, {})}")
    fig = report.plot_speedups([data])
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.axes[0]
    (words,) = [t for t in ax.texts if t.get_text().startswith("2.00x")]
    (bar,) = [p for p in ax.patches if p.get_gid() == f"speedup:{data.label}"]
    assert not words.get_window_extent(renderer).overlaps(bar.get_window_extent(renderer))
    (line,) = ax.lines
    assert words.get_bbox_patch() is not None and words.get_zorder() > line.get_zorder()


def cpu_study(label, budget_bytes, margin_bytes, points, front, best):
    """A report.StudyData of one budget on a CPU, built from points (its baseline among them)."""
    from autotune import report

    baseline = next(p for p in points if p.baseline)
    return report.StudyData(label=label, name=label, storage=None, model={}, workload={}, device="cpu",
                            budget_bytes=budget_bytes, margin=f"{margin_bytes}B",
                            points=points, front=front, best=best, baseline=baseline)


def test_best_vs_budget_keeps_a_narrow_front_readable():
    # two configs 0.03 ms apart filled the axis top to bottom, with no tick labels (a log scale
    # chosen for a slow float16 trial the chart does not draw), and the label ran off the right edge
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from autotune import report

    MiB = 2**20
    fast = report.Point(1, {"dtype": "bfloat16"}, 0.09230, 512 * MiB)
    kept = report.Point(2, {"dtype": "bfloat16"}, 0.09233, 516 * MiB)
    slow = report.Point(3, {"dtype": "float16"}, 4.1, 600 * MiB, feasible=False)
    base = report.Point(0, {}, 0.35, 520 * MiB, baseline=True)
    study = cpu_study("s", 545 * MiB, 27 * MiB, points=[base, fast, kept, slow], front=[fast], best=kept)
    fig = report.plot_best_vs_budget([study])
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert ax.get_yscale() == "linear" and high >= 1.09 * low
    renderer = FigureCanvasAgg(fig).get_renderer()
    assert [t for t in ax.get_yticklabels() if t.get_text()] and not ax.yaxis.get_offset_text().get_text()
    (label,) = ax.texts
    assert fig.bbox.contains(*label.get_window_extent(renderer).p1)


def test_best_vs_budget_says_why_a_pick_stands_above_its_curve_and_names_a_budget_off_the_axis():
    # a pick kept within noise over a faster config sat above the curve unexplained, and a budget
    # far beyond every point was not drawn and not said
    from autotune import report

    MiB = 2**20
    base = report.Point(0, {}, 0.35, 520 * MiB, baseline=True)
    fast = report.Point(1, {"dtype": "bfloat16", "channels_last": True}, 0.100, 500 * MiB)
    kept = report.Point(2, {"dtype": "bfloat16"}, 0.102, 505 * MiB)
    near = cpu_study("near", 600 * MiB, 30 * MiB, points=[base, fast, kept], front=[fast], best=kept)
    near.choice_note = "kept trial 2 (1 knob changed, ...) over trial 1 (2 knobs changed, ...)"
    roomy = cpu_study("roomy", 64 * 1024 * MiB, 30 * MiB, points=[base, fast], front=[fast], best=fast)
    fig = report.plot_best_vs_budget([near, roomy])
    ax = fig.axes[0]
    (label,) = [t.get_text() for t in ax.texts]
    assert label.startswith("0.102 s (3.43x baseline)") and "picked within noise of trial 1's 0.100 s" in label
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["near", "roomy\n(budget 64.00 GiB, off the axis: picked 0.100 s)"]
    assert "at-budget:roomy" not in [line.get_gid() for line in ax.lines]
    # a faster point the pick was not kept over (confirmation stopped by --timeout before it): not noise
    near.choice_note = None
    (label,) = [t.get_text() for t in report.plot_best_vs_budget([near]).axes[0].texts]
    assert label.endswith("\ntrial 1's 0.100 s was not measured again"), label
    # the pick on the curve: no such words
    on_curve = cpu_study("on", 600 * MiB, 30 * MiB, points=[base, fast], front=[fast], best=fast)
    (label,) = [t.get_text() for t in report.plot_best_vs_budget([on_curve]).axes[0].texts]
    assert label == "0.100 s (3.50x baseline)"


def test_budget_labels_of_studies_with_one_budget_and_close_latencies_do_not_cover_each_other():
    # two machines tuned at one budget, bests 1 ms apart: their labels were written on one spot
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from autotune import report

    MiB = 2**20
    studies = []
    for label, latency in (("a10", 0.500), ("l4", 0.501), ("t4", 0.502)):
        base = report.Point(0, {}, 1.0, 900 * MiB, baseline=True)
        best = report.Point(1, {"dtype": "bfloat16"}, latency, 600 * MiB)
        studies.append(cpu_study(label, 1024 * MiB, 50 * MiB, points=[base, best], front=[best], best=best))
    fig = report.plot_best_vs_budget(studies)
    renderer = FigureCanvasAgg(fig).get_renderer()
    boxes = [t.get_window_extent(renderer) for t in fig.axes[0].texts]
    assert len(boxes) == 3
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_a_killed_confirmers_bar_ends_at_its_last_heartbeat_on_a_journal(tmp_path):
    # its claim beats in heartbeat_at there; failed as stale an hour later, the bar ran to then
    from autotune import report
    from autotune.storages import open_storage

    url = f"journal:{tmp_path / 'j.log'}"
    study = optuna.create_study(study_name="j", storage=open_storage(url))
    study.set_user_attr("request", REQUEST)
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"])}
    t0 = datetime(2026, 1, 1, 12)
    trial = optuna.trial.create_trial(params={"dtype": "float32"}, distributions=dist, value=1.0,
                                      user_attrs={"config": {"dtype": "float32"}, "violation": -1.0,
                                                  "result": {"status": "ok", "latency_s": 1.0, "peak_memory_bytes": 2**20}})
    trial.datetime_start, trial.datetime_complete = t0, t0 + timedelta(seconds=5)
    claim = optuna.trial.create_trial(params={}, distributions={}, state=TrialState.FAIL,
                                      user_attrs={"confirmer": "host:1", "heartbeat_at": (t0 + timedelta(seconds=50)).timestamp()})
    claim.datetime_start, claim.datetime_complete = t0 + timedelta(seconds=6), t0 + timedelta(seconds=3600)
    for t in (trial, claim):
        study.add_trial(t)
    (data,) = report.load(f"j@{url}")
    assert [(sp.kind, sp.end_s) for sp in data.timeline if sp.kind == "confirmation"] == [("confirmation", 50.0)]
    # the journal file by its path, as a SQLite file is taken: it was read as a profile, "not valid
    # YAML" (helper-16)
    (by_path,) = report.load(str(tmp_path / "j.log"))
    assert (by_path.name, by_path.storage) == ("j", url)


def test_no_images_and_too_few_trials_are_notes_not_errors(tmp_path):
    from autotune import report

    url = synthetic_study(tmp_path, {})
    (study,) = report.load(url)  # a bare URL: every study in it
    assert report.plot_images([study]) is None
    importances, note = report.knob_importance(study)
    assert importances == {} and "2 successful trials;" in note
    assert report.write_report([study], tmp_path / "out")[-1].name == "index.html"


def test_what_more_memory_would_buy_leaves_out_configs_ruled_out_besides_the_budget(tmp_path):
    """The dotted line of the best-vs-budget chart drew a config below the quality guard as what
    more memory would buy: it would not be picked under any budget (helper 62)."""
    from autotune import report

    url = synthetic_study(tmp_path, {})
    study = optuna.load_study(study_name="synthetic", storage=url)
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"])}
    for n, (latency, violations) in enumerate([(0.5, {"memory": 0.3, "quality": 0.2}), (0.7, {"memory": 0.2})]):
        config = {"dtype": "bfloat16", "quantize": ("int8dq", "int8wo")[n]}
        trial = optuna.trial.create_trial(
            params={"dtype": "bfloat16"}, distributions=dist, value=latency,
            user_attrs={"config": config, "violation": max(violations.values()), "violations": violations,
                        "result": {"status": "ok", "latency_s": latency, "peak_memory_bytes": 900 * 2**20}})
        trial.datetime_start = trial.datetime_complete = datetime(2026, 1, 1, 12, 1, n)
        study.add_trial(trial)
    (data,) = report.load(f"synthetic@{url}")
    below_the_guard, over_the_budget = (p for p in data.points if p.latency_s in (0.5, 0.7))
    assert below_the_guard.ruled_out_otherwise == "quality" and over_the_budget.ruled_out_otherwise is None
    over = report._unbudgeted_front(data.points)
    assert over_the_budget in over and below_the_guard not in over


def test_a_study_stopped_half_way_says_so_and_a_baseline_that_failed_is_named(tmp_path):
    """A study stopped by Ctrl-C with a trial still queued was reported as if finished; a speedup
    row said "no baseline measured" of a baseline that ran out of memory (helper 62)."""
    from autotune import report

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="halfway", storage=url)
    study.set_user_attr("request", {"model": {"name": "tiny-sdxl"}, "workload": {"height": 64, "width": 64,
                        "steps": 1, "batch_size": 1}, "budget_bytes": 2**30, "device": "cpu"})
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"])}
    for n, (dtype, result) in enumerate([("float32", {"status": "out_of_memory", "latency_s": None}),
                                         ("bfloat16", {"status": "ok", "latency_s": 1.0, "peak_memory_bytes": 2**20})]):
        trial = optuna.trial.create_trial(
            params={"dtype": dtype}, distributions=dist, value=result["latency_s"] or float("inf"),
            user_attrs={"config": {"dtype": dtype}, "baseline": n == 0, "result": result,
                        "violation": 1.0 if n == 0 else -0.5, "violations": {"memory": 1.0 if n == 0 else -0.5}})
        trial.datetime_start = trial.datetime_complete = datetime(2026, 1, 1, 12, 0, n)
        study.add_trial(trial)
    study.enqueue_trial({"dtype": "bfloat16"})  # what Ctrl-C leaves: the trial it stopped, queued again
    (data,) = report.load(f"halfway@{url}")
    assert "halfway: unfinished (1 queued); its figures are as they stand" in " ".join(data.notes)
    assert data.best is not None and data.baseline.status == "out_of_memory"
    texts = [t.get_text() for t in report.plot_speedups([data]).axes[0].texts]
    assert "no speedup: the baseline ended out_of_memory" in texts


def test_a_study_name_with_spaces_or_an_at_sign_can_be_given(tmp_path):
    """--study-name takes any name, but one with spaces could not be given in a string of sources
    (AUTOTUNE_STUDIES), and one with '@' not at all: the name was cut at its first '@' (helper 62)."""
    from autotune import report

    url = f"sqlite:///{tmp_path / 's.db'}"
    name = "team@gpu1 café run"
    study = optuna.create_study(study_name=name, storage=url)
    study.set_user_attr("request", {"model": {"name": "tiny-sdxl"}, "workload": {"height": 64, "width": 64,
                        "steps": 1, "batch_size": 1}, "budget_bytes": 2**30, "device": "cpu"})
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"])}
    trial = optuna.trial.create_trial(
        params={"dtype": "float32"}, distributions=dist, value=1.0,
        user_attrs={"config": {"dtype": "float32"}, "baseline": True, "violation": -0.5, "violations": {"memory": -0.5},
                    "result": {"status": "ok", "latency_s": 1.0, "peak_memory_bytes": 2**20}})
    trial.datetime_start = trial.datetime_complete = datetime(2026, 1, 1, 12)
    study.add_trial(trial)
    for given in ([f"{name}@{url}"], f"'{name}@{url}'", {"sources": [], "storage": url, "studies": [name]},
                  [f"{name}@{tmp_path / 's.db'}"]):
        (data,) = report.load(**given) if isinstance(given, dict) else report.load(given)
        assert data.name == name and data.best.latency_s == 1.0, given
    assert storages.study_and_storage("a@postgresql://user:pw@host/db") == ("a", "postgresql://user:pw@host/db")
    # a quote no shell would close is a path's apostrophe, kept as written (helper 64)
    assert report._entries("/tmp/O'Brien/s.db b.yaml") == ["/tmp/O'Brien/s.db", "b.yaml"]
    # a SQLite file that is not there is named as what follows the last '@' (helper 64)
    with pytest.raises(report.ReportError, match="no such file missing.db"):
        report.load([f"{name}@missing.db"])


def test_the_fronts_chart_draws_where_a_peak_fits_beside_the_budget(tmp_path):
    # a point just left of the budget's line read as fitting, when its peak plus the margin did not
    from autotune import report

    (data,) = report.load(synthetic_study(tmp_path, {}))
    data.budget_bytes, data.margin = 800 * 2**20, "5%"
    lines = {ln.get_gid(): ln for ln in report.plot_fronts([data]).axes[0].lines}
    assert set(lines[f"budget:{data.label}"].get_xdata()) == {800}  # axvline: two points, one x
    assert list(lines[f"fits-below:{data.label}"].get_xdata()) == pytest.approx([760, 760], abs=0.01)
    data.margin = "0"
    assert f"fits-below:{data.label}" not in {ln.get_gid() for ln in report.plot_fronts([data]).axes[0].lines}


def test_knob_importance_ranks_a_knob_the_baseline_does_not_have(tmp_path):
    """The knobs ranked were the first trial's, the baseline's: a conditional knob (a compile
    mode, drawn only where compile is on) was never ranked, and its effect went to others."""
    from autotune import report

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="conditional", storage=url)
    study.set_user_attr("request", {"model": {"name": "tiny-sdxl"}, "workload": {"height": 64, "width": 64,
                        "steps": 1, "batch_size": 1}, "budget_bytes": 2**30, "device": "cpu"})
    dists = {"dtype": CategoricalDistribution(["float32", "bfloat16"]),
             "compile": CategoricalDistribution(["none", "default"]),
             "compile_mode": CategoricalDistribution(["default", "max-autotune"])}
    t0 = datetime(2026, 1, 1, 12)
    rows = [({"dtype": "float32", "compile": "none"}, 2.0)]  # the baseline: no compile_mode
    rows += [({"dtype": ("float32", "bfloat16")[n % 2], "compile": "default",
               "compile_mode": ("default", "max-autotune")[n // 2 % 2]}, (1.5, 0.5)[n // 2 % 2]) for n in range(12)]
    for n, (params, latency) in enumerate(rows):
        trial = optuna.trial.create_trial(
            params=params, distributions={k: dists[k] for k in params}, value=latency,
            user_attrs={"config": params, "baseline": n == 0, "violation": -0.5, "violations": {"memory": -0.5},
                        "result": {"status": "ok", "latency_s": latency, "peak_memory_bytes": 2**20}})
        trial.datetime_start, trial.datetime_complete = t0 + timedelta(seconds=n), t0 + timedelta(seconds=n + 1)
        study.add_trial(trial)
    (data,) = report.load(f"conditional@{url}")
    importances, note = report.knob_importance(data)
    assert note is None and max(importances, key=importances.get) == "compile_mode", importances


def test_a_report_folder_that_cannot_be_written_is_one_line(tmp_path):
    from autotune import report

    url = synthetic_study(tmp_path, {})
    (study,) = report.load(url)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "taken" / "index.html").mkdir(parents=True)  # not a report's page
    for out, message in [
        (tmp_path / "a-file", "cannot create the folder (a file is in the way)"),
        (tmp_path / "a-file" / "sub", "cannot create the folder (Not a directory)"),
        (Path("/proc/autotune-report"), "cannot create the folder"),
        (tmp_path / "taken", "it holds index.html, which no autotune report wrote there"),  # a folder there
    ]:
        with pytest.raises(report.ReportError) as exc:
            report.write_report([study], out)
        assert message in str(exc.value) and "\n" not in str(exc.value), exc.value
    proc = run_cli("report", url, "--out", "/proc/autotune-report", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "autotune: error: report /proc/autotune-report: cannot create the folder (No such file or directory)"]


def test_studies_autotune_did_not_make_are_left_out_or_refused(tmp_path):
    # a storage may hold other Optuna studies: a whole storage reads autotune's alone, and one
    # named explicitly is refused in a line (before, they came out as '?' columns)
    from autotune import report

    url = synthetic_study(tmp_path, {})
    optuna.create_study(study_name="someone-elses", storage=url)
    assert [s.name for s in report.load(url)] == ["synthetic"]
    with pytest.raises(report.ReportError, match="study 'someone-elses' was not made by autotune"):
        report.load(f"someone-elses@{url}")
    bare = f"sqlite:///{tmp_path / 'plain.db'}"
    optuna.create_study(study_name="plain", storage=bare)
    with pytest.raises(report.ReportError, match="holds no study made by autotune"):
        report.load(bare)


@pytest.mark.parametrize("field, value, said", [
    ("model", [1], "model [1] is not a mapping"),
    ("workload", [1], "workload must be a mapping of height, width, steps"),
    ("workload", {"height": [64], "width": 64, "steps": 1}, "workload height must be a positive multiple of 8"),
    ("budget_bytes", "x", "budget_bytes 'x' is not a positive number of bytes"),
    ("device", ["cpu"], "device ['cpu'] is not cpu, cuda or cuda:N"),
    ("margin", "abc", "'abc' is not a margin"),
])
def test_a_study_whose_stored_request_is_malformed_is_refused_in_a_line(tmp_path, field, value, said):
    # an edited request was read unchecked: a list model was an AttributeError in the labels, a
    # budget of "x" a TypeError in short_size; export refuses the same studies in a line
    from autotune import report

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="edited", storage=url)
    study.set_user_attr("request", {**REQUEST, field: value})
    with pytest.raises(report.ReportError) as exc:
        report.load(f"edited@{url}")
    assert str(exc.value).startswith(f"storage {url}: study 'edited': its stored request is malformed: {said}")
    if field == "model":  # the CLI's line, exit 1
        proc = run_cli("report", f"edited@{url}", "--out", tmp_path / "out", cwd=tmp_path)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines() == [f"autotune: error: {exc.value}"]


def stopped_study(url, name, budget_bytes):
    """A study as Ctrl-C leaves it before its first trial ended: the request, the interrupted
    trial failed, its config queued again."""
    study = optuna.create_study(study_name=name, storage=url)
    study.set_user_attr("request", {"model": {"name": "stopped-model"}, "workload": {"height": 64, "width": 64,
                        "steps": 1, "batch_size": 1}, "budget_bytes": budget_bytes, "device": "cpu"})
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"])}
    failed = optuna.trial.create_trial(params={"dtype": "float32"}, distributions=dist, state=TrialState.FAIL,
                                       user_attrs={"baseline": True})
    failed.datetime_start, failed.datetime_complete = datetime(2026, 1, 1, 12), datetime(2026, 1, 1, 12, 0, 5)
    study.add_trial(failed)
    study.enqueue_trial({"dtype": "float32"}, user_attrs={"baseline": True})


def drawn_text(fig) -> str:
    """Every gid, text, tick label and legend entry a figure holds, as one string."""
    out = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        out += [a.get_gid() or "" for a in [*ax.lines, *ax.collections, *ax.patches, *ax.texts, *ax.images]]
        out += [t.get_text() for t in [*ax.texts, *ax.get_yticklabels(), *ax.get_xticklabels()]]
        if ax.get_legend():
            out += [t.get_text() for t in ax.get_legend().get_texts()]
    return "\n".join(out)


def test_studies_stopped_before_a_measurement_are_a_row_not_chart_clutter(tmp_path):
    # they said "nothing fits the budget", were "a profile without its study" in the notes, and
    # two dozen of them buried the charts (matplotlib: "axes sizes collapsed to zero")
    from autotune import report

    url = synthetic_study(tmp_path, {})
    for i in range(20):
        stopped_study(url, f"stopped-{i}", (i + 2) * 2**30)
    studies = report.load(url)
    assert [s.measured for s in studies] == [True] + [False] * 20
    rows = report.best_table(studies)
    assert rows[0]["configuration"] == "dtype=bfloat16"
    assert {r["configuration"] for r in rows[1:]} == {"no trial completed a measurement"}
    for name, fig in report.figures(studies).items():
        assert "stopped-model" not in drawn_text(fig), name
        assert "tiny-sdxl 1GB cpu" in drawn_text(fig), name
    assert "stopped-model" in report.knob_importance(studies[1])[1]
    assert "profile" not in report.knob_importance(studies[1])[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report.write_report(studies, tmp_path / "out")
    assert not [str(w.message) for w in caught], [str(w.message) for w in caught]
    index = (tmp_path / "out" / "index.html").read_text()
    assert "stopped-0: no trial completed a measurement (left out of the charts)" in index
    assert "profile without its study" not in index


def test_a_storage_with_only_a_stopped_study_reports_it_without_charts(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    stopped_study(url, "stopped", 2**30)
    proc = run_cli("report", url, "--out", "out", cwd=tmp_path)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert "compared 1 study: stopped-model 1GB cpu" in proc.stdout  # not "1 studies"
    assert "wrote 0 charts" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["index.html"]
    assert "<td>no trial completed a measurement</td>" in (tmp_path / "out" / "index.html").read_text()


# ---- sources: storages given as paths, files a report must not write, the same source twice ----
def test_a_sqlite_file_is_read_as_its_storage_and_never_written_when_it_holds_no_study(tmp_path):
    # a .db path was read as a profile ("not UTF-8 text"); a 0-byte file got Optuna's tables
    # (112 KiB written by a report that only reads)
    import sqlite3
    from autotune import report
    from autotune.storages import sqlite_url

    synthetic_study(tmp_path, {})
    db = tmp_path / "db" / "s.db"
    for source in [str(db), f"synthetic@{db}", sqlite_url(db)]:
        assert [s.name for s in report.load(source)] == ["synthetic"], source
    renamed = tmp_path / "studies.sqlite"  # no .db: the SQLite header tells
    renamed.write_bytes(db.read_bytes())
    assert [s.name for s in report.load(str(renamed))] == ["synthetic"]
    with pytest.raises(report.ReportError, match=r"not a storage URL; for a SQLite file write sqlite:///"):
        report.load([], storage=str(db))

    zero = tmp_path / "zero.db"
    zero.write_bytes(b"")
    foreign = tmp_path / "foreign.db"  # another program's database
    with sqlite3.connect(foreign) as con:
        con.execute("CREATE TABLE notes (text TEXT)")
    before = foreign.read_bytes()
    for source, message in [
        (f"sqlite:///{zero}", "it holds no study made by autotune"),
        (str(zero), "it holds no study made by autotune"),
        (f"x@sqlite:///{zero}", "no study named 'x' (it holds: none)"),
        (f"sqlite:///{foreign}", "it holds no study made by autotune"),
        (f"sqlite:///{tmp_path / 'missing.db'}", "no such file"),
    ]:
        with pytest.raises(report.ReportError, match=re.escape(message)):
            report.load(source)
    assert zero.read_bytes() == b"" and foreign.read_bytes() == before
    assert not (tmp_path / "missing.db").exists()


def test_the_same_profile_or_study_given_twice_is_compared_once(studies, tmp_path, monkeypatch):
    # it was compared with itself, as "#1" and "#2"
    from autotune import report

    folder, url = studies
    monkeypatch.chdir(folder)
    loaded = report.load(["roomy.yaml", str(folder / "roomy.yaml"), "./roomy.yaml", f"roomy@{url}",
                          f"roomy@sqlite:///{folder}/./studies.db", "tight@studies.db", url])
    assert [(s.name, s.source) for s in loaded] == [("roomy", "profile"), ("tight", "study")]
    assert [s.label for s in loaded] == ["tiny-sd15 2GB cpu", "tiny-sd15 400MB cpu"]
    assert "roomy: given again (./roomy.yaml), compared once" in loaded[0].notes


def profile_recording(studies, path: Path, storage: str) -> Path:
    """The roomy study's profile, written to `path` as recording `storage` for its study."""
    folder, _ = studies
    text = (folder / "roomy.yaml").read_text()
    path.write_text(text.replace(re.search(r"storage: (\S+)", text).group(1), storage))
    return path


def test_a_storage_password_is_masked_in_the_report(studies, tmp_path):
    # a profile that records a database server's URL (as written before profiles masked it)
    from autotune import report

    profile = profile_recording(studies, tmp_path / "server.yaml", "postgresql://tuner:hunter2@127.0.0.1:1/studies")
    loaded = report.load([str(profile)])
    report.write_report(loaded, tmp_path / "out")
    index = (tmp_path / "out" / "index.html").read_text()
    assert "tuner:***@127.0.0.1:1/studies" in index
    assert "hunter2" not in index and "hunter2" not in " ".join(loaded[0].notes)


def test_a_profiles_baseline_over_its_budget_is_not_marked_feasible(studies, tmp_path):
    # Point.feasible defaulted to True: a profile's baseline was "feasible" whatever its peak
    from autotune import report

    profile = profile_recording(studies, tmp_path / "p.yaml", "postgresql://tuner:***@127.0.0.1:1/studies")
    (loaded,) = report.load([str(profile)])
    assert loaded.baseline.feasible  # within 2 GB
    doc = yaml.safe_load(profile.read_text())
    best = doc["best"]["peak_memory_bytes"]
    doc["baseline"]["peak_memory_bytes"] = 2 * best  # a baseline that needs more than the best
    doc["budget"].update(memory_bytes=3 * best // 2, margin="0", margin_bytes=0)
    profile.write_text(yaml.safe_dump(doc, sort_keys=False))
    (loaded,) = report.load([str(profile)])
    assert not loaded.baseline.feasible and loaded.best.feasible


def test_a_profile_recorded_with_a_masked_password_is_not_tried_with_it(studies, tmp_path):
    # profiles record postgresql://user:***@host: connecting with "***" fails, and failed logins
    # can lock the account
    from autotune import report

    profile = profile_recording(studies, tmp_path / "server.yaml", "postgresql://tuner:***@127.0.0.1:1/studies")
    (loaded,) = report.load([str(profile)])
    assert loaded.notes == ["server.yaml: its study storage postgresql://tuner:***@127.0.0.1:1/studies is recorded "
                            "without its password: front and best from the profile only; give NAME@STORAGE_URL "
                            "for its trials"]


def test_profiles_of_two_machines_whose_studies_are_not_here_are_both_compared(studies, tmp_path):
    """Two machines tuned alike record one study name and one relative storage path; with the
    storage absent, one of the two was dropped as "given again"."""
    from autotune import report

    for machine in ("a10", "l4"):
        profile_recording(studies, tmp_path / f"{machine}.yaml", "sqlite:///autotune-studies/studies.db")
    loaded = report.load([str(tmp_path / "a10.yaml"), str(tmp_path / "l4.yaml")])
    assert [s.origin for s in loaded] == ["a10.yaml", "l4.yaml"]


def test_two_profiles_of_one_study_written_at_different_times_are_both_compared(studies, tmp_path, monkeypatch):
    """One exported halfway, one at the end: the later one was dropped as "given again", and the
    halfway figures drawn (helper-16). Each says its own best now, labelled by its file."""
    from autotune import report

    folder, _ = studies
    monkeypatch.chdir(folder)
    halfway = tmp_path / "halfway.yaml"
    doc = yaml.safe_load((folder / "roomy.yaml").read_text())
    slower = doc["best"]["latency_s"] * 1.5
    for point in [doc["best"], *doc["pareto"]]:
        if point["trial"] == doc["best"]["trial"]:
            point["latency_s"] = slower
    halfway.write_text(yaml.safe_dump(doc, sort_keys=False))
    loaded = report.load([str(halfway), "roomy.yaml"])
    assert [(s.origin, s.best.latency_s == slower) for s in loaded] == [("halfway.yaml", True), ("roomy.yaml", False)]
    assert len({s.label for s in loaded}) == 2
    assert not any("given again" in note for s in loaded for note in s.notes)


# ---- charts: what they draw matches what they say ---------------------------------------------
def test_best_vs_budget_draws_a_study_where_nothing_fits_dotted_as_its_title_says(tmp_path):
    # it drew nothing but a legend entry, under "dotted: measured over the budget"
    from autotune import report

    (study,) = report.load(synthetic_study(tmp_path, {}, fits=False))
    assert study.best is None and not study.front
    fig = report.plot_best_vs_budget([study])
    ax = fig.axes[0]
    assert "dotted: measured over the budget" in ax.get_title()
    (line,) = [ln for ln in ax.lines if ln.get_gid() == f"over-budget:{study.label}"]
    assert line.get_linestyle() == ":"
    # the fastest measurement at each peak, the budget ignored: 500 MiB at 1.0 s beats 600 MiB at 2.0 s
    assert list(line.get_xdata()) == [500] and list(line.get_ydata()) == [1.0]
    # where everything fits, no dotted line, and the title says nothing of one (helper-10)
    (tmp_path / "fits").mkdir()
    (fitting,) = report.load(synthetic_study(tmp_path / "fits", {}))
    title = report.plot_best_vs_budget([fitting]).axes[0].get_title()
    assert title == "Fastest measured latency against budget", title
    # its 1 GiB budget lies far right of its points: said, not drawn
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"{study.label}: nothing fits\n(budget 1.00 GiB, off the axis)"]
    # the fronts chart too: the study's colour had no key there (only its budget's entry, drawn
    # without a mark when the budget lay right of the chart)
    texts = [t.get_text() for t in report.plot_fronts([study]).axes[0].get_legend().get_texts()]
    assert f"{study.label}: nothing fits" in texts


def test_a_trial_given_up_as_stale_is_drawn_only_while_it_ran(tmp_path):
    # A run killed (SIGKILL) left its trial RUNNING; the next run measured, then failed it as
    # stale and retried it: its bar ran to that moment, over the next run's trials.
    import time

    from autotune import report

    url = f"sqlite:///{tmp_path / 's.db'}"
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"])}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's: heartbeats are experimental, and meant for optimize()
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=2)
        storage = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=1,
                                             heartbeat_stale_trial_callback=retry)
        study = optuna.create_study(study_name="killed", storage=storage)
        study.set_user_attr("request", REQUEST)
        killed = study.ask(dist)
        storage.record_heartbeat(killed._trial_id)  # then SIGKILL: no more heartbeats
        resumed = study.ask(dist)  # the next run's first trial
        tell_ok(study, resumed, 1.0)
        # the next run gives it up once its heartbeat (SQLite: whole seconds) is over 1 s old,
        # and Optuna retries it
        deadline = time.time() + 60  # 2-3 s here; slack for a busy machine
        while study.get_trials()[0].state == TrialState.RUNNING and time.time() < deadline:
            time.sleep(0.25)
            optuna.storages.fail_stale_trials(study)
    trials = study.get_trials()
    assert trials[0].state == TrialState.FAIL and trials[2].system_attrs["failed_trial"] == 0
    assert trials[0].datetime_complete > trials[1].datetime_complete

    # a journal storage records heartbeat_at: the trial ended there
    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "j.log")))
    other = optuna.create_study(study_name="beats", storage=journal)
    other.set_user_attr("request", REQUEST)
    t0 = datetime(2026, 1, 1, 12)
    dead = optuna.trial.create_trial(params={"dtype": "float32"}, distributions=dist, state=TrialState.FAIL,
                                     user_attrs={"heartbeat_at": (t0 + timedelta(seconds=15)).timestamp()})
    dead.datetime_start, dead.datetime_complete = t0, t0 + timedelta(seconds=60)
    stopped = optuna.trial.create_trial(params={"dtype": "bfloat16"}, distributions=dist, state=TrialState.FAIL,
                                        user_attrs={"heartbeat_at": (t0 + timedelta(seconds=68)).timestamp()})
    stopped.datetime_start, stopped.datetime_complete = t0 + timedelta(seconds=61), t0 + timedelta(seconds=70)
    for t in (dead, stopped):
        other.add_trial(t)

    sqlite_run, journal_run = report.load([url, f"beats@journal:{tmp_path / 'j.log'}"])
    spans = {sp.trial: sp for sp in sqlite_run.timeline}
    assert spans[0].end_s <= spans[1].start_s and spans[0].cut  # no heartbeat kept: cut, hatched
    spans = {sp.trial: sp for sp in journal_run.timeline}
    assert (spans[0].end_s, spans[0].cut) == (15.0, False)  # its last heartbeat
    assert (spans[1].end_s, spans[1].cut) == (70.0, False)  # Ctrl-C: it ran until it was failed
    fig = report.plot_timeline([sqlite_run, journal_run])
    (bar,) = [p for p in fig.axes[0].patches if p.get_gid() == f"trial:{sqlite_run.label}:0:interrupted:cut"]
    assert bar.get_hatch() == "///"
    assert "cut: run killed, end unknown (1)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


REQUEST = {"model": {"name": "tiny-sd15"}, "workload": {"height": 64, "width": 64, "steps": 1, "batch_size": 1,
                                                        "seed": 0}, "budget_bytes": 2**30, "device": "cpu"}


def tell_ok(study, trial, latency, peak=500 * 2**20):
    """A measured trial, as study.tune records it."""
    config = {"dtype": trial.params.get("dtype"), "attention": trial.params.get("attention", "sdpa")}
    trial.set_user_attr("config", config)
    trial.set_user_attr("result", {"status": "ok", "latency_s": latency, "peak_memory_bytes": peak})
    trial.set_user_attr("violation", -0.5)
    trial.set_user_attr("violations", {"memory": -0.5})
    study.tell(trial, latency)


def ranked_study(url, name, steps, trials=5):
    """A study with enough measured trials to rank its knobs, of a workload of `steps` steps."""
    study = optuna.create_study(study_name=name, storage=url)
    study.set_user_attr("request", {**REQUEST, "workload": {**REQUEST["workload"], "steps": steps}})
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"]),
            "attention": CategoricalDistribution(["sdpa", "sliced"])}
    for n in range(trials):  # both knobs take both values (sampled at random, both were constant at times)
        study.enqueue_trial({"dtype": ["float32", "bfloat16"][n % 2], "attention": ["sdpa", "sliced"][n // 2 % 2]})
        trial = study.ask(dist)
        tell_ok(study, trial, 1.0 + n * 0.1 + (trial.params["dtype"] == "float32"), (500 + 10 * n) * 2**20)


def test_labels_name_the_workload_where_only_it_differs(tmp_path):
    # they were the full study names: "tiny-sd15 2GB cpu [tiny-sd15-cpu-2GB-64x64-3s-b1-0becfa6b]"
    from autotune import report

    url = f"sqlite:///{tmp_path / 's.db'}"
    for steps in (3, 4):
        ranked_study(url, f"tiny-sd15-cpu-2GB-64x64-{steps}s", steps, trials=1)
    ranked_study(url, "again-4s", 4, trials=1)  # the same workload: only the name tells them apart
    labels = [s.label for s in report.load(url)]
    assert labels == ["tiny-sd15 1GB cpu 64x64 3 steps",
                      "tiny-sd15 1GB cpu 64x64 4 steps [tiny-sd15-cpu-2GB-64x64-4s]",
                      "tiny-sd15 1GB cpu 64x64 4 steps [again-4s]"]


def test_every_label_names_the_workload_where_workloads_differ(tmp_path):
    """A 1GB study at 4 steps beside 2GB studies at 4 and 2 steps: its label named no workload,
    as it collided with no other (helper-16)."""
    import optuna

    from autotune import report

    url = f"sqlite:///{tmp_path / 's.db'}"
    ranked_study(url, "small-4s", 4, trials=1)
    for steps in (4, 2):
        ranked_study(url, f"large-{steps}s", steps, trials=1)
        study = optuna.load_study(study_name=f"large-{steps}s", storage=url)
        study.set_user_attr("request", {**study.user_attrs["request"], "budget_bytes": 2**31})
    assert [s.label for s in report.load(url)] == ["tiny-sd15 1GB cpu 64x64 4 steps", "tiny-sd15 2GB cpu 64x64 4 steps",
                                                   "tiny-sd15 2GB cpu 64x64 2 steps"]


def test_the_importance_legend_covers_no_bars_and_the_notes_show(tmp_path):
    # with many studies the legend, inside the right panel, covered its bars
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from autotune import report

    url = f"sqlite:///{tmp_path / 's.db'}"
    for steps in range(1, 7):
        ranked_study(url, f"s{steps}", steps)
    ranked_study(url, "few", 20, trials=2)  # too few to rank: a note
    studies = report.load(url)
    fig = report.plot_importances(studies)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = [*fig.legends, *[ax.get_legend() for ax in fig.axes if ax.get_legend()]]
    assert len(legends) == 1 and len(legends[0].get_texts()) == 6
    legend = legends[0].get_window_extent(renderer)
    for ax in fig.axes:
        assert not legend.overlaps(ax.get_window_extent(renderer))
    (notes,) = [t for t in fig.texts if t.get_gid() == "importance-notes"]
    assert "64x64 20 steps: 2 successful trials" in notes.get_text()
    box = notes.get_window_extent(renderer)
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
    assert not box.overlaps(legend) and not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)


def test_run_notebook_names_a_missing_notebook(tmp_path):
    # installed from a wheel, the default path (beside the package) holds no notebook
    from autotune.report import ReportError, run_notebook

    with pytest.raises(ReportError, match="no notebook at .*: it ships with the repository"):
        run_notebook("x", notebook=tmp_path / "gone.ipynb")


def test_a_profiles_relative_storage_is_found_beside_it_when_here_holds_another(studies, tmp_path, monkeypatch):
    """Run from a folder with a default storage of its own, a report of a profile made elsewhere
    looked only there (the file existed) and showed no trials: "no study named 'roomy'"."""
    import shutil

    from autotune import report

    folder, url = studies
    for place in ("tuned-here", "elsewhere"):
        (tmp_path / place / "autotune-studies").mkdir(parents=True)
        shutil.copy(folder / "studies.db", tmp_path / place / "autotune-studies" / "studies.db")
    optuna.delete_study(study_name="roomy", storage=f"sqlite:///{tmp_path / 'elsewhere' / 'autotune-studies' / 'studies.db'}")
    profile = profile_recording(studies, tmp_path / "tuned-here" / "roomy.yaml", "sqlite:///autotune-studies/studies.db")
    monkeypatch.chdir(tmp_path / "elsewhere")
    (loaded,) = report.load([str(profile)])
    assert loaded.notes == [] and loaded.timeline
    assert loaded.storage.endswith(str(tmp_path / "tuned-here" / "autotune-studies" / "studies.db"))


def test_a_profile_whose_study_picks_another_config_now_says_so(studies, tmp_path):
    """A study measured on after its profile was written (resumed, a worker, confirmations) may
    pick another config: the report drew the study's trials beside the profile's best in silence."""
    from autotune import report

    folder, url = studies
    profile = profile_recording(studies, tmp_path / "p.yaml", url)
    (loaded,) = report.load([str(profile)])
    assert loaded.notes == [] and loaded.points  # its study's trials, and its pick
    doc = yaml.safe_load(profile.read_text())
    picked = doc["best"]["trial"]
    other = next(p for p in loaded.points if p.trial != picked and p.result.get("latency_s"))
    # as a profile written when the study picked another trial: that trial's figures
    doc["best"].update(trial=other.trial, latency_s=other.latency_s, latencies_s=[other.result["latency_s"]])
    other = other.trial
    profile.write_text(yaml.safe_dump(doc, sort_keys=False))
    (loaded,) = report.load([str(profile)])
    assert len(loaded.notes) == 1
    assert loaded.notes[0].startswith(f"p.yaml: its study picks trial {picked} (")
    assert f"not the profile's trial {other}" in loaded.notes[0]
    assert f"autotune export --study-name roomy --storage {url} writes its pick" in loaded.notes[0]


def test_fronts_turn_to_a_log_latency_scale_when_one_trial_is_far_slower(tmp_path):
    # a float16 trial on a CPU (100 s beside 1 s) flattened every other point onto the axis
    from autotune import report

    (study,) = report.load(synthetic_study(tmp_path, {}))
    assert report.plot_fronts([study]).axes[0].get_yscale() == "linear"
    slow = max(study.points, key=lambda p: p.latency_s or 0)
    slow.latency_s = 100.0
    ax = report.plot_fronts([study]).axes[0]
    assert ax.get_yscale() == "log" and "log scale" in ax.get_ylabel()


def test_report_of_a_study_named_with_its_storage_needs_no_default_storage(studies, tmp_path):
    # --study NAME@URL names its storage: the default one, absent here, was required for a while
    _, url = studies
    proc = run_cli("report", "--study", f"roomy@{url}", "--out", "o", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "compared 1 study" in proc.stdout and not (tmp_path / "autotune-studies").exists()


def failed_study(url, name, status, n=3):
    """A study whose every trial ended `status` (timeout, out_of_memory), as study.tune records it."""
    study = optuna.create_study(study_name=name, storage=url)
    study.set_user_attr("request", {"model": {"name": name}, "workload": {"height": 64, "width": 64,
                        "steps": 1, "batch_size": 1}, "budget_bytes": 2**30, "device": "cpu"})
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"])}
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    for i in range(n):
        result = {"status": status, "error": "x"}
        if status == "out_of_memory":
            result["peak_memory_bytes"] = (400 + i) * 2**20
        trial = optuna.trial.create_trial(
            params={"dtype": "float32"}, distributions=dist, value=float("inf"),
            user_attrs={"config": {"dtype": "float32"}, "result": result, "baseline": i == 0,
                        "violation": 1.0, "violations": {"memory": 1.0}})
        trial.datetime_start, trial.datetime_complete = t0 + timedelta(seconds=10 * i), t0 + timedelta(seconds=10 * i + 5)
        study.add_trial(trial)


def test_a_study_where_nothing_ran_says_why_and_is_left_out_of_the_charts(tmp_path):
    # every trial timed out: it was "no measured configuration fits the budget", and its budget
    # and an empty axis from -0.04 to 0.04 s were drawn
    from autotune import report

    url = synthetic_study(tmp_path, {})
    failed_study(url, "timeouts", "timeout")
    failed_study(url, "nofit", "out_of_memory")
    studies = report.load(url)
    assert [s.measured for s in studies] == [True, False, False]
    said = {s.name: s.why_no_best() for s in studies[1:]}
    # in the words of the CLI's error for the same study
    assert said == {"timeouts": "no configuration ran (timeout 3); trial 0: x",
                    "nofit": "no configuration fits 1.00 GiB: the smallest peak memory measured was at least 400.00 MiB"}
    assert "timeouts: no configuration ran (timeout 3); trial 0: x (left out of the charts)" in studies[1].notes
    assert [r["configuration"] for r in report.best_table(studies)][1:] == list(said.values())
    for name, fig in report.figures(studies).items():
        assert "timeouts" not in drawn_text(fig) and "nofit" not in drawn_text(fig), name
    # studies with nothing measured alone: no chart, where the notebook drew empty axes
    assert not report.figures(studies[1:])
    assert all(plot(studies[1:]) is None for plot in report.CHARTS.values())


def test_a_profile_whose_storage_moved_given_beside_its_study_is_compared_once(studies, tmp_path):
    # its study not found where the profile records it, the profile was its own entry beside the
    # same study read from where it is now: two identical fronts drawn over each other
    from autotune import report

    _, url = studies
    profile = profile_recording(studies, tmp_path / "moved.yaml", f"sqlite:///{tmp_path / 'gone' / 'studies.db'}")
    loaded = report.load([str(profile), f"roomy@{url}"])
    assert [(s.name, s.source) for s in loaded] == [("roomy", "study")]
    assert ("roomy: given again (profile moved.yaml, whose recorded storage is not here), compared once"
            in loaded[0].notes)
    # one path given as a Path (it was iterated as a sequence: TypeError), and a profile that
    # records no storage at all ("its study storage None is not here")
    doc = yaml.safe_load(profile.read_text())
    del doc["study"]["storage"]
    (tmp_path / "no storage.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (loaded,) = report.load(tmp_path / "no storage.yaml")
    assert loaded.source == "profile" and loaded.notes == [
        "no storage.yaml: it records no study storage: front and best from the profile only, no timeline or knob "
        "importance"]
    # as the note says: no timeline or importance chart (both were drawn empty, the timeline's one
    # line over its title; helper-10)
    names = [p.name for p in report.write_report([loaded], tmp_path / "out")]
    assert "timeline.png" not in names and "importance.png" not in names and "fronts.png" in names, names


def test_a_study_whose_trials_ran_out_of_host_memory_under_a_gpu_budget_is_not_said_not_to_fit():
    from autotune.study import BROKEN, StudyOutcome, TrialRecord

    for result, says in (({}, "no configuration fits 1.00 GiB: the smallest peak memory measured was at least 1.50 GiB"),
                         ({"out_of_memory_on": "host"}, "host memory ran short in 2: the machine's limit, which the budget does not judge")):
        records = [TrialRecord(n, {}, "out_of_memory", {"peak_memory_bytes": 3 * 2**29, "error": "x", **result},
                               BROKEN, violations={"memory": BROKEN}) for n in range(2)]
        for_lack_of_memory, why = StudyOutcome(records=records, stop_reason="").why_no_best(2**30)
        assert says in why
        assert for_lack_of_memory == (not result)


@pytest.mark.slow
def test_a_profile_is_not_drawn_with_another_run_of_its_study_name(studies, tmp_path):
    """The same command run twice (two machines, two folders) makes one study name: a profile
    copied beside the other run's storage, whose relative path it records, was drawn with that
    run's trials, and given beside it the two were merged into one (helper 75). A second real run
    of the roomy study here; the profile's best must have been measured in the study it is drawn
    with. A hand-edited best is said too."""
    from autotune import report

    folder, url = studies
    (tmp_path / "space.yaml").write_text(SPACE)
    other = f"sqlite:///{tmp_path / 'studies.db'}"
    proc = run_cli("--model", "tiny-sd15", "--height", "64", "--width", "64", "--steps", "1", "--repeats", "1",
                   "--warmup", "1", "--threads", "1", "--space", "space.yaml", "--storage", other, "--study-name",
                   "roomy", "--vram", "2GB", "--trials", "2", "--confirm", "0", "--no-profile", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    copied = profile_recording(studies, tmp_path / "machineA.yaml", "sqlite:///studies.db")  # read from tmp_path
    loaded = report.load([str(copied), f"roomy@{other}"])
    assert [(s.name, s.source) for s in loaded] == [("roomy", "profile"), ("roomy", "study")]
    assert loaded[0].storage is None and not loaded[0].trials
    assert f"{other} holds another run of study roomy (its trial" in " ".join(loaded[0].notes)
    assert {p.trial for p in loaded[1].points} <= {t.number for t in optuna.load_study(study_name="roomy",
                                                                                       storage=other).trials}

    edited = profile_recording(studies, tmp_path / "edited.yaml", url)
    doc = yaml.safe_load(edited.read_text())
    measured = doc["best"]["latency_s"]
    doc["best"]["latency_s"] = measured / 2
    edited.write_text(yaml.safe_dump(doc, sort_keys=False))
    (loaded,) = report.load([str(edited)])
    assert loaded.trials and loaded.notes == [f"edited.yaml: its best's median ({measured / 2:.3f} s) is not its study's "
                                              f"for trial {doc['best']['trial']} ({measured:.3f} s): edited by hand, or "
                                              "measured again since"]


def test_names_with_dollar_signs_are_drawn_as_written_and_old_charts_do_not_linger(studies, tmp_path):
    """matplotlib took text between two '$' for a formula: a profile named 'one$\\foo$.yaml' made
    the report a traceback, and '$5 and $10' lost its dollars (helper 75). A report written into a
    folder an earlier one used left that one's charts standing beside it (helper 75)."""
    from autotune import report

    _, url = studies
    loaded = report.load([f"roomy@{url}", f"tight@{url}"])
    # labels as a profile's file name or a study's name makes them where two studies look alike
    loaded[0].label, loaded[1].label = "one$\\foo$.yaml", "cost $5 and $10"
    charts = report.figures(loaded)  # every chart: each draws the labels
    assert "speedups" in charts and "fronts" in charts
    for fig in charts.values():  # matplotlib reads the formulas as it draws: a traceback there
        fig.savefig(io.BytesIO(), format="png")
    text = drawn_text(charts["speedups"])
    assert "one$\\foo$.yaml" in text and "cost $5 and $10" in text
    out = tmp_path / "out"
    assert "fronts.png" in [p.name for p in report.write_report(loaded, out)]  # an earlier report's charts
    (out / "mine.png").write_bytes(PNG)  # and a file of the user's
    stopped = f"sqlite:///{tmp_path / 'stopped.db'}"
    stopped_study(stopped, "stopped", 2**31)
    written = report.write_report(report.load([f"stopped@{stopped}"]), out)  # nothing measured: no chart
    assert [p.name for p in written] == ["index.html"]
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "mine.png"]
    # a folder whose charts and index.html no report wrote: refused, each file as it was (helper-16)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "timeline.png").write_bytes(PNG)
    (theirs / "index.html").write_text("<p>my page</p>")
    with pytest.raises(report.ReportError, match=r"it holds index.html, timeline.png, which no autotune report "
                                                 r"wrote there: give --out an empty or new folder$"):
        report.write_report(report.load([f"stopped@{stopped}"]), theirs)
    assert (theirs / "index.html").read_text() == "<p>my page</p>" and (theirs / "timeline.png").read_bytes() == PNG
    # a report written before the generator tag is known by its page's style
    (theirs / "index.html").write_text(report.REPORT_MARKS[1] + "</style>")
    assert [p.name for p in report.write_report(report.load([f"stopped@{stopped}"]), theirs)] == ["index.html"]
    assert not (theirs / "timeline.png").exists()


def test_a_storage_whose_path_holds_an_at_sign_is_read_whole(studies, tmp_path):
    """sqlite:////data/team@gpu1/studies.db was split at its '@' into a study and a storage that
    is not there (helper 75)."""
    import shutil

    from autotune import report

    folder, _ = studies
    (tmp_path / "team@gpu1").mkdir()
    shutil.copy(folder / "studies.db", tmp_path / "team@gpu1" / "studies.db")
    for entry in (f"sqlite:///{tmp_path / 'team@gpu1' / 'studies.db'}", str(tmp_path / "team@gpu1" / "studies.db")):
        assert sorted(s.name for s in report.load([entry])) == ["roomy", "tight"], entry


def test_a_figure_that_barely_varies_over_the_trials_ranks_no_knob(tmp_path):
    """PED-ANOVA ranks by order, however small the gaps: these peaks, within 2% (trials of one
    config differed by up to 3.9% on the tiny models), got bars of 0.5 for dtype and channels_last.
    A figure ranging under IMPORTANCE_NOISE gets a note instead."""
    from autotune import report

    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="flat", storage=url)
    study.set_user_attr("request", {"model": {"name": "tiny-sdxl"}, "workload": {"height": 64, "width": 64,
                        "steps": 1, "batch_size": 1}, "budget_bytes": 2**31, "device": "cpu"})
    dist = {"dtype": CategoricalDistribution(["float32", "bfloat16"]),
            "channels_last": CategoricalDistribution([False, True])}
    for n, (dtype, last, latency, peak_mib) in enumerate([("float32", False, 0.72, 738.6), ("bfloat16", False, 0.47, 738.5),
                                                           ("bfloat16", True, 0.41, 738.7), ("float32", True, 0.70, 724.2),
                                                           ("bfloat16", True, 0.40, 738.6)]):
        result = {"status": "ok", "latency_s": latency, "peak_memory_bytes": int(peak_mib * 2**20)}
        study.add_trial(optuna.trial.create_trial(
            params={"dtype": dtype, "channels_last": last}, distributions=dist, value=latency,
            user_attrs={"config": {"dtype": dtype, "channels_last": last}, "result": result, "baseline": n == 0,
                        "violation": -0.5, "violations": {"memory": -0.5}}))
    (data,) = report.load(url)
    latency, note = report.knob_importance(data, "latency")
    assert set(latency) == {"dtype", "channels_last"} and note is None
    memory, note = report.knob_importance(data, "memory")
    assert memory == {} and "peak memory ranged 2.0% over the measured trials, under the 5% below which" in note, note
