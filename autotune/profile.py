"""The profile file: what a study found, in a form production loads with one call.

    profile = autotune.load_profile("sdxl-8GB.yaml")
    pipe = profile.load_pipeline()      # build the model and apply the best configuration
    pipe = profile.load_pipeline(budget_bytes="6GB")  # the best measured point under 6 GiB
    profile.apply(pipe)                 # or apply it to a pipeline loaded already

Written atomically (a temporary file in the same folder, then a rename); read with a safe loader
and validated, so a missing, corrupt, truncated or foreign file is one clear ProfileError.
"""

from __future__ import annotations

import glob
import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from . import fingerprint
from .errors import AutotuneError, ProfileError, first_line, os_reason, read_yaml, warn_at_caller, why_unwritable
from .choice import pick
from .knobs import (APPLIED, BEFORE_BUILD, CATALOGUE, Config, Target, additions_found, apply_config, build_configured,
                    complete, conflict, lora_on_fused_projections, settings_found, unrunnable)
from .knobs.attention import replaces_processors
from .knobs.base import ProcessSettings, denoiser
from .knobs.precision import DTYPES
from .models import (FAMILIES, ModelSpec, check_weights_here, component_classes, denoiser_config, pipeline_class_here,
                     spec_problem)
from .sizes import MAX_SIZE, check_size, fits, format_size, parse_budget, parse_margin
from .workload import Workload, is_number

FORMAT_VERSION = 1
# Fingerprint keys whose difference makes the measured figures doubtful here.
MACHINE_KEYS = ("device", "name", "memory_bytes", "capability")
POINT_KEYS = ("config", "latency_s", "peak_memory_bytes")


# Out of memory, on the host or the device: passed through apply and load_pipeline as raised, for
# a serving process that catches them to load a smaller point (budget_bytes) or wait.
RESOURCE_ERRORS = (MemoryError, torch.OutOfMemoryError)


class ProfileMismatchWarning(UserWarning):
    """The machine or libraries differ from those the profile was measured on."""


def _point(record, budget_bytes: int) -> dict:
    r = record.result
    return {
        "trial": record.number,
        "config": record.config,
        # with confirmations: the median over the config's trials and the highest peak of any
        "latency_s": record.latency_s,
        "latencies_s": record.latencies_s if record.confirmations else None,
        # those of trials no busy neighbour slowed, whose spread `choose` judges noise by
        "quiet_latencies_s": record.quiet_latencies_s if record.confirmations else None,
        "p90_s": record.p90_s,  # with confirmations: the highest of its quiet trials' p90s
        "calls": r.get("calls"),
        "peak_memory_bytes": record.peak_memory_bytes,
        "headroom_bytes": budget_bytes - record.peak_memory_bytes,  # left under the budget
        "memory_source": r.get("memory_source"),
        "torch_peak_allocated_bytes": r.get("torch_peak_allocated_bytes"),
        "torch_peak_reserved_bytes": r.get("torch_peak_reserved_bytes"),
        "nvml_sampled_peak_bytes": r.get("nvml_sampled_peak_bytes"),  # on a GPU: what polling saw
        "host_peak_rss_bytes": r.get("host_peak_rss_bytes"),
        # with confirmations: medians over its quiet trials (TrialRecord.quiet_trials), as its latency
        "cold_start_s": record.across_trials("cold_start_s"),
        "per_step_s": record.latency_s * r["per_step_s"] / r["latency_s"] if r.get("per_step_s") else None,
        "spread": record.across_trials("spread"),
        "cut_short": r.get("cut_short"),  # timed from its warm-up: far slower than the best then
        "quality": r.get("quality"),  # PSNR / SSIM against the study's float32 reference
        "image": r.get("image"),
    }


def recorded_config(config) -> dict | None:
    """A model config as a profile records and compares it: through JSON (tuples as lists, as in
    a file), without diffusers' bookkeeping keys (_class_name, _diffusers_version, _name_or_path)."""
    if not config:
        return None
    return {k: v for k, v in json.loads(json.dumps(dict(config), default=str)).items() if not k.startswith("_")}


