"""torchao quantization of the denoiser's linear layers."""

from __future__ import annotations

from .base import Knob, denoiser, package_missing


def _torchao_config(value):
    # Imported here: torchao is heavy to import and changes global inductor settings on use
    # (set_inductor_config), which is fine in a trial's own process and in production.
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

    return {"int8wo": Int8WeightOnlyConfig, "int8dq": Int8DynamicActivationInt8WeightConfig}[value]()


def _apply_quantize(pipe, value, target):
    if value == "none":
        return
    from torchao.quantization import quantize_

    quantize_(denoiser(pipe), _torchao_config(value))


def _quantize_unavailable(value, target):
    if value != "none":
        return package_missing("torchao")
    return None


QUANTIZE = Knob(
    name="quantize",
    choices=("none", "int8wo", "int8dq"),
    default="none",
    help="torchao int8 quantization of the denoiser: weight-only, or dynamic activations too",
    apply=_apply_quantize,
    unavailable=_quantize_unavailable,
)
