"""The command line as a user runs it, continued from test_cli.py (split in two so that the test
workers, which take a file each, share the end-to-end runs evenly): bad values caught before a
trial, places that take no file, verify, what a run says, --gpus."""

import os
import re
import signal
import subprocess
import sys
import time

import optuna
import pytest
import yaml

from helpers import (ROOT, SMALL_SPACE, SMALL_WORKLOAD, all_trials, load_benchmark, one_line_error, processes_left_in, run_cli,
                     start_cli, stored_study, wait_for_second_measured_trial, write_profile)


# ---- bad values caught before any trial -----------------------------------------------------------
# A short, cheap run after each bad value: where an old parser let it through, the test fails on a
# finished run (exit 0 or 3) instead of after a full default study.
CHEAP = ["--model", "tiny-sd15", "--space", "small.yaml", "--trials", "1", "--confirm", "0", "--min-psnr", "0",
         "--repeats", "1", "--height", "64", "--width", "64", "--steps", "1"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--margin", "-5%"], "margin '-5%' is negative"),  # argparse took it for an option
        (["--margin", "-512MB"], "margin '-512MB' is negative"),
        (["--spread", "nan"], "must be a finite number"),
        (["--timeout", "nan"], "must be a finite number"),
        (["--trial-timeout", "inf"], "must be a finite number"),
        (["--min-psnr", "nan"], "must be a finite number"),
        (["--min-psnr", "1000"], "1000 dB is above what any output scores (100 dB: identical to the reference)"),
        (["--vram", "2GB", "--margin", "3GB"], "--margin 3GB is not under the budget 2.00 GiB"),
        (["--vram", "2GB", "--margin", "2GB"], "--margin 2GB is not under the budget 2.00 GiB"),
        (["--height", "63"], "--height 63: tiny-sd15 (sd15) takes multiples of 8 pixels, such as 56 or 64"),
        (["--model", "tiny-sd3", "--width", "72"], "--width 72: tiny-sd3 (sd3) takes multiples of 16"),
        (["--model", "tiny-flux", "--height", "8"], "--height 8: tiny-flux (flux) takes multiples of 16 pixels, such as 16"),
    ],
    ids=["negative-percent-margin", "negative-size-margin", "nan-spread", "nan-timeout", "inf-trial-timeout",
         "nan-min-psnr", "min-psnr-above-cap", "margin-over-budget", "margin-equal-budget", "height-63", "sd3-width-72", "flux-height-8"],
)
def test_bad_values_are_usage_errors_before_any_trial(cli, tmp_path, args, message):
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    proc = cli(*CHEAP, *args)
    assert message in one_line_error(proc)
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "autotune-studies").exists()  # nothing was set up, let alone measured


# ---- places that take no file ----------------------------------------------------------------------
@pytest.mark.parametrize("storage", [[], ["--storage", "sqlite:///{tmp}/s.db"]], ids=["default-storage", "own-storage"])
def test_an_unwritable_working_folder_is_one_line(tmp_path, storage):
    """/proc takes no folder: the default storage and, with any --storage, the trials' files
    (autotune-studies/trials) could not be written."""
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    args = [a.replace("small.yaml", str(tmp_path / "small.yaml")) for a in CHEAP]
    proc = run_cli(*args, *[a.format(tmp=tmp_path) for a in storage], cwd="/proc")
    line = one_line_error(proc)
    assert proc.returncode == 1
    assert "cannot write /proc/autotune-studies" in line and "give --workdir a writable folder" in line


def test_workdir_holds_the_trials_the_compile_cache_and_the_default_storage(cli, tmp_path):
    """From a folder that takes no file, --workdir elsewhere is all a run needs; export finds the
    study there too."""
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    args = [a.replace("small.yaml", str(tmp_path / "small.yaml")) for a in CHEAP]
    work = tmp_path / "work?1"  # a character that means something in a URL
    proc = run_cli(*args, "--trials", "1", "--workdir", work, "-o", tmp_path / "p.yaml", cwd="/proc")
    assert proc.returncode == 0, proc.stderr
    assert (work / "studies.db").is_file() and list(work.glob("trials/*/trial-*/"))
    (study,) = [d.name for d in (work / "trials").iterdir()]
    proc = cli("export", "--study-name", study, "--workdir", work, "-o", "again.yaml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"study {study} in sqlite:///"), proc.stdout  # which study, before its summary
    assert (tmp_path / "again.yaml").is_file() and not (tmp_path / "autotune-studies").exists()


def test_a_budget_over_the_machines_memory_is_run_and_said(cli, tmp_path):
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    proc = cli(*CHEAP, "--vram", "100TB", "--no-profile")
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stdout.split())
    assert "note: the budget 102400.00 GiB, less its margin, is more than this machine's memory (" in said
    assert "every configuration that runs fits it" in said


@pytest.mark.parametrize("output, words", [("afile/p.yaml", ["afile", "in the way"]), ("/proc/p.yaml", ["/proc"]),
                                           (".", ["is a folder"])],
                         ids=["file-in-the-way", "proc", "a-folder"])
def test_an_unwritable_profile_path_is_refused_before_the_first_trial(cli, tmp_path, output, words):
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    (tmp_path / "afile").write_text("")
    proc = cli(*CHEAP, "-o", output)
    line = one_line_error(proc)
    assert proc.returncode == 1
    assert line.startswith(f"autotune: error: profile {output}: ") and all(w in line for w in words), line
    assert not list(tmp_path.glob("autotune-studies/trials/*/trial-*"))  # no trial measured first


@pytest.mark.slow
def test_the_default_profile_of_another_run_is_not_replaced(cli, tmp_path):
    """MODEL-BUDGET.yaml says nothing of the workload: a run at another height would have replaced
    the profile silently. Refused before its first trial; -o writes it elsewhere."""
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    assert cli(*CHEAP, "--vram", "2GB").returncode == 0
    before = (tmp_path / "tiny-sd15-2GB.yaml").read_text()
    assert cli(*CHEAP, "--vram", "2GB").returncode == 0  # the same run again: its own profile, rewritten
    proc = cli(*CHEAP, "--vram", "2GB", "--height", "72")
    line = one_line_error(proc)
    assert proc.returncode == 1
    assert line.startswith("autotune: error: tiny-sd15-2GB.yaml holds the profile of another run") and "-o" in line
    assert (tmp_path / "tiny-sd15-2GB.yaml").read_text().split("study:")[1] == before.split("study:")[1]
    assert not list(tmp_path.glob("autotune-studies/trials/*72x64*"))  # nothing measured
    assert cli(*CHEAP, "--vram", "2GB", "--height", "72", "-o", "tall.yaml").returncode == 0
    # export writes to the same default name: held to the same rule
    tall = yaml.safe_load((tmp_path / "tall.yaml").read_text())["study"]["name"]
    proc = cli("export", "--study-name", tall)
    line = one_line_error(proc)
    assert line.startswith("autotune: error: tiny-sd15-2GB.yaml holds the profile of another run"), line
    assert proc.stdout == ""  # refused before the study's summary, not after it (helper-6)
    # a study with nothing to write is not refused: its summary says why no profile is written
    proc = cli(*CHEAP, "--vram", "1MB", "--height", "72", "-o", "none.yaml")
    assert proc.returncode == 3 and not (tmp_path / "none.yaml").exists(), proc.stderr
    tiny = proc.stdout.splitlines()[0].rsplit("; study ", 1)[1]
    (tmp_path / "tiny-sd15-1MB.yaml").write_text((tmp_path / "tall.yaml").read_text())  # its default name
    proc = cli("export", "--study-name", tiny)
    assert proc.returncode == 3 and "holds the profile of another run" not in proc.stderr, proc.stderr
    assert f"study {tiny} in " in proc.stdout and "no profile written" in proc.stderr
    assert (tmp_path / "tiny-sd15-1MB.yaml").read_text() == (tmp_path / "tall.yaml").read_text()


