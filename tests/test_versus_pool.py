"""versus_hand_tuning's pool of measurements: a result measured once serves every request for the
same trial, but a trial cut short (as far slower than its study's best) serves only a request
that would have been cut too."""

from __future__ import annotations

from autotune import worker
from autotune.knobs import baseline
from autotune.models import resolve_model

from helpers import load_benchmark

vht = load_benchmark("versus_hand_tuning")


def test_a_cut_short_result_serves_only_requests_it_would_have_been_cut_for(tmp_path):
    spec = resolve_model("tiny-sd15")
    pool = vht.Measurements(tmp_path, trial_timeout_s=60, launcher="fork")
    measured = []
    # Stands in for runner.run_trial (tested with real child processes in test_runner): this test
    # is about which stored result the pool hands out.
    pool._measure = lambda request, trial_dir, tick, key: measured.append(request["cut_above_s"]) or {}

    def ask(bound):
        request = worker.trial_request(spec, baseline(), spec.default_workload, "cpu", cut_above_s=bound)
        return pool(request, tmp_path / "t", None)

    pool.results[vht.key_of(worker.trial_request(spec, baseline(), spec.default_workload, "cpu"))] = {
        "status": "ok", "latency_s": 3.0, "cut_short": "its warm calls took 3.0 and 3.0 s, over 2.0 s"}
    assert ask(2.5)["reused"] and not measured  # 3.0 s would be cut at 2.5 s as well
    ask(4.0)  # not at 4.0 s: measured
    ask(None)  # nor without a bound
    assert measured == [4.0, None]


def test_a_paired_loss_within_the_rounds_overlap_is_a_tie_not_a_loss():
    # 1.251 s against 1.245 s, medians of rounds that interleave: the report blamed the search
    def budget(ours, theirs):
        return {"ratio": 0.99, "loss": None, "best_hand": "hand-cpu",
                "paired": {"rounds": 2, "autotune_s": ours, "hand_s": theirs,
                           "ratio": (sum(ours) / len(ours)) / (sum(theirs) / len(theirs))}}

    tie, slower = budget([1.272, 1.229], [1.232, 1.259]), budget([1.40, 1.42], [1.232, 1.259])
    vht.settle([tie, slower])
    assert tie["loss"] is None and "rounds overlap (autotune 1.229-1.272 s, hand-cpu 1.232-1.259 s)" in tie["tie"]
    assert "drifting measurement" in slower["loss"] and "tie" not in slower


def test_a_result_timed_beside_a_busy_neighbour_is_measured_afresh_and_the_less_disturbed_kept(tmp_path, monkeypatch):
    """The study measures a disturbed trial a second time (study._disturbed_out_of_the_running);
    the pool must not answer that with the first figure, nor forget the first when the second is
    worse."""
    from autotune import runner

    spec = resolve_model("tiny-sd15")
    pool = vht.Measurements(tmp_path, trial_timeout_s=60, launcher="fork")
    request = worker.trial_request(spec, baseline(), spec.default_workload, "cpu")
    key = vht.key_of(request)
    pool.results[key] = {"status": "ok", "latency_s": 3.0, "cores_taken_by_others": 0.9}
    # Stands in for runner.run_trial (tested with real child processes in test_runner): what is
    # tested is which result the pool keeps.
    fresh = iter([{"status": "ok", "latency_s": 2.0, "cores_taken_by_others": 0.1},
                  {"status": "ok", "latency_s": 4.0, "cores_taken_by_others": 0.8}])
    monkeypatch.setattr(runner, "run_trial", lambda *a, **k: next(fresh))
    assert pool(request, tmp_path / "a", None)["latency_s"] == 2.0  # measured afresh
    assert pool.results[key]["latency_s"] == 2.0  # the less disturbed replaced the first
    assert pool(request, tmp_path / "b", None)["reused"]  # a quiet figure is reused
    pool.results[key] = {"status": "ok", "latency_s": 2.0, "cores_taken_by_others": 0.5}  # disturbed, less than what comes
    assert pool(request, tmp_path / "c", None)["latency_s"] == 4.0
    assert pool.results[key]["latency_s"] == 2.0  # the earlier, less disturbed, stays
    assert pool(request, tmp_path / "d", None)["reused"]  # measured again once: not again for each study


def test_the_sd15_guides_float16_runs_as_asked_where_the_search_leaves_it_out(monkeypatch):
    # on a CPU computing only bfloat16 natively, autotune searches no float16, but the guide's
    # stack is float16: run as the guide says, not as float32
    from autotune import fingerprint
    from autotune.knobs import Target

    monkeypatch.setattr(fingerprint, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    guide = next(c for c in vht.contestants("cpu", "sd15") if c.name == "guide-sd15")
    resolved = vht.resolve(guide, Target("cpu", "sd15"))
    assert resolved.config["dtype"] == "float16" and resolved.config["channels_last"] is True
