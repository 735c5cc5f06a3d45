"""What one pipeline call does: the workload a profile is tuned for."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

DEFAULT_PROMPT = "a photograph of an astronaut riding a horse"


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
        """One call of `pipe` as trials time it: a fixed-seed generator, so every call makes the
        same image; numpy output, so the NaN check sees every value. Pipelines run under no_grad
        themselves."""
        import torch

        generator = torch.Generator("cpu").manual_seed(self.seed)
        return pipe(**self.pipeline_kwargs(), generator=generator, output_type="np")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Workload":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