@pytest.mark.slow
def test_a_profile_written_by_another_run_during_the_search_is_not_replaced(cli, tmp_path):
    """The default name was checked before the search only: a run of another workload that wrote
    its profile there meanwhile had it replaced without a word when this one ended (helper 70).
    The other run's profile is put there while this run measures its first trial."""
    import shutil
    import subprocess
    import sys
    import time

    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    assert cli(*CHEAP, "--vram", "2GB", "--height", "72", "-o", "tall.yaml").returncode == 0
    run = subprocess.Popen([sys.executable, "-m", "autotune", *CHEAP, "--vram", "2GB"], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("autotune-studies/trials/*64x64*/trial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    shutil.copy(tmp_path / "tall.yaml", tmp_path / "tiny-sd15-2GB.yaml")
    stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 1, stdout + stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("autotune: error:")]
    assert line.startswith("autotune: error: tiny-sd15-2GB.yaml holds the profile of another run"), line
    assert "the measured trials are kept: autotune export --study-name " in line
    assert (tmp_path / "tiny-sd15-2GB.yaml").read_text() == (tmp_path / "tall.yaml").read_text()


def test_a_default_profile_path_holding_what_autotune_does_not_read_is_not_replaced(cli, tmp_path):
    """A file at the default name that does not read as a profile (a newer autotune's, a user's
    own) was replaced without a word: "nothing a server could load is lost". Refused before the
    search."""
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    (tmp_path / "tiny-sd15-2GB.yaml").write_text("notes: mine\n")
    line = one_line_error(proc := cli(*CHEAP, "--vram", "2GB"))
    assert proc.returncode == 1
    assert line.startswith("autotune: error: tiny-sd15-2GB.yaml holds a file this autotune does not read as a "
                           "profile (") and "-o" in line, line
    assert (tmp_path / "tiny-sd15-2GB.yaml").read_text() == "notes: mine\n"
    assert not list(tmp_path.glob("autotune-studies/trials/*/trial-*"))


@pytest.mark.slow
def test_an_output_named_with_o_is_never_a_file_of_the_users_and_another_profile_is_replaced_aloud(cli, tmp_path):
    """`-o notes.md` replaced a user's file with a profile, and `-o` naming another model's
    profile replaced it without a word (helper-2): only the default name was checked. A file
    autotune does not read as a profile is refused before the search; another study's profile,
    named on purpose, is replaced with a note."""
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    (tmp_path / "notes.md").write_text("# my notes\n")
    line = one_line_error(proc := cli(*CHEAP, "--vram", "2GB", "-o", "notes.md"))
    assert proc.returncode == 1
    assert line.startswith("autotune: error: notes.md holds a file this autotune does not read as a profile ("), line
    assert "name another file with -o, or move the file away" in line, line
    assert (tmp_path / "notes.md").read_text() == "# my notes\n"
    assert not list(tmp_path.glob("autotune-studies/trials/*/trial-*"))  # refused before the search
    assert cli(*CHEAP, "--vram", "2GB", "--height", "72", "-o", "served.yaml").returncode == 0
    tall = yaml.safe_load((tmp_path / "served.yaml").read_text())["study"]["name"]
    proc = cli(*CHEAP, "--vram", "2GB", "-o", "served.yaml")
    assert proc.returncode == 0, proc.stderr
    assert f"note: served.yaml holds the profile of study {tall}: this run's profile will replace it" in proc.stdout
    assert f"replaced the profile of study {tall} in served.yaml" in proc.stdout
    assert yaml.safe_load((tmp_path / "served.yaml").read_text())["study"]["name"] != tall
    # export is held to the same rule, before it prints the study's summary (helper-4)
    proc = cli("export", "--study-name", tall, "-o", "notes.md")
    assert "notes.md holds a file this autotune does not read as a profile" in one_line_error(proc)
    assert proc.stdout == "" and (tmp_path / "notes.md").read_text() == "# my notes\n"
    # an empty file (mktemp's) holds nothing to lose
    from autotune.cli import _check_output_replaceable

    (tmp_path / "empty.yaml").touch()
    assert _check_output_replaceable(tmp_path / "empty.yaml", "mine", default_named=False) is None


@pytest.mark.slow
def test_this_studys_profile_in_a_form_autotune_no_longer_reads_is_written_anew(cli, tmp_path):
    """A profile of this very study that this autotune does not read (an older autotune wrote it:
    "export it again") was refused as another file, and exporting again was what was refused
    (helper 74). Its study name, read as plain YAML, makes it this run's to replace."""
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    assert cli(*CHEAP, "--vram", "2GB").returncode == 0
    written = yaml.safe_load((tmp_path / "tiny-sd15-2GB.yaml").read_text())
    name = written["study"]["name"]
    (tmp_path / "tiny-sd15-2GB.yaml").write_text(yaml.safe_dump({"study": {"name": name}}))
    proc = cli("export", "--study-name", name)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load((tmp_path / "tiny-sd15-2GB.yaml").read_text())["best"] == written["best"]


def test_a_cut_journal_in_a_folder_it_cannot_write_is_one_line(tmp_path):
    """Setting a cut record aside needs Optuna's lock file beside the journal: in a read-only
    folder that was a traceback (helper 74)."""
    from helpers import run_cli_behind_a_locked_folder

    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "j.log").write_bytes(b'{"op_code": 0, "worker_id": "a", "study_name": "s", "directions": [1]}\n{"op_')
    proc = run_cli_behind_a_locked_folder(folder, "--model", "tiny-sd15", "--vram", "2GB", "--storage",
                                          f"journal:{folder / 'j.log'}", cwd=tmp_path, mode=0o555)
    line = one_line_error(proc)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "j.log ends in a record cut short, which could not be set aside (" in line, line


