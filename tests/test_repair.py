"""Memory repair (autotune/repair.py): which config a fast one over the budget is measured with
next, and a study that reaches a fitting config through it. The measurements are scripted (a
table of latency and peak per config): what is tested is the rule, not a pipeline."""

from pathlib import Path

from autotune import repair, study, worker
from autotune.knobs import Target
from autotune.models import resolve_model
from autotune.space import Dimension, SearchSpace, config_key

MiB = 2**20
QUANTIZED = ["int8wo", "int8dq"]
CPU_SPACE = SearchSpace([
    Dimension("dtype", ("float32", "bfloat16")),
    Dimension("quantize", ("none", "int8wo", "int8dq")),
    Dimension("malloc_mmap_threshold", ("dynamic", "1MiB"), when={"quantize": QUANTIZED}),
    Dimension("quantize_text_encoders", ("none", "int8wo")),
    Dimension("vae_tiling", (False, True)),
    Dimension("compile", ("none", "default")),
])


def record(number, changes, latency=1.0, peak_over=0.1, quality_ok=True, status="ok", seeded=False):
    """A measured trial: `peak_over` > 0 is its overshoot of the budget (as study.violation)."""
    violations = {"memory": peak_over, "quality": -1.0 if quality_ok else 0.5}
    return study.TrialRecord(number=number, config=CPU_SPACE.normalize(changes), status=status,
                             result={"latency_s": latency if status == "ok" else None},
                             violation=max(violations.values()) if status == "ok" else 1.0,
                             violations=violations, seeded=seeded)


FAST = {"dtype": "bfloat16", "compile": "default"}


def test_the_fastest_config_over_the_budget_gets_the_cheapest_saver_first():
    records = [record(0, {"dtype": "bfloat16"}, latency=2.0, peak_over=-0.1), record(1, FAST, latency=1.0)]
    found = repair.next_repair(records, set(), CPU_SPACE, is_cuda=False)
    assert found.of == 1 and found.adds == "quantize_text_encoders=int8wo"
    assert found.config == CPU_SPACE.normalize({**FAST, "quantize_text_encoders": "int8wo"})
    assert found.marks == {"repair": {"of": 1, "adds": "quantize_text_encoders=int8wo"}}


def test_a_repair_still_over_the_budget_keeps_its_saver_and_adds_the_next():
    """Cumulative: glibc's threshold is a choice only once quantized (the space's `when`), so the
    chain reaches quantize + threshold, the pair that lowers a CPU peak."""
    records = [record(0, {"dtype": "bfloat16"}, latency=2.0, peak_over=-0.1), record(1, FAST, latency=1.0),
               record(2, {**FAST, "quantize_text_encoders": "int8wo"}, latency=1.05, peak_over=0.08),
               record(3, {**FAST, "quantize_text_encoders": "int8wo", "quantize": "int8dq"}, latency=1.2, peak_over=0.09)]
    found = repair.next_repair(records, set(), CPU_SPACE, is_cuda=False)
    assert found.of == 3 and found.adds == "malloc_mmap_threshold=1MiB"
    assert found.config == CPU_SPACE.normalize({**FAST, "quantize_text_encoders": "int8wo", "quantize": "int8dq",
                                                "malloc_mmap_threshold": "1MiB"})


def test_a_saver_that_breaks_the_guard_or_runs_slower_than_what_fits_is_dropped_for_the_next():
    te = {**FAST, "quantize_text_encoders": "int8wo"}
    below_guard = [record(0, {}, latency=2.0, peak_over=-0.1), record(1, FAST),
                   record(2, te, latency=1.1, peak_over=-0.2, quality_ok=False)]
    found = repair.next_repair(below_guard, set(), CPU_SPACE, is_cuda=False)
    assert (found.of, found.adds) == (1, "quantize=int8dq")  # int8 dynamic where compiled
    assert found.config["quantize_text_encoders"] == "none"
    too_slow = [record(0, {}, latency=2.0, peak_over=-0.1), record(1, FAST), record(2, te, latency=2.5, peak_over=0.05)]
    assert repair.next_repair(too_slow, set(), CPU_SPACE, is_cuda=False).adds == "quantize=int8dq"
    within_its_lead = [record(0, {}, latency=2.0, peak_over=-0.1), record(1, FAST), record(2, te, latency=1.92, peak_over=0.05)]
    assert repair.next_repair(within_its_lead, set(), CPU_SPACE, is_cuda=False).adds == "quantize=int8dq"


