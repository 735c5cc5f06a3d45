"""The study loop itself, on a made-up measurement (no pipelines): seeds first, early stop."""

from pathlib import Path

from autotune import study
from autotune.knobs import Target, baseline
from autotune.models import resolve_model
from autotune.space import Dimension, SearchSpace

MiB = 2**20


def request(space, tmp_path: Path, **kw) -> study.TuneRequest:
    spec = resolve_model("tiny-sd15")
    return study.TuneRequest(
        spec=spec, workload=spec.default_workload, budget_bytes=1000 * MiB, space=space,
        target=Target(device="cpu", family=spec.family), storage="memory", study_name="s",
        workdir=tmp_path, min_psnr_db=None, seed=0, **kw,
    )


def fake_measure(latency_of):
    measured = []

    def measure(req: dict, trial_dir: Path, tick) -> dict:
        measured.append(req["config"])
        return {"status": "ok", "latency_s": latency_of(req["config"]), "peak_memory_bytes": 500 * MiB}

    return measure, measured


SPACE = [Dimension("dtype", ("float32", "bfloat16", "float16")), Dimension("fuse_qkv", (False, True)),
         Dimension("channels_last", (False, True))]


def test_seeds_are_measured_right_after_the_baseline(tmp_path):
    seeds = [{"dtype": "bfloat16", "fuse_qkv": True}, {"dtype": "float16"}]
    space = SearchSpace(SPACE, seeds=seeds)
    measure, measured = fake_measure(lambda c: 1.0)
    study.tune(request(space, tmp_path, trials=4), measure=measure)
    assert measured[0] == baseline()
    assert measured[1] == {**baseline(), "dtype": "bfloat16", "fuse_qkv": True}
    assert measured[2] == {**baseline(), "dtype": "float16"}
    assert len(measured) == 4


def test_patience_stops_when_the_best_stops_improving(tmp_path):
    # The baseline is the fastest: nothing after it improves, so 3 more trials end the study.
    measure, measured = fake_measure(lambda c: 1.0 if c == baseline() else 2.0)
    outcome = study.tune(request(SearchSpace(SPACE), tmp_path, trials=12, patience=3), measure=measure)
    assert len(measured) == 4
    assert "--patience 3" in outcome.stop_reason
    assert outcome.best.config == baseline()


def test_without_patience_the_trial_count_rules(tmp_path):
    measure, measured = fake_measure(lambda c: 1.0 if c == baseline() else 2.0)
    outcome = study.tune(request(SearchSpace(SPACE), tmp_path, trials=6), measure=measure)
    assert len(measured) == 6 and "--trials 6" in outcome.stop_reason