def test_the_export_line_printed_for_a_study_pastes_into_a_shell(tmp_path):
    """`autotune export --study-name a b --storage sqlite:///w s/studies.db` was printed unquoted:
    pasted, it failed on its arguments (helper 70). Each line is pasted into bash here, and export
    reads the name and storage whole: it answers that the study is not in that storage."""
    import shlex
    import subprocess
    import sys

    from autotune.storages import export_command

    for name, folder in (("a b", "w s"), ("-x", "w"), ("a;echo pasted", "w")):
        (tmp_path / folder).mkdir(exist_ok=True)
        line = export_command(name, f"sqlite:///{tmp_path / folder / 'studies.db'}")
        pasted = line.replace("autotune", f"{shlex.quote(sys.executable)} -m autotune", 1)
        proc = subprocess.run(["bash", "-c", pasted], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.stderr.startswith(f"autotune: error: no study {name!r}: storage sqlite:///"
                                      f"{tmp_path / folder / 'studies.db'}: no such file"), (line, proc.stderr)
        assert proc.returncode == 1 and "pasted" not in proc.stdout, (line, proc.stdout)


# ---- verify ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_changed_space_says_what_changed_and_names_the_earlier_study(cli, tmp_path):
    """After an update that changes the shipped space, the same command makes another default
    study name (the space is part of it): its profile is refused, as any other run's, saying that
    the space is what differs, and the new study starts with a note naming the earlier one, whose
    trials --warm-start can reuse. Here the space file is edited, as an update would edit it."""
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    assert cli(*CHEAP, "--vram", "2GB").returncode == 0
    (earlier,) = [d.name for d in (tmp_path / "autotune-studies" / "trials").iterdir()]
    (tmp_path / "small.yaml").write_text(SMALL_SPACE + "  fuse_qkv: [false, true]\n")
    line = one_line_error(cli(*CHEAP, "--vram", "2GB"))
    assert line.startswith(f"autotune: error: tiny-sd15-2GB.yaml holds the profile of another run (study {earlier}, "
                           "measured under other settings (the search space: fuse_qkv searched differently"), line
    proc = cli(*CHEAP, "--vram", "2GB", "-o", "new.yaml")
    assert proc.returncode == 0, proc.stderr
    note = " ".join(proc.stdout.split())  # rich wraps long lines
    assert (f"note: this storage holds study {earlier} (1 measured trial) of the same model, size and budget, "
            "measured under other settings (the search space: fuse_qkv searched differently") in note, note
    assert f"--warm-start {earlier} would measure" in note
    # resumed: its own study, no note
    proc = cli(*CHEAP, "--vram", "2GB", "-o", "new.yaml")
    assert proc.returncode == 0 and "note: this storage holds" not in proc.stdout
    # only the forbid rules changed: a study records none, and the name's digest holds them
    (tmp_path / "small.yaml").write_text(SMALL_SPACE + "forbid:\n  - {dtype: bfloat16, channels_last: true}\n")
    proc = cli(*CHEAP, "--vram", "2GB", "-o", "third.yaml")
    note = " ".join(proc.stdout.split())
    assert f"study {earlier} (1 measured trial) of the same model, size and budget, measured under other settings " \
           "(the search space's forbid rules)" in note, note



def _no_cuda():
    from autotune.fingerprint import cuda_available

    return not cuda_available()


@pytest.mark.parametrize(
    "device, args, message, code",
    [
        ("cpu", ["--device", "gpu"], "argument --device: 'gpu' is not a device: expected cuda, cuda:N or cpu", 2),
        pytest.param("cuda", [], "measured on cuda, and no CUDA GPU is usable here; replay it on the CPU with "
                     "--device cpu", 1, marks=pytest.mark.skipif(not _no_cuda(), reason="CUDA is usable here")),
        pytest.param("cpu", ["--device", "cuda"], "--device cuda: no CUDA GPU is usable here", 1,
                     marks=pytest.mark.skipif(not _no_cuda(), reason="CUDA is usable here")),
        # a config that cannot run on the device asked for: refused before a replay starts, as
        # load_pipeline refuses it (it was found only once a fresh interpreter had started)
        ("cuda", ["--device", "cpu", "--trial-timeout", "0.5"], "cannot run on cpu here", 1),
    ],
    ids=["unknown-device", "cuda-profile-without-cuda", "cuda-without-cuda", "unrunnable-on-the-device"],
)
def test_verify_checks_the_device_before_replaying(cli, tmp_path, device, args, message, code):
    write_profile(tmp_path / "p.yaml", device=device, config={"attention": "sdpa-efficient", "dtype": "bfloat16"} if "cpu" in args else None)
    proc = cli("verify", "p.yaml", *args)
    assert proc.returncode == code  # a device autotune does not know is bad usage (2), as any bad option value
    assert message in one_line_error(proc)
    assert "replayed peak" not in proc.stdout  # no verdict: nothing was replayed


def test_verify_checks_the_weights_are_here_before_replaying(cli, tmp_path):
    # a model folder gone was said after a replay's start (10 s) and a table of dashes
    path = write_profile(tmp_path / "p.yaml")
    doc = yaml.safe_load(path.read_text())
    doc["model"].update(kind="pretrained", source=str(tmp_path / "gone"), name="gone")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = cli("verify", "p.yaml")
    assert proc.returncode == 1
    assert one_line_error(proc) == f"autotune: error: profile p.yaml: no such model folder {tmp_path / 'gone'}"
    assert "replayed" not in proc.stdout and "-" * 3 not in proc.stdout  # no table: nothing was replayed


def test_replay_fidelity_adds_its_run_under_the_opening_prose_and_above_the_earlier_runs():
    add = load_benchmark("replay_fidelity").with_run_added
    run = "## 2026-12-03 09:00, a CPU\n\n| row |\n"
    assert add("", run) == "# Replay fidelity\n\n## 2026-12-03 09:00, a CPU\n\n| row |\n"
    # a "## " line in the opening prose (here in a fence) is prose, not a run to put the new one above
    prose = "# Replay fidelity\n\nHow to read it:\n\n```\n## not a run\n```\n"
    older = "## 2026-12-02 14:48, a CPU\n\n| old |\n"
    assert add(prose + "\n" + older, run) == prose + "\n" + run + "\n" + older
    # the committed file: taking its newest run off and adding it back gives the file unchanged
    committed = (ROOT / "benchmarks" / "results" / "replay_fidelity.md").read_text()
    top, newest, rest = re.split(r"^(?=## \d{4}-)", committed, maxsplit=2, flags=re.MULTILINE)
    assert add(top + rest, newest) == committed


@pytest.mark.slow
def test_verify_judges_the_fit_with_the_profile_margin_and_not_a_failed_replay(cli, tmp_path):
    # tiny-sd15 replays at 64x64 with a peak of about 500 MiB (a fresh interpreter, torch loaded):
    # within 2 GiB, but not with 1800 MiB of it kept free, as Profile.choose would keep it
    write_profile(tmp_path / "tight.yaml", budget="2GB", margin="1800MB")
    proc = cli("verify", "tight.yaml", "--repeats", "1")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "margin 1800MB" in proc.stdout
    assert "plus the profile's margin (1800MB, 1.76 GiB) is above the profile's budget (2.00 GiB)" in one_line_error(proc)

    # measured with more threads than this machine has cores (a bigger machine's profile, or a
    # hand edit): replayed with the cores here, and said so
    write_profile(tmp_path / "roomy.yaml", budget="2GB", margin="5%", threads=4096)
    proc = cli("verify", "roomy.yaml", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "margin 5%: replayed peak" in proc.stdout and " fits (" in proc.stdout
    assert f"warning: measured with 4096 CPU threads; replayed with {len(os.sched_getaffinity(0))}, the cores here" in proc.stdout
    # benchmarks/replay_fidelity.py reads the ratios off this table (it broke when they took an x)
    replay_fidelity = load_benchmark("replay_fidelity")
    assert replay_fidelity.replayed(proc.stdout, "latency (median)") > 0
    assert replay_fidelity.replayed(proc.stdout, "peak memory") > 0

    # how it was measured left null, as the profile's reader allows: replayed with the defaults
    # (max(None, 3) was a TypeError traceback in trial_request)
    write_profile(tmp_path / "nulls.yaml", measurement={"threads": None, "timed_calls_max": None, "spread_limit": None})
    proc = cli("verify", "nulls.yaml", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and " fits (" in proc.stdout

    # a GPU profile replayed on the CPU: two devices compared, and no verdict on the GPU's budget
    # (host memory was judged against it: "DOES NOT FIT", exit 3; helper 66)
    write_profile(tmp_path / "gpu.yaml", device="cuda", budget="2GB", margin="1800MB")
    proc = cli("verify", "gpu.yaml", "--device", "cpu", "--repeats", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join(proc.stdout.split())
    assert "note: measured on cuda, replayed on cpu: the ratios compare two devices, and the budget (2.00 GiB of " \
           "cuda's memory) is not judged here" in said, said
    assert "DOES NOT FIT" not in said and " fits (" not in said

    # a replay that measured nothing (killed at once) gets the failure, and no fit verdict
    proc = cli("verify", "roomy.yaml", "--trial-timeout", "0.5")
    assert proc.returncode == 1
    assert "the replay failed: timeout" in one_line_error(proc)
    assert "replayed peak" not in proc.stdout and "fits" not in proc.stdout


# ---- what a run says -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_no_fit_because_of_the_margin_names_the_margin(cli, tmp_path):
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    # peaks of about 500 MiB: under 2 GiB, but not with 1800 MiB of it kept free
    proc = cli(*CHEAP, "--vram", "2GB", "--margin", "1800MB")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    line = one_line_error(proc)
    assert "no configuration fits 2.00 GiB: the smallest peak memory measured was" in line
    assert "MiB plus the margin of 1.76 GiB; no profile written" in line
    # with --no-profile (the same study, measured already): the summary, and still "nothing fits"
    proc = cli(*CHEAP, "--vram", "2GB", "--margin", "1800MB", "--no-profile")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no configuration fits 2.00 GiB: the smallest peak memory measured was" in one_line_error(proc)


def test_a_warm_start_from_a_profile_or_a_study_measures_its_front_first(cli, tmp_path):
    """--warm-start takes a profile file, NAME@URL or a study NAME in this run's storage: the
    configs of its front are measured first after the baseline; an unknown one is one line."""
    from autotune.knobs import complete
    from autotune.study import config_key

    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    first = [*CHEAP, "--trials", "3", "--study-name", "first", "-o", "first.yaml"]
    assert cli(*first).returncode == 0
    first_profile = yaml.safe_load((tmp_path / "first.yaml").read_text())
    # the baseline is measured first in any study: a front that holds it has that one fewer to add
    front = [point["config"] for point in first_profile["pareto"]
             if config_key(point["config"]) != config_key(first_profile["baseline"]["config"])]
    url = f"sqlite:///{tmp_path / 'autotune-studies' / 'studies.db'}"
    # a profile whose front surely holds a config other than the baseline (the study's front may
    # be the baseline alone, on a machine where nothing else ran faster)
    hand = {"dtype": "bfloat16", "channels_last": True}
    write_profile(tmp_path / "hand.yaml", config=hand)
    # A profile file and a study NAME run end to end; the other two forms resolve through the same
    # function to the same configs (two more runs that measured nothing new: about 20 s of CI).
    from autotune.cli import _warm_start_configs

    def keys(configs):
        return sorted(config_key(complete(c)) for c in configs)

    for source in (str(tmp_path / "first.yaml"), f"first@{url}"):
        resolved = [c for c in _warm_start_configs([source], url, "tiny-sd15") if keys([c]) != keys([first_profile["baseline"]["config"]])]
        assert keys(resolved) == keys(front), source
    for name, source, expected in [("from-profile", "hand.yaml", [hand]), ("from-name", "first", front)]:
        proc = cli(*CHEAP, "--trials", "3", "--study-name", name, "--warm-start", source, "--no-profile")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        trials = optuna.load_study(study_name=name, storage=url).trials
        warm = [t for t in trials if t.user_attrs.get("warm_start")]
        assert [t.number for t in warm] == list(range(1, 1 + len(warm)))  # right after the baseline
        # every front config but the baseline proposed, in the space's terms
        proposed = sorted(config_key(t.user_attrs["config"]) for t in warm)
        assert proposed == keys(expected), (source, proposed, expected)
    # On a study that exists, the configs it has not measured are queued (a resume left them out
    # without a word), those it has are not; a profile of another model is taken with a warning.
    other = {"dtype": "bfloat16", "attention": "sliced"}
    write_profile(tmp_path / "other.yaml", config=other, model="tiny-sdxl")
    proc = cli(*CHEAP, "--trials", "4", "--study-name", "from-profile", "--warm-start", "other.yaml",
               "--warm-start", "hand.yaml", "--no-profile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--warm-start other.yaml: measured on tiny-sdxl, not tiny-sd15" in proc.stderr
    trials = [t for t in optuna.load_study(study_name="from-profile", storage=url).trials if "config" in t.user_attrs]
    keys = [config_key(t.user_attrs["config"]) for t in trials if "duplicate_of" not in t.user_attrs]
    assert len(keys) == 4 and config_key(complete(other)) in keys
    assert sum(t.user_attrs.get("warm_start", False) and config_key(t.user_attrs["config"]) == config_key(complete(hand))
               for t in trials) == 1  # measured in the first run: not queued again
    # a study that holds its --trials already: the new config waits, and the run says so
    measured = {config_key(t.user_attrs["config"]) for t in trials}
    third = next(c for c in ({"dtype": d, "channels_last": cl, "attention": a} for d in ("float32", "bfloat16")
                             for cl in (False, True) for a in ("sdpa", "sliced")) if config_key(complete(c)) not in measured)
    write_profile(tmp_path / "third.yaml", config=third)
    proc = cli(*CHEAP, "--trials", "4", "--study-name", "from-profile", "--warm-start", "third.yaml", "--no-profile")
    assert proc.returncode == 0 and "1 queued config not measured: raise --trials to measure them" in proc.stdout
    line = one_line_error(cli(*CHEAP, "--warm-start", "nosuch"))
    assert "--warm-start nosuch: no such profile file, nor a study 'nosuch' in sqlite:///" in line


def test_a_run_where_no_configuration_ran_is_an_error_not_a_budget_too_small(cli, tmp_path):
    # every trial killed at once: nothing was measured, so nothing says the budget is too small (3)
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    # spawn: a fresh interpreter importing torch takes over 0.5 s on any machine
    proc = cli(*CHEAP, "--trial-timeout", "0.5", "--launcher", "spawn")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_line_error(proc)
    assert line == ("autotune: error: no configuration ran (timeout 1); trial 0: no result after 0.5 s "
                    "(--trial-timeout); killed; no profile written")
    assert [p.name for p in tmp_path.glob("*.yaml")] == ["small.yaml"]  # no profile


@pytest.mark.slow
@pytest.mark.parametrize("guard", ["auto", "0"], ids=["reference-call", "baseline-trial"])
def test_a_model_that_does_not_load_stops_the_run_with_its_reason(cli, tmp_path, guard):
    """A model folder missing its UNet: no config can run. Before, every trial failed to load and
    the run ended with exit 3 "no configuration fits", or with a hint to turn the guard off."""
    import shutil

    from autotune.models import build_pipeline, resolve_model

    build_pipeline(resolve_model("tiny-sd15")).save_pretrained(tmp_path / "broken")
    shutil.rmtree(tmp_path / "broken" / "unet")
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    proc = cli("--model", "broken", "--space", "small.yaml", "--trials", "3", "--confirm", "0", "--min-psnr", guard,
               "--repeats", "1", "--vram", "2GB", *SMALL_WORKLOAD)
    line = one_line_error(proc)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert line.startswith("autotune: error: the model did not load") and "cannot load" in line, line
    assert "--min-psnr 0" not in line
    study = stored_study(tmp_path)
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]  # stopped at once
    if guard == "0":  # the baseline failed as a trial: queued again, for the same command once mended
        waiting = [t for t in study.trials if t.state == optuna.trial.TrialState.WAITING]
        assert [t.user_attrs.get("baseline") for t in waiting] == [True]


def test_the_summary_shows_where_an_out_of_memory_baseline_stopped():
    from rich.console import Console

    from autotune.console import print_summary
    from autotune.study import StudyOutcome, TrialRecord

    stopped = TrialRecord(0, {}, "out_of_memory", {"peak_memory_bytes": 4 * 2**30}, 2.0, baseline=True)
    outcome = StudyOutcome(records=[stopped], stop_reason="done", baseline=stopped)
    out = Console(markup=False, record=True, width=120)
    print_summary(out, outcome, 2 * 2**30)
    text = out.export_text()
    assert ">= 4.00 GiB" in text and "baseline: out_of_memory" in text


def test_trials_timed_beside_busy_neighbours_are_flagged_on_their_line_and_in_the_summary():
    from rich.console import Console

    from autotune.console import TrialProgress, print_summary
    from autotune.study import StudyOutcome, TrialRecord

    busy = TrialRecord(0, {}, "ok", {"peak_memory_bytes": 2**30, "latency_s": 1.0, "cores_taken_by_others": 0.8}, 1.0,
                       baseline=True)
    quiet = TrialRecord(1, {"dtype": "bfloat16"}, "ok", {"peak_memory_bytes": 2**30, "latency_s": 0.5,
                                                         "cores_taken_by_others": 0.01}, 0.5)
    out = Console(markup=False, record=True, width=200)
    with TrialProgress(out, 2) as progress:
        progress.update(busy)
        progress.update(quiet)
    lines = [line for line in out.export_text().splitlines() if line.startswith("trial")]
    assert "(timed while other processes took 0.8 of its CPU cores)" in lines[0] and "busy" not in lines[1]
    print_summary(out, StudyOutcome(records=[busy, quiet], stop_reason="done", baseline=busy, best=quiet), 2**31)
    assert "warning: timings taken while other processes took the trials' CPU cores (up to 0.8): 1 of 2," in out.export_text()


def test_a_trial_that_host_memory_stopped_says_it_was_the_machines_limit_not_the_budgets():
    # under a GPU budget nothing says the budget was reached: "before the budget was reached" was
    # said on both devices (helper-8)
    from rich.console import Console

    from autotune.console import TrialProgress
    from autotune.study import TrialRecord

    short = {"status": "out_of_memory", "error": "CPU out of memory", "out_of_memory_on": "host"}
    record = TrialRecord(3, {"dtype": "bfloat16"}, "out_of_memory", short, 1.0)
    entry = {**short, "latency_s": None, "violation": 0.0}
    out = Console(markup=False, record=True, width=300)
    with TrialProgress(out, 1) as progress:
        progress.update(record)
        progress.confirmed(record, entry)
    lines = [line for line in out.export_text().splitlines() if line.startswith(("trial", "again"))]
    assert len(lines) == 2 and all("(host memory ran short: this machine's RAM stopped it, not the budget)" in line
                                   for line in lines), lines


def test_a_confirmation_round_cut_short_says_so_on_its_again_line():
    from rich.console import Console

    from autotune.console import TrialProgress
    from autotune.study import TrialRecord

    record = TrialRecord(3, {"dtype": "bfloat16"}, "ok", {"peak_memory_bytes": 2**30, "latency_s": 0.5}, -0.5)
    entry = {"latency_s": 10.7, "peak_memory_bytes": 2**30, "status": "ok", "violation": -0.5,
             "cores_taken_by_others": 1.0, "cut_short": "its warm calls took 10.600 and 10.800 s, over 1.000 s"}
    out = Console(markup=False, record=True, width=300)
    with TrialProgress(out, 1) as progress:
        progress.confirmed(record, entry)
    (line,) = [line for line in out.export_text().splitlines() if line.startswith("again")]
    assert "10.700 s, 1.00 GiB (cut short: its warm calls took 10.600 and 10.800 s, over 1.000 s)" in line, line


def test_a_confirmed_configs_median_names_the_trials_timed_under_load_it_leaves_aside():
    from autotune.console import _median_range, _medians_said
    from autotune.study import TrialRecord

    def run(latency, taken):
        return {"status": "ok", "latency_s": latency, "peak_memory_bytes": 2**30, "cores_taken_by_others": taken}

    one = TrialRecord(0, {}, "ok", run(11.054, 1.0), -0.5, confirmations=[run(0.72, 0.0), run(14.323, 1.0)])
    assert _medians_said(one) == "1 quiet trial: 0.720 s; 2 timed under load left aside: 11.054, 14.323 s"
    two = TrialRecord(0, {}, "ok", run(5.7, 1.0), -0.5, confirmations=[run(0.41, 0.0), run(0.39, 0.0)])
    assert _medians_said(two) == "median of 2 quiet trials: 0.410, 0.390 s; 1 timed under load left aside: 5.700 s"
    # all timed under load: the median of the two least disturbed (0.5 and 0.6 of a core taken)
    busy = TrialRecord(0, {}, "ok", run(5.0, 0.5), -0.5, confirmations=[run(6.0, 0.6), run(7.0, 1.0)])
    assert _medians_said(busy) == ("median of the 2 least disturbed of 3 trials, all timed under load: 5.000, "
                                   "6.000 s; left aside: 7.000 s") and busy.latency_s == 5.5
    assert _median_range(busy) == "5.000-6.000; 1 under load left aside"
    two = TrialRecord(0, {}, "ok", run(5.0, 0.5), -0.5, confirmations=[run(6.0, 0.6)])
    assert _medians_said(two) == "median of 2 trials: 5.000, 6.000 s" and _median_range(two) == "5.000-6.000"


def test_the_summary_marks_a_headroom_short_of_the_margin():
    # over the budget with its margin, the baseline showed a positive headroom and nothing else
    from rich.console import Console

    from autotune.console import print_summary
    from autotune.study import StudyOutcome, TrialRecord

    MiB = 2**20
    base = TrialRecord(0, {}, "ok", {"peak_memory_bytes": 524 * MiB, "latency_s": 1.0}, 1.0, baseline=True)
    out = Console(markup=False, record=True, width=200)
    print_summary(out, StudyOutcome(records=[base], stop_reason="done", baseline=base), 1024 * MiB, 512 * MiB)
    assert "500.00 MiB (< margin)" in out.export_text()
    # over the budget itself: said so, not "short of the margin"
    over = TrialRecord(1, {}, "ok", {"peak_memory_bytes": 1060 * MiB, "latency_s": 0.5}, 1.0)
    out = Console(markup=False, record=True, width=200)
    print_summary(out, StudyOutcome(records=[base, over], stop_reason="done", baseline=base, best=over), 1024 * MiB, 51 * MiB)
    assert "-36.00 MiB (over budget)" in out.export_text()


def test_the_summary_counts_a_trial_over_the_budget_and_below_the_guard_once():
    # "of those 1 over the budget, 1 below the quality guard" for one trial: the report's timeline
    # and the no-fit error count it as over the budget only
    from rich.console import Console

    from autotune.console import print_summary
    from autotune.study import StudyOutcome, TrialRecord

    MiB = 2**20
    base = TrialRecord(0, {}, "ok", {"peak_memory_bytes": 500 * MiB, "latency_s": 1.0}, 0.0, baseline=True)
    both = TrialRecord(1, {"dtype": "float16"}, "ok", {"peak_memory_bytes": 1200 * MiB, "latency_s": 0.5}, 1.0,
                       violations={"memory": 0.2, "quality": 3.0})
    low = TrialRecord(2, {"dtype": "bfloat16"}, "ok", {"peak_memory_bytes": 400 * MiB, "latency_s": 0.6}, 1.0,
                      violations={"memory": -0.6, "quality": 2.0})
    outcome = StudyOutcome(records=[base, both, low], stop_reason="done", baseline=base, best=base,
                           counts={"trials": 3, "by_status": {"ok": 3}})
    out = Console(markup=False, record=True, width=200)
    print_summary(out, outcome, 1000 * MiB, 0)
    assert "trials measured: 3 (ok 3; of those, 1 over the budget, 1 fit but fell below the quality guard)" \
        in out.export_text()


def test_the_summary_table_keeps_its_figures_whole_at_80_columns():
    # piped or logged, rich's console is 80 wide: the figures were cut to "laten…", "528.21 M…"
    from rich.console import Console

    from autotune.console import print_summary
    from autotune.study import StudyOutcome, TrialRecord

    MiB = 2**20
    base = TrialRecord(0, {}, "ok", {"peak_memory_bytes": 528 * MiB, "latency_s": 0.134, "p90_s": 0.135,
                                     "cold_start_s": 0.1}, -0.1, baseline=True)
    best = TrialRecord(1, {"dtype": "bfloat16"}, "ok", {"peak_memory_bytes": 514 * MiB, "latency_s": 0.115,
                                                         "p90_s": 0.116, "cold_start_s": 0.1}, -0.1)
    out = Console(markup=False, record=True, width=80)
    print_summary(out, StudyOutcome(records=[base, best], stop_reason="done", baseline=base, best=best), 545 * MiB, 27 * MiB)
    text = out.export_text()
    assert "…" not in text and "latency" in text and "528.00 MiB" in text and "17.00 MiB (<" in text


def test_no_fit_says_when_the_quality_guard_is_what_ruled_out_the_configs_that_fit(tmp_path, capsys):
    from autotune import cli as cli_module
    from autotune.console import terminal
    from autotune.study import StudyOutcome, TrialRecord

    over = TrialRecord(0, {}, "ok", {"peak_memory_bytes": 900 * 2**20, "latency_s": 1.0}, 0.5,
                       violations={"memory": 0.5, "quality": -1})
    noisy = TrialRecord(1, {"dtype": "bfloat16"}, "ok", {"peak_memory_bytes": 400 * 2**20, "latency_s": 0.5}, 0.2,
                        violations={"memory": -0.2, "quality": 0.2})
    outcome = StudyOutcome(records=[over, noisy], stop_reason="done", quality_guard={"min_psnr_db": 41.5})
    request = type("Request", (), {"budget_bytes": 600 * 2**20, "margin_bytes": 0, "margin": "0"})()
    code = cli_module._write_profile(terminal(), request, outcome, tmp_path / "p.yaml")
    err = capsys.readouterr().err
    assert code == cli_module.EXIT_NO_FIT
    # the smallest peak of a config that could be picked: 400 MiB fits, and was ruled out for its output
    assert "smallest peak memory of a config the quality guard passed was 900.00 MiB; 1 that fit in " \
           "memory fell below the quality guard's 41.5 dB (--min-psnr)" in err
    # a smaller config below the guard that does not fit either: still not the smallest named
    noisy.result["peak_memory_bytes"], noisy.violations["memory"] = 620 * 2**20, 0.03
    cli_module._write_profile(terminal(), request, outcome, tmp_path / "p.yaml")
    assert "the smallest peak memory of a config the quality guard passed was 900.00 MiB;" in capsys.readouterr().err


def test_a_ctrl_c_while_the_profile_is_written_says_how_to_resume(tmp_path, monkeypatch, capsys):
    # after the search, a Ctrl-C said only "autotune: interrupted". The search and the write are
    # stand-ins here: what is tested is the moment the signal lands, which a real run cannot aim at.
    from autotune import cli as cli_module
    from autotune import study
    from autotune.study import StudyOutcome, TrialRecord

    base = TrialRecord(0, {}, "ok", {"peak_memory_bytes": 2**20, "latency_s": 1.0}, -0.5, baseline=True)
    measured = StudyOutcome(records=[base], stop_reason="done", baseline=base, best=base,
                            counts={"trials": 1, "by_status": {"ok": 1}})
    monkeypatch.setattr(study, "tune", lambda request, **_: measured)

    def ctrl_c(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "_write_profile", ctrl_c)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    assert cli_module.main([*CHEAP, "--vram", "2GB"]) == cli_module.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "autotune: interrupted: the measured trials are kept in sqlite:///autotune-studies/studies.db" in err, err


def test_no_fit_says_when_configs_that_fit_failed_when_measured_again(tmp_path, capsys):
    # both fit, both confirmations timed out: "the smallest peak memory measured was 1.00 GiB plus
    # the margin", a peak that fits, and the summary's "(ok 2)" said nothing of why
    from rich.console import Console

    from autotune import cli as cli_module
    from autotune.console import print_summary, terminal
    from autotune.study import BROKEN, StudyOutcome, TrialRecord

    timed_out = [{"status": "timeout", "violation": BROKEN}]
    records = [TrialRecord(n, {"dtype": d}, "ok", {"peak_memory_bytes": 2**30, "latency_s": 1.0}, BROKEN,
                           violations={"memory": -0.5, "failed_again": BROKEN}, confirmations=timed_out)
               for n, d in enumerate(("float32", "bfloat16"))]
    outcome = StudyOutcome(records=records, stop_reason="done", counts={"trials": 2, "by_status": {"ok": 2}})
    request = type("Request", (), {"budget_bytes": 2 * 2**30, "margin_bytes": 0, "margin": "0"})()
    assert cli_module._write_profile(terminal(), request, outcome, tmp_path / "p.yaml") == cli_module.EXIT_NO_FIT
    assert ("no configuration can be picked within 2.00 GiB: all that ran fit it, but 2 that fit in memory failed "
            "when measured again (a crash or a timeout in the confirmation phase); no profile written"
            ) in capsys.readouterr().err
    out = Console(markup=False, record=True, width=200)
    print_summary(out, outcome, 2 * 2**30, 0)
    assert "trials measured: 2 (ok 2; of those, 2 fit but failed when measured again)" in out.export_text()


@pytest.mark.slow
def test_a_second_stop_signal_during_the_clean_up_changes_nothing(tmp_path):
    """`timeout` signals the process and then its group; a user presses Ctrl-C twice: the second
    signal, arriving while the first one's clean-up kills the trial, once cut that short (a
    traceback and exit 1) or came after the exit message ("Exception ignored in atexit")."""
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    args = ["--model", "tiny-sd15", "--vram", "8GB", "--space", "small.yaml", "--trials", "2", "--confirm", "0",
            "--min-psnr", "0", "--repeats", "3", "--height", "64", "--width", "64", "--steps", "1",
            "--max-calls", "20", "--spread", "0.0001"]
    proc = subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=tmp_path,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_second_measured_trial(tmp_path)
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):  # back to back: during the clean-up
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "run the same command to resume" in err


# ---- --gpus ----------------------------------------------------------------------------------------------
# Two GPUs faked for `autotune --gpus 0,1` (the parent, its workers and their trials read it):
# the GPU checks pass, and every trial runs on the CPU. A mock because these machines have no
# NVIDIA driver: it lets the workers' process handling (signals, exits, one study) run for real;
# tests/gpu/test_gpu_workers.py runs --gpus on a real GPU.
FAKE_GPUS = """
import os
if os.environ.get("AUTOTUNE_FAKE_GPUS"):
    import autotune.cli as cli
    import autotune.fingerprint as fp

    real_machine = fp.machine
    fp.cuda_device_count = lambda: 2
    fp.visible_gpus = lambda: None
    fp.machine = lambda device: real_machine("cpu")
    fp.capability = lambda device: None
    cli._resolve_device = lambda name: "cpu"
"""


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c", "hangup", "sigkill"])
def test_a_signal_stops_every_gpu_worker_and_keeps_their_trials(tmp_path, stop):
    """SIGTERM reaches the parent alone: it must stop its workers. Ctrl-C in a terminal reaches
    the parent's whole process group: each worker must still get one SIGINT, not two (a second
    could break its own clean-up). A SIGKILLed parent can tell no one: the workers must notice."""
    (tmp_path / "fakegpu").mkdir()
    (tmp_path / "fakegpu" / "sitecustomize.py").write_text(FAKE_GPUS)
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    env = dict(os.environ, PYTHONUNBUFFERED="1", AUTOTUNE_FAKE_GPUS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "fakegpu"), os.environ.get("PYTHONPATH")])))
    args = ["--model", "tiny-sd15", "--vram", "8GB", "--space", "small.yaml", "--trials", "8", "--confirm", "0",
            "--min-psnr", "0", "--repeats", "3", "--max-calls", "20", "--spread", "0.0001",
            "--height", "64", "--width", "64", "--steps", "1", "--gpus", "0,1"]
    # its own process group, as a shell gives a foreground job; SIGINT at its default there
    proc = subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for_second_measured_trial(tmp_path)
        assert proc.poll() is None
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif stop == "hangup":  # the terminal closed: its foreground group hears SIGHUP
            os.killpg(proc.pid, signal.SIGHUP)
        elif stop == "sigkill":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        out, _ = proc.communicate(timeout=120)
        if stop == "sigkill":
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == 130, out
            assert "run the same command to resume" in out and "Traceback" not in out
            # each worker stopped as an interrupted run does; the old parent let them finish the study
            assert out.count("ended (exit 130)") == 2, out
        # a worker's fork server started just before the signal exits once it has imported torch
        # and diffusers (it reads its client's exit only then): seconds on a loaded machine
        assert not processes_left_in(tmp_path, wait_s=60)  # workers, their fork servers and trials
        logs = list(tmp_path.glob("autotune-studies/trials/*/workers/gpu*.log"))
        assert len(logs) == 2
        for log in logs:  # each worker stopped as an interrupted run does
            text = log.read_text()
            assert "Traceback" not in text and "autotune: interrupted" in text, text
        states = [t.state for t in all_trials(tmp_path)]
        assert optuna.trial.TrialState.RUNNING not in states
        assert optuna.trial.TrialState.WAITING in states  # an interrupted trial, queued again
    finally:
        for left in processes_left_in(tmp_path, wait_s=0):  # what this test started, if it failed
            left.kill()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