def test_a_chain_that_fitted_after_several_savers_ends_there():
    """The fit lowers the fastest feasible latency; the chain's steps before it, now within 5% of
    it, were ahead of what fitted when they were measured: the chain is not taken for lost there
    and branched again."""
    te = {**FAST, "quantize_text_encoders": "int8wo"}
    dq = {**te, "quantize": "int8dq"}
    records = [record(0, {}, latency=2.0, peak_over=-0.1), record(1, FAST, latency=0.70),
               record(2, te, latency=0.72), record(3, dq, latency=0.78),
               record(4, {**dq, "malloc_mmap_threshold": "1MiB"}, latency=0.80, peak_over=-0.01)]
    assert repair.next_repair(records, set(), CPU_SPACE, is_cuda=False) is None


def test_a_saver_dropped_on_the_way_is_not_added_again_further_down():
    te = {**FAST, "quantize_text_encoders": "int8wo"}
    dq = {**FAST, "quantize": "int8dq"}
    records = [record(0, {}, latency=2.0, peak_over=-0.1), record(1, FAST),
               record(2, te, latency=1.1, quality_ok=False), record(3, dq, latency=1.2)]
    found = repair.next_repair(records, set(), CPU_SPACE, is_cuda=False)
    assert (found.of, found.adds) == (3, "malloc_mmap_threshold=1MiB")
    assert found.config["quantize_text_encoders"] == "none"
    # a step that ran faster than its parent is walked first, as a root of its own: from where its
    # chain stood, not from the first saver again (which gave it the text encoders' int8 back)
    faster_step = record(3, dq, latency=0.9)
    faster_step.repair = {"of": 1, "adds": "quantize=int8dq"}
    found = repair.next_repair([*records[:3], faster_step], set(), CPU_SPACE, is_cuda=False)
    assert (found.of, found.adds) == (3, "malloc_mmap_threshold=1MiB")
    assert found.config["quantize_text_encoders"] == "none"


def test_the_share_counts_each_repaired_config_once():
    class Trial:  # the two fields of a FrozenTrial that count reads
        def __init__(self, params, attrs):
            self.params, self.user_attrs = params, attrs

    mark = {"repair": {"of": 1, "adds": "x=y"}}
    trials = [Trial({"a": 1}, mark), Trial({"a": 1}, mark), Trial({"a": 2}, mark), Trial({"a": 3}, {})]
    assert repair.count(trials) == 2  # a config queued again after Ctrl-C counts once


def test_a_chain_ends_where_a_repair_fits_and_waits_while_one_is_measured():
    te = {**FAST, "quantize_text_encoders": "int8wo"}
    fitted = [record(0, {}, latency=2.0, peak_over=-0.1), record(1, FAST), record(2, te, latency=1.1, peak_over=-0.01)]
    assert repair.next_repair(fitted, set(), CPU_SPACE, is_cuda=False) is None
    waiting = [record(0, {}, latency=2.0, peak_over=-0.1), record(1, FAST)]
    pending = {config_key(CPU_SPACE.normalize(te))}
    assert repair.next_repair(waiting, pending, CPU_SPACE, is_cuda=False) is None


def test_nothing_is_repaired_that_is_slower_than_what_fits_or_below_the_guard():
    slower = [record(0, {"dtype": "bfloat16"}, latency=1.0, peak_over=-0.1), record(1, FAST, latency=1.2)]
    assert repair.next_repair(slower, set(), CPU_SPACE, is_cuda=False) is None
    barely_faster = [record(0, {"dtype": "bfloat16"}, latency=1.0, peak_over=-0.1), record(1, FAST, latency=0.97)]
    assert repair.next_repair(barely_faster, set(), CPU_SPACE, is_cuda=False) is None  # savers cost more than 3%
    lossy = [record(0, {"dtype": "bfloat16"}, latency=2.0, peak_over=-0.1), record(1, FAST, quality_ok=False)]
    assert repair.next_repair(lossy, set(), CPU_SPACE, is_cuda=False) is None
    # nor one this autotune's rules forbid since it was measured: every saver would keep the rule broken
    forbidden = record(1, FAST)
    forbidden.forbidden_now = "a rule added since"
    assert repair.next_repair([lossy[0], forbidden], set(), CPU_SPACE, is_cuda=False) is None
    assert repair.next_repair([lossy[0], record(1, FAST)], set(), CPU_SPACE, is_cuda=False) is not None