def build(req, outcome, storage_label: str) -> dict:
    """The profile document for a finished study (`study.TuneRequest`, `study.StudyOutcome`).
    The machine is the one the study recorded (an export may run elsewhere), else this one."""
    budget = req.budget_bytes
    best = _point(outcome.best, budget)
    best["speedup_vs_baseline"] = (
        outcome.baseline.latency_s / outcome.best.latency_s
        if outcome.baseline and outcome.baseline.latency_s
        else None
    )
    return {
        "autotune_profile": FORMAT_VERSION,
        "model": req.spec.to_dict(),
        # a pretrained denoiser's architecture as measured: serving compares a pipeline, or the
        # model's files then, with it (a folder replaced since by another model of the same
        # class). Tiny and random-weight models are built from autotune's own configs: none kept,
        # and no tiny pipeline built in the parent to read one.
        "denoiser_config": recorded_config(denoiser_config(req.spec)) if req.spec.kind == "pretrained" else None,
        # its components' classes as measured, for the same reason (a tiny VAE put in the folder since)
        "component_classes": component_classes(req.spec) if req.spec.kind == "pretrained" else None,
        "workload": req.workload.to_dict(),
        "budget": {"memory_bytes": budget, "margin": req.margin, "margin_bytes": req.margin_bytes},
        "measurement": {
            "threads": req.threads,
            "warmup_calls_min": req.warmup,
            "timed_calls_min": req.repeats,
            "timed_calls_max": req.max_calls,
            "spread_limit": req.spread_limit,
        },
        "quality_guard": outcome.quality_guard,  # reference and PSNR threshold, None when off
        "machine": req.machine or fingerprint.machine(req.target.device),
        # what the pick was measured with (a study resumed after an upgrade holds trials of
        # both); the software of this export for a trial measured before trials recorded it
        "software": outcome.best.result.get("software") or fingerprint.software(),
        "best": best,
        "baseline": _point(outcome.baseline, budget) if outcome.baseline and outcome.baseline.latency_s else None,
        "pareto": [_point(r, budget) for r in outcome.front],
        "study": {
            "name": req.study_name,
            "storage": storage_label,
            **{k: v for k, v in outcome.counts.items()},
            "stop_reason": outcome.stop_reason,
            "choice": outcome.choice_note,  # why a simpler config was kept over a lower median
        },
    }


