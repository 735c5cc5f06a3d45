"""The profile file: atomic writes, validation with one-line errors, fingerprints, choosing."""

import copy
import warnings
from pathlib import Path

import pytest
import yaml

from autotune import ProfileError, ProfileMismatchWarning, fingerprint, load_profile
from autotune import profile as profile_io
from autotune.knobs import baseline
from autotune.models import resolve_model

GiB = 2**30


def point(trial, latency, peak, **config):
    return {"trial": trial, "config": {**baseline(), **config}, "latency_s": latency, "peak_memory_bytes": peak}


def document():
    spec = resolve_model("tiny-sd15")
    fast = point(3, 0.10, 3 * GiB, dtype="bfloat16", channels_last=True)
    small = point(5, 0.20, 1 * GiB, dtype="bfloat16", attention="sliced")
    return {
        "autotune_profile": profile_io.FORMAT_VERSION,
        "model": spec.to_dict(),
        "workload": spec.default_workload.to_dict(),
        "budget": {"memory_bytes": 4 * GiB},
        "machine": fingerprint.machine("cpu"),
        "software": fingerprint.software(),
        "best": fast,
        "baseline": point(0, 0.30, 2 * GiB),
        "pareto": [small, fast],
        "study": {"name": "s", "trials": 6},
    }


@pytest.fixture
def written(tmp_path) -> Path:
    return profile_io.save(document(), tmp_path / "p.yaml")


def test_save_then_load_round_trips(written):
    profile = load_profile(written)
    assert profile.data == document()
    assert profile.config["dtype"] == "bfloat16" and profile.config["channels_last"] is True
    assert not list(written.parent.glob("*.tmp"))


def test_a_failed_write_leaves_the_old_file_whole(written):
    before = written.read_text()
    bad = document() | {"best": object()}  # not representable by the safe dumper
    with pytest.raises(yaml.YAMLError):
        profile_io.save(bad, written)
    assert written.read_text() == before
    assert not list(written.parent.glob("*.tmp"))


def test_choose_takes_the_fastest_point_that_fits(written):
    profile = load_profile(written)
    assert profile.choose()["trial"] == 3
    assert profile.choose(2 * GiB)["trial"] == 5
    with pytest.raises(ProfileError, match="smallest measured peak"):
        profile.choose(GiB // 2)


def test_choose_keeps_the_studys_pick_where_it_fits(tmp_path):
    """A study may keep a simpler config over a front point with a lower median its trials did not
    back (study.choose_best): a budget the pick fits gets the pick, not that point."""
    doc = document()
    doc["best"] = point(0, 0.12, 3 * GiB)  # the default, kept over trial 3's 0.10 s median
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    assert profile.choose()["trial"] == 0
    assert profile.choose(8 * GiB)["trial"] == 0
    assert profile.choose(2 * GiB)["trial"] == 5  # the pick does not fit: the fastest point that does


def test_choose_keeps_the_safety_margin_free(tmp_path):
    doc = document()
    doc["budget"]["margin"] = "10%"
    profile = load_profile(profile_io.save(doc, tmp_path / "p.yaml"))
    # 3 GiB fits 3.2 GiB, but not with 10% of it (0.32 GiB) kept free.
    assert profile.choose(int(3.2 * GiB))["trial"] == 5
    assert profile.choose(int(3.4 * GiB))["trial"] == 3


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda p: p.unlink(), "no such file"),
        (lambda p: p.write_text(""), "empty"),
        (lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]), "truncated"),
        (lambda p: p.write_text("best: [1, 2\n"), "not valid YAML"),
        (lambda p: p.write_text("just: a mapping\n"), "not an autotune profile"),
        (lambda p: p.write_text(p.read_text().replace("autotune_profile: 1", "autotune_profile: 2")), "format version 2"),
        (lambda p: p.write_text(p.read_text().replace("channels_last: true", "warp_drive: true", 1)), "unknown knob"),
    ],
)
def test_bad_profiles_give_one_clear_line(written, mangle, message):
    mangle(written)
    with pytest.raises(ProfileError) as exc:
        load_profile(written)
    text = str(exc.value)
    assert message in text or (message == "truncated" and ("truncated" in text or "not valid YAML" in text))
    assert "\n" not in text


def test_a_different_library_version_warns(tmp_path):
    doc = copy.deepcopy(document())
    doc["software"]["diffusers"] = "0.0.1"
    path = profile_io.save(doc, tmp_path / "old.yaml")
    with pytest.warns(ProfileMismatchWarning, match="diffusers"):
        load_profile(path)


def test_the_same_machine_does_not_warn(written):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileMismatchWarning)
        load_profile(written)


def test_a_cuda_profile_on_a_machine_without_cuda_says_so(tmp_path):
    if fingerprint.cuda_available():
        pytest.skip("this machine has a GPU")
    doc = document()
    doc["machine"] = {**doc["machine"], "device": "cuda", "name": "NVIDIA H100"}
    path = profile_io.save(doc, tmp_path / "gpu.yaml")
    with pytest.warns(ProfileMismatchWarning):
        profile = load_profile(path)
    with pytest.raises(ProfileError, match="device='cpu'"):
        profile.load_pipeline()


def test_gpu_numbering_follows_cuda_visible_devices(monkeypatch):
    # torch numbers the visible GPUs from 0; NVML numbers every GPU on the machine
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert fingerprint.visible_gpus() is None and fingerprint._nvml_index("cuda:1") == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert fingerprint.visible_gpus() == ["2", "3"]
    assert fingerprint._nvml_index("cuda") == 2 and fingerprint._nvml_index("cuda:1") == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert fingerprint.visible_gpus() == []  # no GPU visible at all
