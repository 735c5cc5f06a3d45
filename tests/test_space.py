import itertools

import optuna
import pytest

from autotune.errors import SpaceError
from autotune.knobs import CATALOGUE, Target, baseline
from autotune.space import SHIPPED_DIR, Dimension, SearchSpace, config_key

CPU_SDXL = Target(device="cpu", family="sdxl")


def write(tmp_path, text, name="space.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("family", ["default", "sdxl", "sd15", "sd3", "flux"])
def test_shipped_spaces_load_and_hold_the_baseline(family):
    space = SearchSpace.from_file(SHIPPED_DIR / f"{family}.yaml")
    assert space.dimensions, family
    # The full spaces hold millions of grid points: configs() generates them lazily, and
    # len() is the grid size, an upper bound (study.py's "space spent" check never fires early).
    configs = space.configs()
    assert len(configs) == space.grid_size() > 1_000_000
    first = list(itertools.islice(configs, 3000))
    assert first[0] == baseline()
    assert len({config_key(c) for c in first}) == len(first)
    assert not any(space.forbidden(c) for c in first)


def test_transformer_families_do_not_search_attention_slicing():
    for family in ("sd3", "flux", "tiny-sd3", "tiny-flux"):
        dims = {d.name: d.choices for d in SearchSpace.from_file(SHIPPED_DIR / f"{family}.yaml").dimensions}
        assert not {"sliced", "sliced-max"} & set(dims.get("attention", ())), family


def test_each_family_space_holds_what_matters_for_it():
    def dims(name):
        return {d.name: d.choices for d in SearchSpace.from_file(SHIPPED_DIR / f"{name}.yaml").dimensions}

    flux, sd3, sdxl, sd15 = dims("flux"), dims("sd3"), dims("sdxl"), dims("sd15")
    assert set(flux["cache"]) == {"none", "first-block", "taylorseer", "magcache"}
    assert {"flash-attn", "sage"} <= set(flux["attention"])
    for other in (sd3, sdxl, sd15):  # caches only where the model has enable_cache
        assert "cache" not in other
    assert "compile_regional" not in sd3  # SD3 names no repeated blocks
    assert "int8dq-filtered" in sdxl["quantize"]  # the SDXL guide's layer filter
    for space in (flux, sd3, sdxl, sd15):
        assert {"default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"} <= set(space["compile"])
        assert {"group-block-1", "group-leaf-stream", "model", "sequential"} <= set(space["offload"])
        assert "fp8-e4m3" in space["layerwise_casting"] and "balanced" in space["placement"]


def test_tiny_spaces_stay_small():
    for family in ("sdxl", "sd15", "sd3", "flux"):
        space = SearchSpace.from_file(SHIPPED_DIR / f"tiny-{family}.yaml")
        assert len(space.configs()) < 2000
        names = {d.name for d in space.dimensions}
        assert not names & {"compile", "cache", "layerwise_casting", "tf32"}


def test_conflicts_narrowed_to_families_follow_the_restricted_target():
    config = {**baseline(), "fuse_qkv": True, "attention": "xformers"}
    space = SearchSpace.from_file(SHIPPED_DIR / "flux.yaml")
    assert space.forbidden(config)  # no target known: every family's rules hold
    gpu = Target(device="cuda", family="flux", capability=(9, 0))
    assert space.restrict(gpu).forbidden(config) is None  # a dispatcher backend on Flux
    sdxl = SearchSpace.from_file(SHIPPED_DIR / "sdxl.yaml").restrict(Target(device="cuda", family="sdxl"))
    assert "undoing fuse_qkv" in sdxl.forbidden(config)


def test_restrict_drops_what_cannot_run_here_with_a_reason():
    space = SearchSpace.from_file(SHIPPED_DIR / "sdxl.yaml").restrict(CPU_SDXL)
    dropped = {(d.knob, d.value): d.reason for d in space.dropped}
    assert "accelerator" in dropped[("offload", "model")]
    assert ("offload", "sequential") in dropped
    assert "offload" not in [d.name for d in space.dimensions]  # only "none" left: not searched


def test_restrict_drops_slicing_for_a_transformer_model(tmp_path):
    path = write(tmp_path, "knobs:\n  attention: [sdpa, sliced]\n  dtype: [float32, bfloat16]\n")
    space = SearchSpace.from_file(path).restrict(Target(device="cpu", family="flux"))
    assert [(d.knob, d.value) for d in space.dropped] == [("attention", "sliced")]
    assert "no-op" in space.dropped[0].reason


def test_extends_merges_knobs_and_forbid(tmp_path):
    write(tmp_path, "knobs:\n  dtype: [float32, bfloat16]\nforbid:\n  - {dtype: bfloat16, compile: default}\n", "base.yaml")
    path = write(tmp_path, "extends: base.yaml\nknobs:\n  compile: [none, default]\n")
    space = SearchSpace.from_file(path)
    assert [d.name for d in space.dimensions] == ["dtype", "compile"]
    assert space.forbidden({**baseline(), "dtype": "bfloat16", "compile": "default"})
    assert not space.forbidden({**baseline(), "dtype": "bfloat16"})
    assert len(space.configs()) == 3


def test_a_copy_of_a_shipped_space_extends_what_the_original_did(tmp_path):
    """sd15.yaml says `extends: default.yaml`: copied elsewhere and edited, it meant a default.yaml
    beside the copy, which is not there. A name not found beside the file is the shipped space's;
    one beside it still comes first."""
    from autotune.space import SHIPPED_DIR

    copy = write(tmp_path, (SHIPPED_DIR / "sd15.yaml").read_text() + "  vae_tiling: [false]\n", "my-sd15.yaml")
    space, shipped = SearchSpace.from_file(copy), SearchSpace.from_file(SHIPPED_DIR / "sd15.yaml")
    assert [d.name for d in space.dimensions] == [d.name for d in shipped.dimensions if d.name != "vae_tiling"]
    assert space.seeds == shipped.seeds  # default.yaml's seeds, as the original has them
    write(tmp_path, "knobs:\n  dtype: [float32, bfloat16]\n  compile: [none, default]\n", "default.yaml")  # beside it: this one
    assert "quantize" not in [d.name for d in SearchSpace.from_file(copy).dimensions]


def test_a_single_value_keeps_the_baseline_beside_it(tmp_path):
    space = SearchSpace.from_file(write(tmp_path, "knobs:\n  dtype: bfloat16\n"))
    assert space.dimensions[0].choices == ("float32", "bfloat16")


def test_conditional_knob_is_searched_only_when_active(tmp_path):
    path = write(
        tmp_path,
        "knobs:\n  dtype: [float32, bfloat16]\n  quantize: {choices: [none, int8wo], when: {dtype: bfloat16}}\n",
    )
    space = SearchSpace.from_file(path)
    assert space.normalize({"dtype": "float32", "quantize": "int8wo"})["quantize"] == "none"
    assert space.normalize({"dtype": "bfloat16", "quantize": "int8wo"})["quantize"] == "int8wo"
    assert len(space.configs()) == 3  # fp32, bf16, bf16+int8wo
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        config = space.suggest(trial)
        assert ("quantize" in trial.params) == (config["dtype"] == "bfloat16")
        study.tell(trial, 1.0)


def test_known_conflicts_are_forbidden():
    space = SearchSpace.from_file(SHIPPED_DIR / "tiny-sdxl.yaml")
    config = {**baseline(), "fuse_qkv": True, "attention": "sliced"}
    assert "undoing fuse_qkv" in space.forbidden(config)
    assert all(not (c["fuse_qkv"] and c["attention"] != "sdpa") for c in space.configs())


@pytest.mark.parametrize(
    "text, message",
    [
        ("knobs:\n  warp_drive: [on]\n", "unknown knob 'warp_drive'"),
        ("knobs:\n  dtype: [float64]\n", "no choice 'float64'"),
        ("knobs: [dtype\n", "not valid YAML"),
        ("- just a list\n", "expected a mapping"),
        ("knobs:\n  dtype: [float32]\nforbid: {dtype: float32}\n", "'forbid' must be a list"),
        ("knobs:\n  dtype: [float32]\nforbid:\n  - {nope: 1}\n", "unknown knob 'nope'"),
        ("knobz:\n  dtype: [float32]\n", "unknown section"),
        # keys of two types (YAML reads 1 as a number): sorting them for the message was a TypeError
        ("{1: a, foo: b}\n", "unknown section(s) 1, foo"),
        pytest.param("[" * 100000, "not valid YAML (nested too deeply)", id="nested-too-deeply"),  # a RecursionError
        ("extends: space.yaml\n", "loops back"),
        ("extends: missing.yaml\n", "missing.yaml: no such file (named relative to the file that extends it, or "
                                     "one of the shipped spaces: default.yaml, flux.yaml, sd15.yaml"),
        ("knobs:\n  quantize: {choices: [none], when: {dtype: float64}}\n", "no choice 'float64'"),
        # a condition on a knob decided later read its baseline value: the knob was never searched
        ("knobs:\n  dtype: {choices: [bfloat16], when: {channels_last: true}}\n  channels_last: [false, true]\n",
         "knob 'dtype' has a 'when' on 'channels_last', which is decided after it"),
        ("knobs:\n  dtype: {choices: [bfloat16], when: {dtype: float32}}\n", "knob 'dtype' has a 'when' on itself"),
        # a condition the space can never meet would leave its knob silently never searched
        ("knobs:\n  quantize: {choices: [int8wo], when: {dtype: bfloat16}}\n",
         "knob 'quantize' is searched only when 'dtype' is bfloat16, which this space never tries ('dtype': float32)"),
        ("knobs:\n  dtype: [float32, float16]\n  quantize: {choices: [int8wo], when: {dtype: [bfloat16]}}\n",
         "which this space never tries ('dtype': float32, float16); add it to 'dtype' or drop the condition"),
        ("extends: [a.yaml, b.yaml]\n", "'extends' takes one file name"),
        ("extends: missing.yaml\n", "space.yaml: it extends"),  # the file that names it, not only the missing one
        # a boolean knob's choices are booleans: 1 is not True
        ("knobs:\n  channels_last: [1]\n", "knob 'channels_last' has no choice 1 (choices: False, True)"),
        ("knobs:\n  channels_last: ['true']\n", "has no choice 'true' (choices: False, True; write true without quotes)"),
        # PyYAML keeps the last of two equal keys without a word: the first list would be lost
        ("knobs:\n  dtype: [float32]\n  dtype: [bfloat16]\n", "the key 'dtype' appears twice in one mapping at line 3"),
        ("knobs:\n  dtype: [float32, bfloat16]\nforbid:\n  - {channels_last: 0}\n",
         "knob 'channels_last' has no choice 0"),
        ("knobs:\n  dtype: !!python/object/apply:os.getpid []\n",
         "uses the tag !!python/object/apply:os.getpid at line 2, which safe loading refuses"),
        # empty lists: a knob silently not searched, a rule that never matches (helper-15)
        ("knobs:\n  dtype: []\n", "knob 'dtype' has no choices (list the values to try"),
        ("knobs:\n  dtype: [float32, bfloat16]\nforbid:\n  - {dtype: []}\n", "a 'forbid' entry gives 'dtype' no value"),
        ("knobs:\n  dtype: [float32, bfloat16]\n  quantize: {choices: [int8wo], when: {dtype: []}}\n",
         "knob 'quantize': 'when' gives 'dtype' no value"),
    ],
)
def test_bad_space_files_give_one_clear_line(tmp_path, text, message):
    with pytest.raises(SpaceError) as exc:
        SearchSpace.from_file(write(tmp_path, text))
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_an_extends_loop_through_another_path_to_the_same_file_is_caught(tmp_path):
    path = write(tmp_path, f"extends: ../{tmp_path.name}/space.yaml\n")
    with pytest.raises(SpaceError, match="loops back") as exc:
        SearchSpace.from_file(path)
    assert len(str(exc.value)) < 300


def test_a_deep_extends_chain_is_read_whole(tmp_path):
    # 1500 files each extending the next met the recursion limit, which the YAML reader blamed on
    # a sound file in the middle ("ch977.yaml: not valid YAML (nested too deeply)")
    for i in range(1500):
        write(tmp_path, f"extends: ch{i + 1}.yaml\nknobs: {{dtype: [float32, bfloat16]}}\n", name=f"ch{i}.yaml")
    write(tmp_path, "knobs: {channels_last: [false, true]}\n", name="ch1500.yaml")
    space = SearchSpace.from_file(tmp_path / "ch0.yaml")  # the farthest file's knob with the nearer ones'
    assert {d.name for d in space.dimensions} == {"dtype", "channels_last"}


def test_every_knob_has_its_default_among_its_choices():
    for knob in CATALOGUE.values():
        assert knob.default in knob.choices


def test_tiny_models_get_their_own_space_without_compile():
    from autotune.models import resolve_model

    for family in ("sdxl", "sd15", "sd3", "flux"):
        space = SearchSpace.for_model(resolve_model(f"tiny-{family}"))
        assert space.source.endswith(f"tiny-{family}.yaml")
        names = [d.name for d in space.dimensions]
        assert "compile" not in names and "dtype" in names
    assert SearchSpace.for_model(resolve_model("sdxl")).source.endswith("sdxl.yaml")


def test_a_shipped_space_is_found_by_its_name_where_no_such_file_is_here(tmp_path, monkeypatch):
    """`--space sdxl.yaml`, as `extends:` names it and the tiny spaces' comments say: it was "no
    such file" anywhere but inside the installed package's folder."""
    monkeypatch.chdir(tmp_path)
    assert SearchSpace.from_file("sdxl.yaml").source == str(SHIPPED_DIR / "sdxl.yaml")
    assert SearchSpace.from_file("tiny-base").source == str(SHIPPED_DIR / "tiny-base.yaml")  # the bare name too
    (tmp_path / "sdxl.yaml").write_text("knobs:\n  dtype: [float32, bfloat16]\n")  # a file here comes first
    assert SearchSpace.from_file("sdxl.yaml").source == "sdxl.yaml"
    with pytest.raises(SpaceError, match=r"^search space missing.yaml: no such file \(a space file's path, or the "
                                         r"name of a shipped space: default.yaml, flux.yaml, "):
        SearchSpace.from_file("missing.yaml")
    with pytest.raises(SpaceError, match="no such file"):
        SearchSpace.from_file("elsewhere/sdxl.yaml")  # a path is a path


def test_a_local_model_folder_gets_its_familys_space_not_a_yaml_file_beside_it(tmp_path):
    """A folder's name is its path: `<folder>.yaml` beside it, some file of the user's, was read
    as its space (an error about a file never given, or a space silently other than sd15's)."""
    from dataclasses import replace

    from autotune.models import resolve_model

    folder = tmp_path / "mymodel"
    (tmp_path / "mymodel.yaml").write_text("knobs:\n  dtype: [float32, float16]\n")
    spec = replace(resolve_model("tiny-sd15"), name=str(folder), kind="pretrained")
    assert SearchSpace.for_model(spec).source == str(SHIPPED_DIR / "sd15.yaml")


@pytest.mark.parametrize("narrowed, gone", [
    ("dtype: [bfloat16]", ["vae_fp16_fix"]),  # sdxl.yaml searches it when dtype is float16
    ("compile: [none]", ["compile_regional", "compile_fullgraph", "compile_vae", "inductor_flags",
                         "compile_freezing"]),
])
def test_narrowing_a_knob_an_extended_space_conditions_on_drops_its_dependents_and_says_so(tmp_path, narrowed, gone):
    """A copy of a shipped space that narrows dtype or compile was refused, with advice to drop a
    condition written in the shipped file (helper-15)."""
    path = write(tmp_path, f"extends: sdxl.yaml\nknobs:\n  {narrowed}\n")
    space = SearchSpace.from_file(path)
    names = [d.name for d in space.dimensions]
    assert not set(gone) & set(names) and "fuse_qkv" in names
    assert {d.knob for d in space.dropped} == set(gone)
    said = {d.knob: d.reason for d in space.dropped}
    assert said["compile_fullgraph" if "compile" in narrowed else "vae_fp16_fix"].startswith("searched only when ")
    assert all(r.endswith(", which this space never tries") for r in said.values())


def test_a_condition_whose_choices_this_machine_drops_drops_its_knob_too(tmp_path):
    """float8dq needs a GPU: channels_last, searched only with it, was listed as searched on a
    CPU, and the rules were blamed for leaving nothing to measure."""
    path = write(tmp_path, "knobs:\n  quantize: [none, float8dq]\n"
                           "  channels_last: {choices: [false, true], when: {quantize: float8dq}}\n")
    space = SearchSpace.from_file(path).restrict(Target(device="cpu", family="sd15"))
    assert space.dimensions == []
    assert [(d.knob, d.value) for d in space.dropped] == [("quantize", "float8dq"), ("channels_last", True)]
    assert space.dropped[1].reason == "searched only when quantize in float8dq, which is not searched here (dropped above)"


def test_seeds_become_full_configs_of_the_space_on_this_machine(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "knobs:\n  dtype: [float32, bfloat16]\n  offload: [none, model]\n  fuse_qkv: [false, true]\n"
        "  attention: [sdpa, sliced]\n"
        "seeds:\n  - {dtype: bfloat16, offload: model}\n  - {dtype: bfloat16}\n"
        "  - {fuse_qkv: true, attention: sliced}\n  - {dtype: float32}\n"
    )
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nknobs:\n  vae_tiling: [false, true]\n")
    space = SearchSpace.from_file(tmp_path / "child.yaml").restrict(Target(device="cpu", family="sd15"))
    seeds = space.seed_configs()
    # offload is dropped on a CPU: the first seed falls back to plain bfloat16, the second repeats
    # it, the third is a known conflict (slicing undoes fused QKV), the fourth is the baseline.
    assert seeds == [{**baseline(), "dtype": "bfloat16"}]


def test_a_seed_must_name_one_known_value_per_knob(tmp_path):
    (tmp_path / "s.yaml").write_text("knobs:\n  dtype: [float32, bfloat16]\nseeds:\n  - {dtype: [bfloat16]}\n")
    with pytest.raises(SpaceError, match="one value per knob"):
        SearchSpace.from_file(tmp_path / "s.yaml")
    (tmp_path / "s.yaml").write_text("knobs:\n  dtype: [float32]\nseeds:\n  - {dtype: float8}\n")
    with pytest.raises(SpaceError, match="float8"):
        SearchSpace.from_file(tmp_path / "s.yaml")


@pytest.mark.parametrize("family", ["default", "sdxl", "sd15", "sd3", "flux"])
def test_shipped_seeds_measure_uncompiled_configs_before_compiled_ones(family):
    # A cold compile of a full-size denoiser takes minutes: a study should hold measured,
    # uncompiled points before it pays for one, and max-autotune (the slowest) comes last.
    seeds = SearchSpace.from_file(SHIPPED_DIR / f"{family}.yaml").seeds
    cost = [{"none": 0, "default": 1}.get(s.get("compile", "none"), 2) for s in seeds]
    assert cost == sorted(cost), seeds


@pytest.mark.parametrize(
    "text, message",
    [
        ("knobs: []\n", "names no knobs"),
        ("knobs: {}\n", "names no knobs"),
        ("forbid:\n  - {dtype: bfloat16}\n", "names no knobs"),
        ("knobs:\n  quantize: {choices: [none, int8wo]}\n", "needs 'when'"),
        ("knobs:\n  quantize: {choices: [none, int8wo]}\n", "quantize: [none, int8wo]"),
        ("knobs:\n  quantize: {when: {dtype: bfloat16}}\n", "needs 'choices'"),
        ("knobs:\n  quantize: {choices: [none], when: bfloat16}\n", "'when' must be a non-empty mapping"),
        ("knobs:\n  quantize: {choices: [none], when: {dtype: bfloat16}, if: 1}\n", "not if"),
        ("knobs:\n  dtype: [float32, bfloat16]\nforbid: [{dtype: bfloat16}, {dtype: float32}]\n",
         "leave no configuration"),
        ("knobs:\n  dtype: [float32, bfloat16]\n  quantize: {choices: [none, int8wo], when: {dtype: bfloat16}}\n"
         "forbid: [{dtype: float32}, {quantize: none}, {quantize: int8wo}]\n", "leave no configuration"),
    ],
)
def test_empty_and_unclear_spaces_give_one_clear_line(tmp_path, text, message):
    with pytest.raises(SpaceError) as exc:
        SearchSpace.from_file(write(tmp_path, text))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_space_of_baseline_values_only_is_allowed(tmp_path):
    # "offload: [none]" says: do not search it. A space that searches nothing measures the
    # baseline alone, as restrict() leaves a space whose choices cannot run here.
    space = SearchSpace.from_file(write(tmp_path, "knobs:\n  offload: [none]\n"))
    assert space.dimensions == [] and space.configs() == [baseline()]
    # a rule against the baseline leaves the other configs: allowed
    space = SearchSpace.from_file(write(tmp_path, "knobs:\n  dtype: [float32, bfloat16]\nforbid: [{dtype: float32}]\n"))
    assert space.configs() == [{**baseline(), "dtype": "bfloat16"}]


def test_rules_that_leave_nothing_runnable_here_fail_when_restricted(tmp_path):
    path = write(tmp_path, "knobs:\n  dtype: [float32, bfloat16]\n  offload: [none, model]\nforbid: [{offload: none}]\n")
    space = SearchSpace.from_file(path)  # offloaded configs are left, on a GPU
    assert len(space.configs()) == 2
    with pytest.raises(SpaceError, match="leave no configuration to measure on cpu"):
        space.restrict(CPU_SDXL)  # a CPU drops offload


def test_allows_a_config_agrees_with_listing_the_configs():
    """The pruned search that finds whether any config is left, against the full enumeration, on
    random small spaces with conditional knobs, random rules and the catalogue's conflicts."""
    import random

    rng = random.Random(0)
    knobs = ["dtype", "fuse_qkv", "quantize", "channels_last", "attention", "vae_tiling"]
    choices = {"dtype": ["float32", "bfloat16", "float16"], "fuse_qkv": [False, True],
               "quantize": ["none", "int8wo", "int8dq"], "channels_last": [False, True],
               "attention": ["sdpa", "sliced"], "vae_tiling": [False, True]}
    seen = {True: 0, False: 0}
    for _ in range(400):
        dims = []
        for name in [n for n in knobs if rng.random() < 0.6]:
            when = {"dtype": rng.choice(["bfloat16", ["bfloat16", "float16"]])} if name == "quantize" and rng.random() < 0.5 else None
            dims.append(Dimension(name, tuple(choices[name][: rng.randint(2, len(choices[name]))]), when))
        forbid = []
        for _ in range(rng.randint(0, 6)):
            names = rng.sample(knobs, rng.randint(1, 2))
            forbid.append({n: rng.choice(choices[n]) for n in names})
        space = SearchSpace(dims, forbid, family=rng.choice([None, "sdxl", "flux"]))
        configs = list(space._iter_configs())
        expected = bool(configs)
        assert space.allows_a_config() == expected, (dims, forbid)
        beyond = any(c != baseline() for c in configs)
        assert space.allows_a_config(besides_the_baseline=True) == beyond, (dims, forbid)
        seen[expected] += 1
    assert min(seen.values()) > 20  # both outcomes were tried


def test_shipped_spaces_allow_a_config_at_once():
    # at once: found without enumerating the space (the sdxl space holds 72 million combinations,
    # minutes to walk); the bound is far above the milliseconds it takes, for a busy machine
    import time

    for name in ("default", "sdxl", "flux", "tiny-sdxl"):
        space = SearchSpace.from_file(SHIPPED_DIR / f"{name}.yaml")
        started = time.perf_counter()
        assert space.allows_a_config()
        assert time.perf_counter() - started < 10


def test_a_space_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_bytes("knobs:\n  dtype: [float32, bfloat16]  # café\n".encode("latin-1"))
    with pytest.raises(SpaceError, match="not UTF-8 text") as exc:
        SearchSpace.from_file(path)
    assert "\n" not in str(exc.value)


def test_compile_is_dropped_on_a_cpu_where_inductor_finds_no_compiler(tmp_path):
    # Inductor looks for $CXX, else g++ (Linux): a c++ on PATH that it would not use must not
    # keep compile as a choice, or every compiled trial fails. A subprocess: the search is cached.
    import shutil
    import subprocess
    import sys

    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no C++ compiler here to put under another name")
    (tmp_path / "c++").symlink_to(gxx)
    code = ("from autotune.knobs import Target\nfrom autotune.space import SearchSpace, SHIPPED_DIR\n"
            "space = SearchSpace.from_file(SHIPPED_DIR / 'sd15.yaml').restrict(Target(device='cpu', family='sd15'))\n"
            "print({d.reason for d in space.dropped if d.knob == 'compile'})")
    env = {k: v for k, v in __import__("os").environ.items() if k != "CXX"}
    seen = subprocess.run([sys.executable, "-c", code], env={**env, "PATH": str(tmp_path)},
                          capture_output=True, text=True, check=True).stdout
    assert "needs a C++ compiler inductor finds" in seen and "g++" in seen


def test_compile_is_dropped_on_a_cuda_target_without_a_c_compiler_for_triton(tmp_path, monkeypatch):
    # Triton builds its kernel launchers with $CC, else gcc or clang, at the first compiled call:
    # a slim image without one would fail every compiled trial. The PATH and CC are real; only
    # the GPU is a value (Target names CUDA, nothing runs on it).
    import shutil

    gcc = shutil.which("gcc")
    target = Target("cuda", "sd15", capability=(9, 0))
    space = SearchSpace.from_file(SHIPPED_DIR / "sd15.yaml")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    dropped = {d.reason for d in space.restrict(target).dropped if d.knob == "compile"}
    assert dropped == {"torch.compile on CUDA needs a C compiler for Triton's kernel launchers (gcc, clang, or $CC)"}
    if gcc is None:
        pytest.skip("no gcc here to name as $CC")
    monkeypatch.setenv("CC", gcc)
    assert not [d for d in space.restrict(target).dropped if d.knob == "compile"]


def test_the_listing_says_why_a_knob_is_not_searched():
    """'fixed at none' alone did not say whether the space leaves a knob out or this machine
    cannot run its other choices."""
    import re

    from rich.console import Console

    from autotune.console import print_space

    target = Target("cpu", "flux")
    out = Console(markup=False, width=200, record=True)
    print_space(SearchSpace.from_file(SHIPPED_DIR / "tiny-flux.yaml").restrict(target), target, out)
    text = out.export_text()
    assert re.search(r"│ cache +│ fixed at none \(not searched in tiny-flux\.yaml\) +│", text)
    assert re.search(r"│ offload +│ fixed at none \(its other choices dropped, below\) +│", text)
    assert "offload=model: CPU offload needs an accelerator" in text


def test_the_listing_names_the_known_conflicts_that_can_bite_here():
    """`--list-knobs` did not say which combinations are never measured (knobs.CONFLICTS): each
    rule is listed where this space can draw it, narrowed to the choices searched here."""
    from rich.console import Console

    from autotune.console import print_space

    compiling = {"compile": ["default", "max-autotune-no-cudagraphs"]}
    space = SearchSpace([
        Dimension("fuse_qkv", (False, True)),
        Dimension("attention", ("sdpa", "sliced", "xformers")),
        Dimension("offload", ("none", "model")),
        Dimension("compile", ("none", "default", "reduce-overhead")),
        Dimension("compile_fullgraph", (False, True), when=compiling),
        Dimension("compile_vae", (False, True), when=compiling),
    ], family="sdxl")
    here = dict((str(rule), reason) for rule, reason in space.conflicts_here())
    # narrowed to what is searched: sliced-max is not, and xFormers undoes the fusion on SDXL
    assert "{'fuse_qkv': True, 'attention': 'sliced'}" in here
    assert "{'fuse_qkv': True, 'attention': 'xformers'}" in here
    assert "{'compile_fullgraph': True, 'offload': 'model'}" in here
    assert "{'compile': 'reduce-overhead', 'offload': 'model'}" in here
    # a rule on knobs this space leaves at their defaults (caches, layerwise casting) cannot bite,
    # nor one that sets a knob its `when` leaves at the default (compile_vae without compile)
    assert not [r for r in here if "cache" in r or "layerwise_casting" in r]
    assert not [r for r in here if "'compile': 'none'" in r]
    # nor one on a knob whose `when` reads a knob this machine dropped (compile, on a CPU here):
    # compile_fullgraph is never drawn (helper-4)
    uncompiled = SearchSpace([d for d in space.dimensions if d.name != "compile"], family="sdxl")
    assert not [r for r, _ in uncompiled.conflicts_here() if "compile_fullgraph" in r]
    assert {"fuse_qkv": True, "attention": "sliced"} in [r for r, _ in uncompiled.conflicts_here()]
    # a rule narrowed to other families is not listed for this one
    flux = SearchSpace(space.dimensions, family="flux")
    assert "{'fuse_qkv': True, 'attention': 'xformers'}" not in {str(r) for r, _ in flux.conflicts_here()}

    out = Console(markup=False, width=300, record=True)
    print_space(space, Target("cuda", "sdxl"), out)
    text = out.export_text()
    assert ("  - fuse_qkv=True with attention=sliced: attention slicing replaces the fused attention "
            "processors, undoing fuse_qkv") in text
    assert "  - compile=reduce-overhead with offload=model: CUDA-graph compile modes" in text