def _new_file_mode() -> int:
    """The mode open() would give a new file: 0o666 less the umask. Read from /proc where it can
    be (os.umask can only be read by setting it, which races with other threads' files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _file_to_write(path: Path) -> Path:
    """Where a profile named `path` is written: the target of a symlink (the rename that makes the
    write atomic would replace the link: a deployment's "current" link would stop pointing at its
    versioned file). Never a folder, nor a device, FIFO or socket (renamed over, /dev/null became
    a regular file for every process of a machine where autotune ran as root). Messages name
    `path` as given."""
    if path.is_dir():  # these follow links, /dev/stdout's to a pipe included
        raise ProfileError(f"profile {path}: is a folder; name a file, such as {path / 'profile.yaml'}")
    if path.exists() and not path.is_file():
        raise ProfileError(f"profile {path}: is not a regular file (a device, FIFO or socket); name a file")
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check_writable(path: str | Path) -> Path:
    """ProfileError unless `save` could write `path` (its missing folders are made)."""
    path = Path(path)
    target = _file_to_write(path)
    reason = why_unwritable(target.parent)
    if reason:
        raise ProfileError(f"profile {path}: cannot write in {target.parent} ({reason})")
    return path


class _Dumper(yaml.SafeDumper):
    """The safe dumper, without anchors and aliases (&id001 ... *id001): profiles are read and
    diffed by people, and `build` shares a config between the best and its front point."""

    def ignore_aliases(self, data) -> bool:
        return True


def save(document: dict, path: str | Path) -> Path:
    """Write atomically: readers see the old file or the new one, never half of one. The file gets
    the mode an overwritten profile had, else the one open() would give: a serving process running
    as another user must be able to read it (mkstemp alone leaves 0600)."""
    path = Path(path)
    target = _file_to_write(path)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        mode = _new_file_mode()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(target)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    except OSError as exc:
        raise ProfileError(f"profile {path}: cannot write in {target.parent} ({os_reason(exc)})") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            yaml.dump(document, f, Dumper=_Dumper, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ProfileError(f"profile {path}: cannot write it ({os_reason(exc)})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


STALE_TEMPORARY_S = 3600  # a write takes well under a second: a temporary this old lost its writer


def _remove_stale_temporaries(target: Path) -> None:
    """The temporaries of writes killed between mkstemp and the rename (a SIGKILL cannot be
    cleaned up after): save's own name pattern, and old enough that no writer is still on it,
    on this machine or another sharing the folder."""
    now = time.time()
    for tmp in target.parent.glob(glob.escape(target.name) + ".????????.tmp"):
        try:
            if now - tmp.lstat().st_mtime > STALE_TEMPORARY_S:
                tmp.unlink()
        except OSError:
            pass  # gone meanwhile, or not ours to remove


@dataclass
class Profile:
    data: dict
    path: Path | None = None

    def __repr__(self) -> str:
        # One line: the dataclass repr printed the whole document. "?" where a Profile made
        # from a partial document lacks a field, rather than an error from repr.
        d = self.data
        best = (d.get("best") or {}).get("latency_s")
        latency = f"{best:.3f} s" if is_number(best) else "?"
        model = (d.get("model") or {}).get("name", "?")
        device = (d.get("machine") or {}).get("device", "?")
        budget = (d.get("budget") or {}).get("memory_bytes")
        budget = format_size(budget) if is_number(budget) else "?"
        return f"<Profile {model}, budget {budget}, {device}, best {latency}, {self.path or 'no file'}>"

    # ---- what it says -------------------------------------------------------------------------
    @property
    def model(self) -> ModelSpec:
        return ModelSpec.from_dict(self.data["model"])

    @property
    def workload(self) -> Workload:
        return Workload.from_dict(self.data["workload"])

    @property
    def budget_bytes(self) -> int:
        return self.data["budget"]["memory_bytes"]

    @property
    def margin(self) -> str:
        return str(self.data["budget"].get("margin", "0"))

    @property
    def threads(self) -> int | None:
        """CPU threads the figures were measured with (load_pipeline and apply set them, served on
        the kind of device measured: _set_measured_threads)."""
        return (self.data.get("measurement") or {}).get("threads")

    def measured_with(self) -> dict:
        """How the figures were measured, as `worker.trial_request` arguments (warmup, repeats,
        max_calls, spread_limit), for `autotune verify` to replay them so: what the profile records,
        the rest (null, or a profile without the section) left to trial_request's defaults."""
        measured = self.data.get("measurement") or {}
        arguments = {"warmup_calls_min": "warmup", "timed_calls_min": "repeats",
                     "timed_calls_max": "max_calls", "spread_limit": "spread_limit"}
        return {arg: measured[key] for key, arg in arguments.items() if measured.get(key) is not None}

    @property
    def best(self) -> dict:
        return self.data["best"]

    @property
    def pareto(self) -> list[dict]:
        return self.data["pareto"]

    @property
    def config(self) -> Config:
        return complete(self.best["config"])

    def _budget(self, budget_bytes: int | str | None) -> int:
        """A budget in bytes, from bytes or a size as the CLI takes it ("6GB", "7.5GiB"); the
        profile's own for None. ProfileError for anything that is not a positive size."""
        if budget_bytes is None:
            return self.budget_bytes
        if isinstance(budget_bytes, str):
            try:
                return parse_budget(budget_bytes)  # as --vram reads it: "6" is no budget
            except ValueError as exc:
                raise ProfileError(f"budget_bytes: {exc}") from None
        if not is_number(budget_bytes) or budget_bytes < 1:
            raise ProfileError(f"budget_bytes must be a positive number of bytes or a size such as "
                               f"'6GB', not {budget_bytes!r:.40}")
        try:
            check_size(budget_bytes, "budget_bytes")
        except ValueError as exc:
            raise ProfileError(str(exc)) from None
        return int(budget_bytes)

    def margin_bytes(self, budget_bytes: int | str | None = None) -> int:
        """The profile's safety margin under `budget_bytes` (bytes, or a size such as "6GB"; by
        default the profile's own budget)."""
        return parse_margin(self.margin, self._budget(budget_bytes))

    def fits(self, peak_bytes: int, budget_bytes: int | str | None = None) -> bool:
        """Whether a peak plus the profile's safety margin is within `budget_bytes` (bytes, or a
        size such as "6GB"; by default the profile's own budget): the rule the study judged its
        trials by."""
        if not is_number(peak_bytes) or peak_bytes < 0:  # else "x" is a TypeError and -1 fits
            raise ProfileError(f"peak_bytes must be a number of bytes, 0 or more, not {peak_bytes!r:.40}")
        return fits(peak_bytes, self.margin, self._budget(budget_bytes))

    def choose(self, budget_bytes: int | str | None = None) -> dict:
        """The profile's best when its peak plus the profile's safety margin fits `budget_bytes`
        (bytes, or a size such as "6GB"; or none is given): the study's pick, which may be a
        simpler config than a front point with a lower median that its trials did not back
        (study.choose_best). Else the best front point that fits (`_pick_for_budget`);
        ProfileError when none does, or when the budget is not a positive size. The point as
        recorded: its headroom_bytes is what it left under the profile's own budget."""
        if budget_bytes is None:
            return self.best
        budget_bytes = self._budget(budget_bytes)
        if self.fits(self.best["peak_memory_bytes"], budget_bytes):
            return self.best
        fitting = [p for p in self.pareto if self.fits(p["peak_memory_bytes"], budget_bytes)]
        if not fitting:
            smallest = min(p["peak_memory_bytes"] for p in self.pareto)
            raise ProfileError(
                f"no configuration in this profile fits {format_size(budget_bytes)} with a margin "
                f"of {self.margin} (the smallest measured peak is {format_size(smallest)})"
            )
        return _pick_for_budget(fitting)

    # ---- production ---------------------------------------------------------------------------
    def _target(self, device) -> Target:
        """Where to load: `device` ("cpu", "cuda", "cuda:N", a torch.device, or a GPU's index as torch
        takes it), or where the profile was measured when None."""
        measured = self.data["machine"]["device"]
        if device is None:
            device = measured
        elif type(device) is int and device >= 0:  # torch's shorthand for cuda:N (0 too, which is no "none")
            device = f"cuda:{device}"
        elif isinstance(device, torch.device):
            device = str(device)  # "cpu", "cuda", "cuda:1"
        problem = fingerprint.device_problem(device)  # else torch's own error, deep in .to() or after loading
        if problem == fingerprint.NO_CUDA:
            # whose choice the device was: the profile's, or the caller's (on a CPU profile too)
            if device == measured:
                on_cpu = unrunnable(self.best["config"], Target(device="cpu", family=self.model.family,
                                                                 workload=self.workload))
                hint = (f"its configuration cannot run on the CPU either ({'; '.join(on_cpu)})" if on_cpu
                        else "pass device='cpu' to load it anyway")
                raise ProfileError(f"this profile was measured on {device}, and {problem}; {hint}")
            raise ProfileError(f"device={device!r} was asked for (the profile was measured on {measured}), but "
                               f"{problem}; leave device out or pass device={measured!r}")
        if problem:
            raise ProfileError(f"device {device!r:.40}: {problem}")
        return Target(device=device, family=self.model.family, capability=fingerprint.capability(device),
                      workload=self.workload)

    def apply(self, pipe, device: str | None = None, budget_bytes: int | str | None = None):
        """Put a loaded pipeline into the measured state (the same code the trials ran). Load it
        on the CPU: the configuration moves it to the device at the point the trial did.
        `budget_bytes` (bytes, or a size such as "6GB") picks as `choose` does."""
        expected = self.model.pipeline_class
        if expected not in (cls.__name__ for cls in type(pipe).__mro__):
            raise ProfileError(f"this profile was measured on a {expected}; apply it to one, not to "
                               f"{type(pipe).__name__!r:.60}")
        config, target = complete(self.choose(budget_bytes)["config"]), self._target(device)
        self._check_runs(config, target)
        self._check_architecture(pipe)
        found = settings_found(pipe) if not getattr(pipe, APPLIED, None) else []  # autotune's own: said below
        if found:  # kept under the profile's, they would make another configuration than the one measured
            raise ProfileError(f"this pipeline holds settings of its own ({'; '.join(found)}): apply the profile to "
                               "a freshly loaded pipeline, or use profile.load_pipeline()")
        self._check_additions(pipe, config)
        loaded_in = denoiser(pipe).dtype  # read before the config casts it
        partly = "; the pipeline is left partly configured: load it again"
        marked_before = getattr(pipe, APPLIED, None)
        try:
            pipe = apply_config(pipe, config, target)
        except AutotuneError as exc:  # configured already, or a setting this machine cannot hold: this profile's error
            # marked by this call (apply_config marks a pipeline as it begins): stopped part-way
            raise ProfileError(f"{exc}{partly if getattr(pipe, APPLIED, None) and not marked_before else ''}") from None
        except (Warning, *RESOURCE_ERRORS):  # a warning raised as an error (-W error), memory: the caller's as they are
            raise
        except Exception as exc:  # diffusers' or torch's, on a pipeline unlike the measured one: said in one line
            raise ProfileError(f"applying the profile failed ({type(exc).__name__}: {first_line(exc)}){partly}") from exc
        for knob in BEFORE_BUILD:
            if config[knob.name] != knob.default:
                warn_at_caller(f"{knob.name}={config[knob.name]}: the trial held it before building the pipeline, so "
                               "the weights as loaded followed it; this pipeline was loaded before, so its peak "
                               "may exceed the measured one: use profile.load_pipeline()")
        measured_in = DTYPES[config["dtype"]]
        if loaded_in != measured_in:  # the same dtype once cast, but not the same load
            name = str(loaded_in).removeprefix("torch.")
            why = ("its load may have held more memory than the trial's" if loaded_in.itemsize > measured_in.itemsize
                   else "what its weights lost in the narrower dtype is not restored by the cast")
            warn_at_caller(f"this pipeline's denoiser was loaded in {name} and cast to {config['dtype']}: {why}; "
                           f"the trial loaded it in {config['dtype']}, as from_pretrained(..., torch_dtype=torch."
                           f"{config['dtype']}) does (dtype= in diffusers 0.42 and later), or profile.load_pipeline()")
        self._set_measured_threads(target)
        return pipe

    def _check_additions(self, pipe, config: dict) -> None:
        """What the user added to keep (LoRA, IP-Adapter, FreeU): refused where the configuration
        would undo it in silence, else a warning that the trials measured the pipeline without it."""
        if getattr(pipe, APPLIED, None):
            return  # configured already: apply_config refuses it, in its own words
        added = additions_found(pipe)
        on_qkv = lora_on_fused_projections(pipe)
        if on_qkv and config["fuse_qkv"]:
            raise ProfileError(f"this pipeline holds LoRA layers on the {', '.join(on_qkv)} q/k/v projections, which "
                               "the profile's fused QKV would drop: fuse the LoRA into the weights first (pipe.fuse_lora(), "
                               "then pipe.unload_lora_weights()), or pick a point without fuse_qkv (budget_bytes)")
        ip = [a for a in added if "IP-Adapter" in a]
        if ip and replaces_processors(config, self.model.family):
            raise ProfileError(f"this pipeline holds {'; '.join(ip)}, and the profile installs attention processors "
                               "of its own (fused QKV's or slicing's) in their place: pick a point that keeps "
                               "SDPA's (budget_bytes), or tune with those knobs held (a --space file)")
        if added:
            warn_at_caller(f"this pipeline holds {'; '.join(added)}: the profile's figures were measured without it",
                           ProfileMismatchWarning)

    def _check_architecture(self, pipe) -> None:
        """Warn where the pipeline's denoiser is of another architecture than the profiled model's
        (the class alone was checked: an SD1.5 pipeline of another size passed in silence), or a
        component of another class."""
        import torch

        # A component swapped for another class (a tiny VAE for SDXL's): other figures, and knobs
        # made for the measured one may fail on it part-way (fused QKV on a tiny VAE).
        for name, measured in self._measured_components().items():
            component = getattr(pipe, name, None)
            if isinstance(component, torch.nn.Module) and type(component).__name__ != measured:
                warn_at_caller(f"this pipeline's {name} is a {type(component).__name__}, where {self.model.name}'s is a "
                               f"{measured}: the profile's figures were measured with that one", ProfileMismatchWarning)
        differ = self._architecture_differences(denoiser(pipe).config)
        if differ:
            warn_at_caller(f"this pipeline's {type(denoiser(pipe)).__name__} is not {self.model.name}'s ({differ}): "
                           "the profile's figures were measured on another model", ProfileMismatchWarning)

    def _measured_components(self) -> dict[str, str]:
        """The class of each component as measured: the profile's record (profiles before
        2026-12-02 hold none, nor do tiny and random-weight models': then the model's files as they
        are here, which autotune's own models are built from)."""
        return self.data.get("component_classes") or component_classes(self.model) or {}

    def _architecture_differences(self, here) -> str:
        """How the denoiser config `here` differs from the one measured: the profile's record of it
        (profiles before 2026-11-25 hold none: then the model's files as they are here), in the
        settings both name (a config written by another diffusers version lacks newer keys)."""
        expected = self.data.get("denoiser_config") or denoiser_config(self.model)
        if not expected:
            return ""
        expected, here = (recorded_config(c) for c in (expected, here))
        differ = [k for k in sorted(expected) if k in here and here[k] != expected[k]]
        shown = "; ".join(f"{k} {here[k]!r:.40} here, {expected[k]!r:.40} profiled" for k in differ[:3])
        return shown + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")

    def load_pipeline(self, device: str | None = None, budget_bytes: int | str | None = None):
        """Build the profiled model and apply the chosen configuration, as the trial did;
        `budget_bytes` (bytes, or a size such as "6GB") picks it as `choose` does."""
        config, target = self.choose(budget_bytes)["config"], self._target(device)
        self._check_runs(config, target)  # before the build: a full-size model loads for minutes
        # before the process-wide settings (threads, glibc's mmap threshold, which nothing puts
        # back): a model folder that is gone changed them for a load that never happened
        check_weights_here(self.model)
        here = pipeline_class_here(self.model) if self.model.kind == "pretrained" else None
        if here and here != self.model.pipeline_class:
            raise ProfileError(f"{self.model.source} holds a {here} now, and this profile was measured on a "
                               f"{self.model.pipeline_class}: tune it again for this model")
        # a pretrained model's files as they are here: a folder replaced since the profile was measured
        now = denoiser_config(self.model) if self.data.get("denoiser_config") else None
        differ = self._architecture_differences(now) if now else ""
        if differ:
            warn_at_caller(f"{self.model.name}'s {self.model.denoiser} is not the one profiled ({differ}): the profile's "
                           "figures were measured on another model", ProfileMismatchWarning)
        recorded = self.data.get("component_classes")  # else apply's check reads the folder: nothing to compare
        now = (component_classes(self.model) or {}) if recorded else {}
        swapped = [f"{name} is {now[name]} now, {measured} when profiled" for name, measured in (recorded or {}).items()
                   if now.get(name, measured) != measured]
        if swapped:
            warn_at_caller(f"{self.model.name}: its {'; '.join(swapped)}: the profile's figures were measured with "
                           "the components as profiled", ProfileMismatchWarning)
        self._set_measured_threads(target)
        try:
            return build_configured(self.model, config, target)
        except (AutotuneError, Warning, *RESOURCE_ERRORS):  # one line already; the caller's as they are
            raise
        except Exception as exc:  # diffusers' or torch's, on a model unlike the measured one: said in one line, as apply says it
            raise ProfileError(f"loading the profiled pipeline failed ({type(exc).__name__}: {first_line(exc)})") from exc

    def _set_measured_threads(self, target: Target) -> None:
        """torch's CPU thread count as the trials had it, served on the kind of device measured:
        part of what was measured (tiny-sd15 took 609 ms a call with 1 thread and 4811 ms with 2,
        on 2 cores another process was using: a count above the free cores costs most), and
        inductor's CPU kernels keep the count they were compiled with. A GPU's trials set it too
        (--threads, else torch's default where they ran): the host's share of a call, and a CPU
        offload's. Capped at the cores usable here, with a warning."""
        measured_on = self.data["machine"]["device"].partition(":")[0]
        if target.device.partition(":")[0] != measured_on or not self.threads:
            return
        import torch

        threads = min(self.threads, fingerprint.usable_cores())
        if threads < self.threads:
            warn_at_caller(f"measured with {self.threads} CPU thread{'s' if self.threads != 1 else ''}; {threads}, the cores usable here, are used",
                           ProfileMismatchWarning)
        # process-wide too: a pipeline configured before with another count now runs with this one
        ProcessSettings.configured("torch's CPU thread count", threads)
        torch.set_num_threads(threads)

    def check_runs_on(self, device: str | None = None) -> None:
        """ProfileError where the best config cannot run on `device` here (as load_pipeline
        would refuse it): for `autotune verify`, before it starts a replay."""
        self._check_runs(self.config, self._target(device))

    def _check_runs(self, config: dict, target: Target) -> None:
        """ProfileError naming each choice that cannot run here, with its reason, or the rule the
        combination breaks: else the first one met fails inside diffusers, torchao or accelerate
        with a message that names none of them. A study measures no such combination; a file
        edited by hand, or measured before the rule was made, holds one (the profile still reads:
        show, report and --warm-start take it)."""
        why = conflict(complete(config), self.model.family)
        if why:
            raise ProfileError(f"this profile's configuration is a combination autotune rules out ({why}); "
                               "tune again, or pick another point with budget_bytes")
        reasons = unrunnable(config, target)
        if reasons:
            measured = self.data["machine"]
            raise ProfileError(f"this profile's configuration cannot run on {target.device} here (it was measured on "
                               f"{measured['device']}, {measured.get('name', 'unknown')}): {'; '.join(reasons)}")

    def mismatches(self) -> list[str]:
        """How this machine, its libraries and this autotune differ from what the profile was
        measured with: a line each."""
        machine = self.data["machine"]
        device = machine["device"]
        if _device_here(device):
            here = fingerprint.machine(device)
        else:  # "here 'cpu'" misled where GPUs there are, only not that one
            gpus = fingerprint.cuda_device_count()
            here = {"device": f"no {device} ({gpus} GPU{'s' if gpus != 1 else ''} visible)" if gpus else "cpu"}
        software, software_here = self.data["software"], fingerprint.software()
        return (fingerprint.differences(machine, here, MACHINE_KEYS)
                + fingerprint.differences(software, software_here, fingerprint.SOFTWARE_KEYS, absent="not installed")
                # autotune's own version too: a knob whose apply changed since makes another state
                # than the one measured (profiles of 2026-11-22 to 25 do not record it)
                + fingerprint.differences(software, software_here, ("autotune",), absent="not recorded")
                + self._knobs_not_named())

    def _knobs_not_named(self) -> list[str]:
        """autotune writes every knob of its catalogue into a profile: one it does not name was
        added since the profile was written (then its default is what was measured), or was taken
        out by hand (then the figures are another configuration's). Said, as it cannot be told."""
        named = self.best["config"]
        missing = [name for name in CATALOGUE if name not in named]
        if not missing:
            return []
        defaults = ", ".join(f"{name}={CATALOGUE[name].default}" for name in missing)
        return [f"best.config does not name every knob of this autotune; taken at their defaults: {defaults} "
                "(right for a profile written before they were added; one edited by hand was measured otherwise)"]