def test_a_config_the_study_would_skip_unmeasured_is_not_proposed_and_the_chain_goes_on_from_the_trial_that_rules_it_out():
    """The study skips a config that only needs more memory than one over the budget
    (study.memory_dominated): proposing it would only have it skipped, and proposed again."""
    te_tiled = {**FAST, "quantize_text_encoders": "int8wo", "vae_tiling": True}
    records = [record(0, {}, latency=2.0, peak_over=-0.1), record(1, FAST), record(2, te_tiled, latency=1.05)]
    te = CPU_SPACE.normalize({**FAST, "quantize_text_encoders": "int8wo"})
    found = repair.next_repair(records, set(), CPU_SPACE, is_cuda=False,
                               dominated_by=lambda c: records[2] if c == te else None)
    assert (found.of, found.adds) == (2, "quantize=int8dq")  # on top of trial 2, never te itself
    assert found.config == CPU_SPACE.normalize({**te_tiled, "quantize": "int8dq"})


def test_int8_dynamic_where_compiled_weight_only_where_not_and_neither_swapped_for_the_other():
    uncompiled = [record(0, {}, latency=2.0, peak_over=-0.1), record(1, {"dtype": "bfloat16", "quantize_text_encoders": "int8wo"})]
    assert repair.next_repair(uncompiled, set(), CPU_SPACE, is_cuda=False).adds == "quantize=int8wo"
    # int8 dynamic chosen by the sampler, uncompiled: int8 weights already, glibc's threshold is next
    chosen = [record(0, {}, latency=2.0, peak_over=-0.1),
              record(1, {"dtype": "bfloat16", "quantize_text_encoders": "int8wo", "quantize": "int8dq"})]
    assert repair.next_repair(chosen, set(), CPU_SPACE, is_cuda=False).adds == "malloc_mmap_threshold=1MiB"


def test_a_seed_that_ran_out_of_memory_is_repaired_and_a_later_saver_replaces_an_earlier_one_of_its_knob():
    """On a GPU: a seed out of memory gets the VAE tiled first; model offload gives way
    to a finer offload, not added beside it."""
    space = SearchSpace([Dimension("dtype", ("float32", "bfloat16")), Dimension("vae_tiling", (False, True)),
                         Dimension("offload", ("none", "model", "group-leaf-stream", "sequential")),
                         Dimension("compile", ("none", "default"))])
    seed = space.normalize({"dtype": "bfloat16"})
    oom = study.TrialRecord(number=1, config=seed, status=worker.OUT_OF_MEMORY, result={}, violation=1.0,
                            violations={"memory": 1.0}, seeded=True)
    found = repair.next_repair([oom], set(), space, is_cuda=True)
    assert (found.of, found.adds) == (1, "vae_tiling=True")
    tiled = study.TrialRecord(number=2, config=found.config, status=worker.OUT_OF_MEMORY, result={}, violation=1.0,
                              violations={"memory": 1.0})
    offloaded = study.TrialRecord(number=3, config={**found.config, "offload": "model"}, status="ok",
                                  result={"latency_s": 1.5}, violation=0.05, violations={"memory": 0.05})
    found = repair.next_repair([oom, tiled, offloaded], set(), space, is_cuda=True)
    # group offload with streams is forbidden beside a tiled VAE (knobs.CONFLICTS): sequential is next
    assert (found.of, found.adds) == (3, "offload=sequential")
    assert found.config["offload"] == "sequential" and found.config["vae_tiling"] is True
    # compiled, the leaf-level offloads are forbidden (knobs.CONFLICTS): the chain ends at model offload
    compiled = [study.TrialRecord(number=r.number, config={**r.config, "compile": "default"}, status=r.status,
                                  result=r.result, violation=r.violation, violations=r.violations, seeded=r.seeded)
                for r in (oom, tiled, offloaded)]
    assert repair.next_repair(compiled, set(), space, is_cuda=True) is None
    # an unseeded config out of memory says nothing of its speed: not repaired
    oom.seeded = False
    assert repair.next_repair([oom], set(), space, is_cuda=True) is None


def scripted_measure(req: dict, trial_dir: Path, tick) -> dict:
    c = req["config"]
    latency = (1.0 if c["compile"] == "default" else 2.0) * (1.0 if c["dtype"] == "bfloat16" else 1.5)
    latency *= 1.1 if c["quantize"] != "none" else 1.0
    peak = (1200 if c["compile"] == "default" else 700) * (1.0 if c["dtype"] == "bfloat16" else 1.6)
    peak += {"dynamic": 100, "1MiB": -450}[c["malloc_mmap_threshold"]] if c["quantize"] != "none" else 0
    peak -= 50 if c["quantize_text_encoders"] == "int8wo" else 0
    return {"status": "ok", "latency_s": latency, "peak_memory_bytes": int(peak * MiB)}


