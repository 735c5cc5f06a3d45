"""Comparing studies: two real tiny studies, the notebook executed on them, `autotune report`.

The charts are checked against the studies' data read straight from the Optuna storage here (not
through autotune.report): the drawn fronts, budgets, timeline bars and importance bars must hold
the measured trials."""

import base64
import json
import re
import statistics
import textwrap
import warnings
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

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
        values = [t.user_attrs["result"]["latency_s"]] + [c["latency_s"] for c in again.get(str(t.number), [])
                                                          if c["latency_s"] is not None]
        return statistics.median(values)

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
            continue  # the claim on the confirmation phase: no bar
        if t.state == TrialState.PRUNED:
            kind = "forbidden"
        elif t.state == TrialState.FAIL:
            kind = "interrupted"
        elif t.user_attrs.get("duplicate_of") is not None:
            kind = "duplicate"
        elif t.user_attrs["result"]["status"] != "ok":
            kind = t.user_attrs["result"]["status"]
        else:
            kind = "ok" if t.user_attrs["violation"] <= 0 else "over budget"
        timeline[t.number] = kind
    ok = [t for t in measured if t.user_attrs["result"]["status"] == "ok"]
    return {
        "budget": study.user_attrs["request"]["budget_bytes"],
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
            assert cx[:-1] == pytest.approx([m / bscale for m, _ in exp["front"]])
            assert cy[:-1] == pytest.approx([lat for _, lat in exp["front"]])
            assert f"speedup:{label}" in drawn["speedups"]
        else:
            assert f"front:{label}" not in fronts
        budget = fronts[f"budget:{label}"]
        if isinstance(budget, list):  # a dashed line at the budget
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
        (["--storage", "{url}"], "required: --out"),
    ],
)
def test_report_bad_input_is_one_line(studies, tmp_path, args, message):
    folder, url = studies
    proc = run_cli("report", *[a.format(url=url) for a in args], cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(lines) == 1 and message in lines[0], proc.stderr


# ---- images and failure classes: a study written here, with what the worker records ----------
def synthetic_study(tmp_path, images):
    """A study in a SQLite file, shaped as study.tune writes it: a baseline, a faster config, an
    out-of-memory trial, a forbidden one; `images` maps trial number to a result["image"]."""
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
                        "violation": -0.5 if status == "ok" else 1.0},
        )
        trial.datetime_start, trial.datetime_complete = t0 + timedelta(seconds=10 * n), t0 + timedelta(seconds=10 * n + 7)
        study.add_trial(trial)
    pruned = optuna.trial.create_trial(params={"dtype": "bfloat16"}, distributions=dist, state=TrialState.PRUNED,
                                       user_attrs={"config": {"dtype": "bfloat16", **base}, "forbidden": "x"})
    pruned.datetime_start = pruned.datetime_complete = t0 + timedelta(seconds=40)
    study.add_trial(pruned)
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

    # Failure classes on the timeline, and a study without images is no error.
    timeline = report.plot_timeline([study])
    kinds = sorted(p.get_gid().split(":")[3] for ax in timeline.axes for p in ax.patches if p.get_gid())
    assert kinds == ["forbidden", "ok", "ok", "out_of_memory"]
    assert "out_of_memory (1)" in [t.get_text() for t in timeline.axes[0].get_legend().get_texts()]


def test_no_images_and_too_few_trials_are_notes_not_errors(tmp_path):
    from autotune import report

    url = synthetic_study(tmp_path, {})
    (study,) = report.load(url)  # a bare URL: every study in it
    assert report.plot_images([study]) is None
    importances, note = report.knob_importance(study)
    assert importances == {} and "2 successful trials;" in note
    assert report.write_report([study], tmp_path / "out")[-1].name == "index.html"


def test_a_report_folder_that_cannot_be_written_is_one_line(tmp_path):
    from autotune import report

    url = synthetic_study(tmp_path, {})
    (study,) = report.load(url)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "taken" / "index.html").mkdir(parents=True)  # the charts fit, the page does not
    for out, message in [
        (tmp_path / "a-file", "cannot create the folder (a file is in the way)"),
        (tmp_path / "a-file" / "sub", "cannot create the folder (Not a directory)"),
        (Path("/proc/autotune-report"), "cannot create the folder"),
        (tmp_path / "taken", "index.html: cannot write it (Is a directory)"),
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
    assert {r["configuration"] for r in rows[1:]} == {"no trials measured"}
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
    assert "<td>no trials measured</td>" in (tmp_path / "out" / "index.html").read_text()