def _pick_for_budget(points: list[dict]) -> dict:
    """The pick among the front points that fit a budget below the study's pick, by the study's
    rule (choice.pick): the fastest, when its trials were not measured again (at a smaller budget
    it may never have been a contender of the study, and it stands on its one measurement, as
    any pick does without confirmation); else the simplest within noise among the points that
    were (a confirmed point has `latencies_s`)."""
    return pick(points, lambda p: p["latency_s"], lambda p: p.get("quiet_latencies_s") or p["latencies_s"],
                lambda p: p["config"], confirmed=lambda p: bool(p.get("latencies_s")))


def _device_here(device: str) -> bool:
    """Whether `device` (cpu, cuda, cuda:N) exists in this process: a cuda:1 profile read on a
    machine of one GPU raised NVML's own error from load_profile (helper-13)."""
    if not device.startswith("cuda"):
        return True
    return fingerprint.device_index(device) < fingerprint.cuda_device_count()


def load_profile(path: str | Path, check_fingerprint: bool = True) -> Profile:
    """Read and validate a profile; warn (ProfileMismatchWarning) when this machine or its
    library versions differ from those it was measured on."""
    if not isinstance(path, (str, os.PathLike)):  # load_profile(os.environ.get("PROFILE")), unset
        raise ProfileError(f"profile path must be a path (text or os.PathLike), not {path!r:.40}")
    if not str(path).strip():  # Path("") is the current folder: "profile .: Is a directory"
        raise ProfileError("profile path is empty: give the file autotune wrote")
    path = Path(path)
    data = read_yaml(path, "profile", ProfileError, hint=" (corrupt or truncated?)")  # autotune wrote it
    validate(data, path)
    profile = Profile(data, path)
    if check_fingerprint:
        for line in profile.mismatches():
            warn_at_caller(f"profile {path}: {line}", ProfileMismatchWarning)
    return profile


