"""What one pipeline call does: the workload a profile is tuned for."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

DEFAULT_PROMPT = "a photograph of an astronaut riding a horse"
REQUIRED = ("height", "width", "steps")
# What torch.Generator.manual_seed takes: a 64-bit int, signed or not (a negative one as unsigned).
SEEDS = range(-(2**63), 2**64)
MAX_STEPS = 10_000  # denoising steps of one call at most: schedulers train on 1000 timesteps
# Pixels a side at most: a 268-megapixel image, whose float32 decode alone is 3 GiB. A larger
# side is a typo (--height 80000000 ran its reference call until the host-memory guard stopped
# it) or a hand-edited profile, refused before anything is built.
MAX_SIDE = 16_384


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is an int to Python


def is_number(value) -> bool:
    """A real, finite number: not a bool (YAML's true is an int to Python), not text. (The
    profile's figures are checked with it too.)"""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past any float (10**400): no figure autotune writes, and formats fail on it
        return False


def initial_noise(pipe, batch_size: int, height: int, width: int, generator):
    """A call's starting latents as the pipeline's prepare_latents draws them (shape, Flux's
    packing), but drawn in float32 and then cast to the denoiser's dtype. Drawn by the pipeline,
    they came in its own dtype, and torch before 2.13 draws another sequence for bfloat16 or
    float16 than for float32 on the CPU (past 16 values): a half-precision config started from
    other noise than the float32 reference, and the quality guard compared unrelated images
    (bfloat16 at 13.5 dB on tiny-sdxl with torch 2.11, 49 dB with torch 2.13)."""
    import torch

    denoiser = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
    channels, scale = denoiser.config.in_channels, pipe.vae_scale_factor
    packed = hasattr(pipe, "_pack_latents")  # Flux: latents in 2x2 patches, packed into a sequence
    if packed:
        channels //= 4
        height, width = 2 * (height // (scale * 2)), 2 * (width // (scale * 2))
    else:
        height, width = height // scale, width // scale
    noise = torch.randn((batch_size, channels, height, width), generator=generator, dtype=torch.float32)
    if packed:
        noise = pipe._pack_latents(noise, batch_size, channels, height, width)
    # the dtype prepare_latents draws in (the prompt embeddings', which the denoiser takes), the
    # compute dtype under fp8 layerwise casting (diffusers' ModelMixin.dtype reads it from its hook)
    return noise.to(denoiser.dtype)


@dataclass(frozen=True)
class Workload:
    height: int
    width: int
    steps: int
    batch_size: int = 1
    prompt: str = DEFAULT_PROMPT
    seed: int = 0
    guidance_scale: float | None = None  # None: the pipeline's own default

    def pipeline_kwargs(self) -> dict:
        """Keyword arguments for `pipe(...)`: the same call in trials and in `autotune verify`."""
        kwargs = dict(
            prompt=self.prompt,
            height=self.height,
            width=self.width,
            num_inference_steps=self.steps,
            num_images_per_prompt=self.batch_size,
        )
        if self.guidance_scale is not None:
            kwargs["guidance_scale"] = self.guidance_scale
        return kwargs

    def call(self, pipe):
        """One call of `pipe` as trials time it: a fixed-seed generator and the starting noise
        drawn from it in float32 (initial_noise), so every call of every config starts from the
        same noise and makes the same image; numpy output, so the NaN check sees every value.
        Pipelines run under no_grad themselves."""
        import torch

        generator = torch.Generator("cpu").manual_seed(self.seed)
        latents = initial_noise(pipe, self.batch_size, self.height, self.width, generator)
        return pipe(**self.pipeline_kwargs(), generator=generator, latents=latents, output_type="np")

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self, pixel_multiple: int = 8) -> None:
        """ValueError, naming the field first ("height must be ..."), when no pipeline call could
        run this workload: caught here, not as a TypeError or ZeroDivisionError inside a trial.
        `pixel_multiple`: what the model family's height and width must be multiples of."""
        for name in ("height", "width"):
            value = getattr(self, name)
            if not _whole(value) or value <= 0 or value % pixel_multiple:
                raise ValueError(f"{name} must be a positive multiple of {pixel_multiple} pixels, not {value!r:.40}")
            if value > MAX_SIDE:
                raise ValueError(f"{name} must be {MAX_SIDE} pixels at most, not {value!r:.40}")
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if not _whole(value) or value < 1:
                raise ValueError(f"{name} must be a whole number, 1 or more, not {value!r:.40}")
        if self.steps > MAX_STEPS:  # 10**20 was taken, and every trial failed inside the scheduler
            raise ValueError(f"steps must be {MAX_STEPS} at most, not {self.steps!r:.40}")
        if not _whole(self.seed) or self.seed not in SEEDS:
            raise ValueError(f"seed must be a whole number from -2**63 to 2**64 - 1, not {self.seed!r:.40}")
        if not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be text, not {self.prompt!r:.40}")
        try:  # bytes a terminal could not decode reach Python as lone surrogates: the tokenizer's TypeError
            self.prompt.encode("utf-8")
        except UnicodeEncodeError:
            shown = self.prompt.encode("utf-8", "backslashreplace").decode()[:60]
            raise ValueError(f"prompt is not valid UTF-8 text: '{shown}'") from None
        scale = self.guidance_scale
        if scale is not None and not is_number(scale):
            raise ValueError(f"guidance_scale must be a number or null, not {scale!r:.40}")

    @classmethod
    def from_dict(cls, data: dict) -> "Workload":
        """The workload a mapping describes (unknown keys ignored); ValueError, in words that follow
        "workload", when it is no mapping or lacks a required field. Values are checked by `check`."""
        if not isinstance(data, dict):
            raise ValueError(f"must be a mapping of {', '.join(REQUIRED)} (batch_size, prompt, seed and "
                             f"guidance_scale optional), not {data!r:.40}")
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise ValueError(f"lacks {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
