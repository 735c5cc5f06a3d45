"""--gpus on a GPU machine: one worker per GPU in one study, each trial pinned to its GPU.

Skipped without CUDA (conftest). With one GPU, `--gpus 0` still runs the whole path: the parent
sets the study up, a worker process measures, the parent writes the profile."""

import optuna
import torch
import yaml

SPACE = "knobs:\n  dtype: [float32, bfloat16, float16]\n  channels_last: [false, true]\n"


def test_one_worker_per_gpu_measures_and_the_parent_writes_the_profile(cli, tmp_path):
    gpus = ",".join(str(i) for i in range(min(torch.cuda.device_count(), 2)))
    (tmp_path / "space.yaml").write_text(SPACE)
    # --confirm 0: the sharing is under test, not the pick; each confirmation is one more trial
    proc = cli("--model", "tiny-sd15", "--space", "space.yaml", "--trials", "4", "--gpus", gpus, "--confirm", "0",
               "--vram", "4GB", "--study-name", "gpus", "-o", "gpus.yaml")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    for gpu in gpus.split(","):
        assert f"worker on GPU {gpu} ended (exit 0)" in proc.stdout
    profile = yaml.safe_load((tmp_path / "gpus.yaml").read_text())
    assert profile["study"]["trials"] >= 4
    assert profile["machine"]["device"].startswith("cuda")
    url = f"sqlite:///{tmp_path / 'autotune-studies' / 'studies.db'}"
    trials = optuna.load_study(study_name="gpus", storage=url).trials
    measured = [t for t in trials if "result" in t.user_attrs and "duplicate_of" not in t.user_attrs]
    assert len({t.user_attrs["config_key"] for t in measured}) == len(measured)
    assert len({t.user_attrs["worker"] for t in measured}) == len(gpus.split(","))


def test_gpus_refuses_a_gpu_that_is_not_there(cli):
    proc = cli("--model", "tiny-sd15", "--gpus", str(torch.cuda.device_count()), "--trials", "1")
    assert proc.returncode == 1 and "no GPU" in proc.stderr


def test_a_cuda_profile_is_verified_and_loaded_as_production_loads_it(cli, tmp_path):
    """A study on the GPU, its profile replayed by `autotune verify` in a fresh process, and
    loaded from Python: the CUDA paths of Profile.load_pipeline that no other test runs."""
    import numpy as np

    import autotune

    (tmp_path / "space.yaml").write_text(SPACE)
    proc = cli("--model", "tiny-sd15", "--space", "space.yaml", "--trials", "3", "--confirm", "0", "--vram", "4GB",
               "-o", "p.yaml")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    verified = cli("verify", "p.yaml")
    assert verified.returncode == 0, verified.stderr + verified.stdout
    assert "replayed peak" in verified.stdout
    print(verified.stdout[-1500:])
    profile = autotune.load_profile(tmp_path / "p.yaml")
    assert profile.data["machine"]["device"].startswith("cuda")
    pipe = profile.load_pipeline()
    assert pipe.unet.device.type == "cuda"
    w = profile.workload
    out = pipe(prompt="a cube", height=w.height, width=w.width, num_inference_steps=2, output_type="np")
    assert np.isfinite(out.images).all()


def test_the_fork_launcher_on_cuda_measures(cli, tmp_path):
    """Trials forked from a preloaded server: on CUDA that works only if the server's imports left
    CUDA uninitialized. xFormers' import initialized it through diffusers until preload.py asked
    it not to probe the device; another library doing so would make the run say in one line to use
    --launcher spawn (never a raw "Cannot re-initialize CUDA"), and fail here, to be found."""
    (tmp_path / "space.yaml").write_text(SPACE)
    proc = cli("--model", "tiny-sd15", "--space", "space.yaml", "--trials", "2", "--confirm", "0", "--vram", "4GB",
               "--launcher", "fork", "--no-profile")
    said = proc.stdout + proc.stderr
    print(said[-2000:])
    assert "Traceback" not in proc.stderr and "Cannot re-initialize CUDA" not in said
    assert proc.returncode == 0 and "--launcher spawn" not in said