# Sections that must be mappings, and those that may be absent or null (written as None: the
# quality guard off, no baseline measured; a file cut just after "study:" loads with it null).
# "study" is written last, and "choice" last in it: a file cut short (a copy that broke off)
# lacks them, wherever it was cut, but in the last line.
REQUIRED_MAPPINGS = ("model", "workload", "budget", "machine", "software", "study")
LAST_KEY = ("study", "choice")
OPTIONAL_MAPPINGS = ("measurement", "quality_guard", "baseline", "denoiser_config", "component_classes")
# Point figures that are formatted as numbers where present (show, verify, report).
OPTIONAL_POINT_NUMBERS = ("p90_s", "cold_start_s", "headroom_bytes", "speedup_vs_baseline")


def _check_measurement(measured: dict, path) -> None:
    """How the figures were measured, which `autotune verify` replays: counts of 1 or more and a
    positive spread, or null (absent: the replay takes trial_request's defaults)."""
    for key in ("threads", "warmup_calls_min", "timed_calls_min", "timed_calls_max"):
        value = measured.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ProfileError(f"profile {path}: measurement.{key} must be a whole number, 1 or more, "
                               f"or null, not {value!r:.40}")
    spread = measured.get("spread_limit")
    if spread is not None and (not is_number(spread) or spread <= 0):
        raise ProfileError(f"profile {path}: measurement.spread_limit must be a positive fraction "
                           f"(0.05 for 5%) or null, not {spread!r:.40}")