def test_gpu_workers_that_finish_leave_one_study_and_the_parent_writes_its_profile(tmp_path):
    """The end of a --gpus run that is not stopped: each worker ends (exit 0), and the parent
    reads the shared study and writes its profile. Only interrupted runs were tested (helper 71).
    The study's name starts with '-', which the workers' command lines took for an option
    (helper-1). The GPUs are played by the CPU (FAKE_GPUS: these machines have no NVIDIA driver)."""
    (tmp_path / "fakegpu").mkdir()
    (tmp_path / "fakegpu" / "sitecustomize.py").write_text(FAKE_GPUS)
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    env = dict(os.environ, PYTHONUNBUFFERED="1", AUTOTUNE_FAKE_GPUS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "fakegpu"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "autotune", *CHEAP, "--vram", "8GB", "--trials", "3", "--gpus", "0,1",
                           "--study-name=-shared"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("ended (exit 0)") == 2 and "Traceback" not in out, out
    assert "profile written: tiny-sd15-8GB.yaml" in out, out
    profile = yaml.safe_load((tmp_path / "tiny-sd15-8GB.yaml").read_text())
    (summary,) = optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'autotune-studies' / 'studies.db'}")
    assert profile["study"]["name"] == summary.study_name == "-shared"  # the workers shared one study
    measured = [t for t in all_trials(tmp_path) if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(measured) >= 3 and profile["best"]["trial"] in {t.number for t in measured}
    assert not processes_left_in(tmp_path, wait_s=60)


def test_a_model_alias_not_in_the_cache_fails_before_any_trial(cli, tmp_path, monkeypatch):
    """`--model sdxl` resolves without looking at the cache (--list-knobs needs only the family);
    a study must say at once that the weights are missing, not after its first call fails."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    proc = cli("--model", "sdxl", "--vram", "8GB", "--min-psnr", "0")
    line = one_line_error(proc)
    assert "is not in the local Hugging Face cache" in line and "--model sdxl --random-weights" in line
    assert "--min-psnr 0" not in line  # the old hint, wrong with the guard already off
    assert not (tmp_path / "autotune-studies" / "trials").exists()  # no trial started
    assert cli("--model", "sdxl", "--list-knobs").returncode == 0  # the space needs no weights


def test_a_warning_reaches_the_user_as_one_line():
    # e.g. a --warm-start profile from another machine: not Python's file:line and source line
    code = "from autotune import cli; cli._quiet_libraries(); import warnings; warnings.warn('profiled elsewhere')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stderr == "autotune: warning: profiled elsewhere\n"
    # a library's source compiled at its first import (installed without bytecode: the GPU
    # machine's pip --no-compile) warned as autotune: "autotune: warning: invalid escape sequence"
    code = ("from autotune import cli; cli._quiet_libraries(); import logging; "
            "compile(\"x = '\\\\.'\", 'torchao_like.py', 'exec'); logging.getLogger('xformers').warning('WARNING[XFORMERS]')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stderr == ""


@pytest.mark.parametrize("command", ["show", "verify", "export", "report"])
def test_each_command_says_what_it_does_in_its_help(command):
    # show and verify had a usage line and nothing else
    proc = run_cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    paragraphs = proc.stdout.split("\n\n")
    assert len(paragraphs) > 2 and not paragraphs[1].lstrip().startswith(("positional", "options")), proc.stdout


def test_gpus_of_different_models_are_refused(monkeypatch):
    # NVML faked at autotune's fingerprint (no NVIDIA driver on these machines): two GPUs, two models
    from autotune import cli as cli_module, fingerprint
    from autotune.errors import AutotuneError

    monkeypatch.setattr(fingerprint, "cuda_device_count", lambda: 2)
    names = {"cuda:0": "NVIDIA H100 80GB HBM3", "cuda:1": "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(fingerprint, "machine", lambda device: {"device": device, "name": names[device]})
    with pytest.raises(AutotuneError, match=r"--gpus: the GPUs are of different models \(0: NVIDIA H100 80GB HBM3, "
                                            r"1: NVIDIA A100-SXM4-80GB\); a study measures one model"):
        cli_module._check_gpus([0, 1])
    names["cuda:1"] = names["cuda:0"]
    cli_module._check_gpus([0, 1])  # one model: accepted
    with pytest.raises(AutotuneError, match=r"--gpus: no GPU 2 \(GPUs usable here: 2\)"):
        cli_module._check_gpus([0, 2])


def test_a_profile_that_cannot_be_written_after_the_search_keeps_the_trials_and_says_how_to_export(tmp_path):
    # the output's folder checked before the search, then replaced by a file while it runs
    (tmp_path / "small.yaml").write_text(SMALL_SPACE)
    (tmp_path / "out").mkdir()
    proc = start_cli(tmp_path, *CHEAP, "--trials", "2", "--max-calls", "20", "--spread", "0.0001",
                     "--study-name", "kept", "-o", "out/p.yaml", stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("autotune-studies/trials/kept/trial-*/request.json")):
            assert time.monotonic() < deadline and proc.poll() is None, "no trial started"
            time.sleep(0.05)
        (tmp_path / "out").rmdir()
        (tmp_path / "out").write_text("")
        out, err = proc.communicate(timeout=300)
    finally:  # a failed wait leaves no run behind (SIGTERM: it stops its trial and fork server)
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("autotune: error: profile out/p.yaml: cannot write in out (a file is in the way); "), lines[0]
    assert lines[0].endswith("the measured trials are kept: autotune export --study-name kept --storage "
                             "sqlite:///autotune-studies/studies.db -o OTHER.yaml"), lines[0]
    assert len(optuna.load_study(study_name="kept", storage=f"sqlite:///{tmp_path}/autotune-studies/studies.db")
               .get_trials(states=(optuna.trial.TrialState.COMPLETE,))) >= 2


# A Ctrl-C that lands while autotune imports, made deterministic: a real SIGINT sent to the
# process at the moment it imports the named module (fault injection through sitecustomize).
SIGINT_ON_IMPORT = """
import builtins, os, signal
_import = builtins.__import__
def _interrupting(name, *args, **kwargs):
    if name == os.environ["AUTOTUNE_TEST_SIGINT_ON"]:
        os.environ["AUTOTUNE_TEST_SIGINT_ON"] = "(sent)"
        os.kill(os.getpid(), signal.SIGINT)
    return _import(name, *args, **kwargs)
builtins.__import__ = _interrupting
"""


@pytest.mark.parametrize("module", ["storages", "optuna"], ids=["importing-the-cli", "importing-optuna"])
def test_a_ctrl_c_while_autotune_imports_is_one_line(tmp_path, module):
    # the signal handler and the try that reports "interrupted" came after the first imports
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SIGINT_ON_IMPORT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]),
               AUTOTUNE_TEST_SIGINT_ON=module)
    proc = subprocess.run([sys.executable, "-m", "autotune", "--model", "tiny-sd15", "--trials", "1"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stderr) == (130, "autotune: interrupted\n"), proc.stderr
    assert not (tmp_path / "autotune-studies").exists()


def test_a_write_error_of_another_file_than_stdout_is_not_taken_for_stdouts():
    """main says a full stdout in one line; the same error from another file (a trial's socket,
    a full disk under the workdir) keeps its traceback, not a word about the output (helper-14).
    A real process whose stdout is a pipe that takes writes: the error is raised by hand."""
    code = ("import errno, sys\n"
            "from autotune import cli\n"
            "def full(argv):\n"
            "    raise OSError(errno.ENOSPC, 'No space left on device', '/elsewhere/trial.json')\n"
            "cli._export = full\n"
            "sys.exit(cli.main(['export']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "/elsewhere/trial.json" in proc.stderr
    assert "cannot write the output" not in proc.stderr