def scripted_request(workdir: Path, **settings) -> study.TuneRequest:
    spec = resolve_model("tiny-sd15")
    return study.TuneRequest(
        spec=spec, workload=spec.default_workload, space=SearchSpace(CPU_SPACE.dimensions, seeds=[FAST]),
        target=Target(device="cpu", family=spec.family), study_name="s", workdir=workdir, storage="memory",
        budget_bytes=1000 * MiB, min_psnr_db=None, seed=0, **settings)


def test_a_study_reaches_the_fast_config_that_fits_through_repairs(tmp_path: Path):
    """Scripted (scripted_measure): compiled bf16 runs 1.0 s at 1200 MiB, over the 1000 MiB budget; int8 weights
    add 100 MiB unless glibc's threshold is held, which takes 450 MiB off; the text encoders' int8
    weights take 50 MiB off. Compiled bf16 + both int8 + the threshold is the fast config that fits,
    three savers away from the seed, and the sampler's random draws are unlikely to meet it."""
    req = scripted_request(tmp_path, trials=10)
    outcome = study.tune(req, measure=scripted_measure)
    repairs = [r for r in outcome.records if r.repair]
    # three savers, then none: the chain fitted (the share would allow five)
    assert [r.repair["adds"] for r in repairs] == [
        "quantize_text_encoders=int8wo", "quantize=int8dq", "malloc_mmap_threshold=1MiB"]
    assert repairs[0].repair["of"] == 1 and repairs[1].repair["of"] == repairs[0].number
    assert outcome.best.config == CPU_SPACE.normalize(
        {**FAST, "quantize_text_encoders": "int8wo", "quantize": "int8dq", "malloc_mmap_threshold": "1MiB"})
    assert outcome.best.latency_s == 1.1


def test_the_baseline_is_never_repaired_and_while_nothing_fits_a_repair_must_beat_it():
    """Fast, with nothing fitting yet, means faster than doing nothing; the baseline itself is not
    repaired, even where it runs faster than all that fits: with nothing set, its chain would only
    walk the savers, as the sampler does."""
    base = record(0, {}, latency=3.0)
    base.baseline = True
    assert repair.next_repair([base], set(), CPU_SPACE, is_cuda=False) is None
    slow_fit = record(3, {"vae_tiling": True, "quantize": "int8wo"}, latency=6.0, peak_over=-0.1)
    assert repair.next_repair([base, slow_fit], set(), CPU_SPACE, is_cuda=False) is None
    # a baseline without a figure (out of memory) leaves nothing to beat: anything that ran is fast
    failed = record(0, {}, status=worker.OUT_OF_MEMORY)
    failed.baseline = True
    near = record(1, {"dtype": "bfloat16"}, latency=2.9)
    assert repair.next_repair([failed, near], set(), CPU_SPACE, is_cuda=False).of == 1
    near = record(1, {"dtype": "bfloat16"}, latency=2.9)
    assert repair.next_repair([base, near], set(), CPU_SPACE, is_cuda=False) is None
    fast = record(2, FAST, latency=1.0)
    assert repair.next_repair([base, near, fast], set(), CPU_SPACE, is_cuda=False).of == 2


def test_patience_waits_for_a_repair_chain(tmp_path: Path):
    """Nothing fits before the chain's last step, so every trial before it counts as one without
    improvement: --patience 2 would stop after the baseline and the seed, the fast config that fits
    three repairs away."""
    outcome = study.tune(scripted_request(tmp_path, trials=20, patience=2), measure=scripted_measure)
    assert [r.repair["adds"] for r in outcome.records if r.repair] == [
        "quantize_text_encoders=int8wo", "quantize=int8dq", "malloc_mmap_threshold=1MiB"]
    assert outcome.best.latency_s == 1.1 and "--patience 2" in outcome.stop_reason
    assert len(outcome.records) < 20



def test_repairs_take_at_most_half_of_the_trials_when_their_number_is_odd(tmp_path: Path):
    """--trials 5: two repairs at most (the chain to the fit needs three), not three of the five."""
    outcome = study.tune(scripted_request(tmp_path, trials=5), measure=scripted_measure)
    assert [r.repair["adds"] for r in outcome.records if r.repair] == [
        "quantize_text_encoders=int8wo", "quantize=int8dq"]