def _newer_autotune(data: dict) -> str:
    """The hint for a config this autotune cannot read: where an autotune newer than this one wrote
    the profile, a knob it added is unknown here."""
    from packaging.version import InvalidVersion, Version

    from . import __version__

    wrote = (data.get("software") or {}).get("autotune") if isinstance(data.get("software"), dict) else None
    try:
        newer = wrote is not None and Version(str(wrote)) > Version(__version__)
    except InvalidVersion:
        return ""
    return f" (written by autotune {wrote}, newer than this {__version__}: upgrade autotune to load it)" if newer else ""


def _check_point(point, where: str, path, hint: str = "") -> None:
    if not isinstance(point, dict):
        raise ProfileError(f"profile {path}: {where} must be a mapping (a measured point), not {point!r:.40}")
    missing = [k for k in POINT_KEYS if k not in point]
    if missing:
        raise ProfileError(f"profile {path}: a measured point lacks {', '.join(missing)}")
    if not isinstance(point["config"], dict):
        raise ProfileError(f"profile {path}: {where}.config must be a mapping of knob: value")
    for key in ("latency_s", "peak_memory_bytes"):
        if not is_number(point[key]) or point[key] <= 0:  # measured: seconds and bytes above zero
            raise ProfileError(f"profile {path}: {where}.{key} must be a positive number, not {point[key]!r:.40}")
    trial = point.get("trial")  # the report matches points by it: a list there was a TypeError
    if trial is not None and (type(trial) is not int or trial < 0):
        raise ProfileError(f"profile {path}: {where}.trial must be a trial number (0 or more) or null, not {trial!r:.40}")
    for key in OPTIONAL_POINT_NUMBERS:
        if point.get(key) is not None and not is_number(point[key]):
            raise ProfileError(f"profile {path}: {where}.{key} must be a number or null, not {point[key]!r:.40}")
    for key in ("p90_s", "cold_start_s", "speedup_vs_baseline"):  # "-1.00x the baseline" in show
        if point.get(key) is not None and point[key] < 0:
            raise ProfileError(f"profile {path}: {where}.{key} must not be below 0, not {point[key]!r:.40}")
    # the report opens the image and reads the quality's figures: a list there was a traceback
    if point.get("image") is not None and not isinstance(point["image"], str):
        raise ProfileError(f"profile {path}: {where}.image must be a file name or null, not {point['image']!r:.40}")
    if point.get("quality") is not None and not isinstance(point["quality"], dict):
        raise ProfileError(f"profile {path}: {where}.quality must be a mapping (psnr_db, ...) or null, "
                           f"not {point['quality']!r:.40}")
    for key in ("latencies_s", "quiet_latencies_s"):  # a confirmed point's trial medians, read by `choose`
        latencies = point.get(key)
        if latencies is not None and not (isinstance(latencies, list) and latencies
                                          and all(is_number(v) for v in latencies)):
            raise ProfileError(f"profile {path}: {where}.{key} must be a list of numbers or null, "
                               f"not {latencies!r:.40}")
    try:
        complete(point["config"])
    except ValueError as exc:
        raise ProfileError(f"profile {path}: {where}.config: {exc}{hint}") from None


def validate(data, path) -> None:
    if not data:
        raise ProfileError(f"profile {path}: the file holds no data (empty, or comments only)")
    if not isinstance(data, dict) or "autotune_profile" not in data:
        raise ProfileError(f"profile {path}: not an autotune profile (no 'autotune_profile' key)")
    version = data["autotune_profile"]
    if type(version) is not int or version != FORMAT_VERSION:  # true and 1.0 equal 1 in Python
        raise ProfileError(
            f"profile {path}: format version {version!r:.40}, this autotune reads version {FORMAT_VERSION}"
        )
    for section in (*REQUIRED_MAPPINGS, "best", "pareto"):
        if section not in data:
            raise ProfileError(f"profile {path}: section '{section}' is missing (truncated file?)")
        if data[section] is None:  # a file cut just after "best:" reads so too
            raise ProfileError(f"profile {path}: section '{section}' is empty (null; truncated file?)")
    for section in REQUIRED_MAPPINGS:
        if not isinstance(data[section], dict):
            raise ProfileError(f"profile {path}: section '{section}' must be a mapping, not {data[section]!r:.40}")
    section, key = LAST_KEY
    if key not in data[section]:
        raise ProfileError(f"profile {path}: {section}.{key} is missing, the last key autotune writes: the file "
                           "was cut short, or written by an autotune older than 2026-11-23 (export it again)")
    for section in OPTIONAL_MAPPINGS:
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise ProfileError(
                f"profile {path}: section '{section}' must be a mapping or null, not {data[section]!r:.40}"
            )
    classes = data.get("component_classes") or {}
    odd = next((f"{k!r:.40}: {v!r:.40}" for k, v in classes.items() if not (isinstance(k, str) and isinstance(v, str))), None)
    if odd:
        raise ProfileError(f"profile {path}: component_classes maps a component's name to its class name "
                           f"(vae: AutoencoderKL), not {odd}")
    if not fingerprint.is_device_name(data["machine"].get("device")):
        raise ProfileError(f"profile {path}: machine.device must name a device (cpu, cuda, cuda:N), "
                           f"not {data['machine'].get('device')!r:.40}")
    memory = data["machine"].get("memory_bytes")  # a mismatch line shows it as a size: 10**400 overflowed there
    if memory is not None and (not is_number(memory) or memory <= 0 or memory > MAX_SIZE):
        raise ProfileError(f"profile {path}: machine.memory_bytes must be a positive number of bytes "
                           f"(2**63 - 1 at most) or null, not {memory!r:.40}")
    if not isinstance(data["pareto"], list) or not data["pareto"]:
        raise ProfileError(f"profile {path}: 'pareto' must be a non-empty list of measured points")
    budget = data["budget"]
    if not is_number(budget.get("memory_bytes")) or budget["memory_bytes"] <= 0:
        raise ProfileError(f"profile {path}: budget.memory_bytes must be a positive number of bytes")
    try:
        check_size(budget["memory_bytes"], "budget.memory_bytes")
    except ValueError as exc:
        raise ProfileError(f"profile {path}: {exc}") from None
    if budget.get("margin_bytes") is not None and not is_number(budget["margin_bytes"]):
        raise ProfileError(f"profile {path}: budget.margin_bytes must be a number or null")
    problem = spec_problem(data["model"])
    if problem:
        raise ProfileError(f"profile {path}: section 'model' is malformed: {problem}")
    hint = _newer_autotune(data)
    _check_point(data["best"], "best", path, hint)
    if data.get("baseline") is not None:
        _check_point(data["baseline"], "baseline", path, hint)
    for i, point in enumerate(data["pareto"]):
        _check_point(point, f"pareto[{i}]", path, hint)
    _check_measurement(data.get("measurement") or {}, path)
    for key in ("name", "storage"):  # read by reports to find the study's trials
        value = data["study"].get(key)
        if value is not None and not isinstance(value, str):
            raise ProfileError(f"profile {path}: study.{key} must be text or null, not {value!r:.40}")
    for key in ("trials", "complete", "infeasible", "failed"):  # counts, said by show ("many trials measured")
        value = data["study"].get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise ProfileError(f"profile {path}: study.{key} must be a count (0 or more) or null, not {value!r:.40}")
    try:
        workload = Workload.from_dict(data["workload"])
    except ValueError as exc:
        raise ProfileError(f"profile {path}: workload {exc}") from None
    try:  # the checks the CLI makes of --height and the rest, so that a replay can run it
        workload.check(FAMILIES[data["model"]["family"]].pixel_multiple)
    except ValueError as exc:
        raise ProfileError(f"profile {path}: workload.{exc}") from None
    try:
        margin = parse_margin(budget.get("margin", "0"), int(budget["memory_bytes"]))
    except ValueError as exc:
        raise ProfileError(f"profile {path}: budget.margin: {exc}") from None
    if margin >= budget["memory_bytes"]:  # the CLI refuses such a margin: nothing could fit
        raise ProfileError(f"profile {path}: budget.margin {budget['margin']} leaves nothing of the budget "
                           f"({format_size(int(budget['memory_bytes']))})")
    # margin_bytes is what the run wrote of its margin; the margin is what choose and fits read:
    # where they disagree one was edited (a margin removed, read as 0, beside 102 MiB written)
    if budget.get("margin_bytes") is not None and budget["margin_bytes"] != margin:
        raise ProfileError(f"profile {path}: budget.margin_bytes {budget['margin_bytes']} is not the margin "
                           f"{budget.get('margin', '0')} of the budget ({margin} bytes): one of them was edited")
    # autotune writes only points that fit: one that does not was edited (a best over its budget
    # loaded and was chosen for that budget without a word; helper-10)
    for where, point in [("best", data["best"]), *((f"pareto[{i}]", p) for i, p in enumerate(data["pareto"]))]:
        if not fits(point["peak_memory_bytes"], budget.get("margin", "0"), int(budget["memory_bytes"])):
            raise ProfileError(f"profile {path}: {where} peaks at {format_size(int(point['peak_memory_bytes']))}, "
                               f"over the budget of {format_size(int(budget['memory_bytes']))} less its margin of "
                               f"{format_size(margin)}: autotune writes only points that fit (edited by hand?)")
