"""Tiny offline pipelines and generated tokenizers.

The tiny pipelines have the structure of the real ones (same pipeline, denoiser, VAE and text-encoder
classes, same conditioning paths) at a size that a 2-core CPU runs in a fraction of a second, so every
code path of the tuner runs without downloads. Weights are seeded random: every build is identical.

Tokenizers are generated, never downloaded: a CLIP BPE tokenizer without merges (every word splits
into byte-level characters) and a character-level T5 Unigram tokenizer. They are written once to a
cache directory and loaded through `from_pretrained`, like real ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

TOKENIZER_CACHE = Path(tempfile.gettempdir()) / "autotune-tokenizers"
T5_SPECIAL = ["<pad>", "</s>", "<unk>"]  # T5's ids 0, 1, 2
T5_CHARS = "▁" + "".join(chr(c) for c in range(33, 127))  # metaspace + printable ASCII


def _cached_files(name: str, files: dict[str, str]) -> Path:
    """A directory holding `files`, written once and atomically, then reused.

    Its name carries a hash of the contents, so a changed generator never picks up stale files.
    """
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]
    directory = TOKENIZER_CACHE / f"{name}-{digest}"
    if directory.is_dir():
        return directory
    TOKENIZER_CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=TOKENIZER_CACHE))
    for filename, text in files.items():
        (staging / filename).write_text(text, encoding="utf-8")
    staging.chmod(0o755)  # mkdtemp makes it private; other users of this /tmp may read it
    try:
        os.rename(staging, directory)  # atomic; fails if another process got there first
    except OSError:
        shutil.rmtree(staging)
    return directory


def clip_tokenizer():
    """A CLIP tokenizer with a byte-level vocabulary and no merges: 514 ids.

    <|endoftext|> gets the highest id: CLIP configs with eos_token_id 2 pool at argmax(input_ids).
    """
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(tokens)}
    directory = _cached_files(
        "clip",
        {
            "vocab.json": json.dumps(vocab, ensure_ascii=False),
            "merges.txt": "#version: 0.2\n",
            "tokenizer_config.json": json.dumps(
                {"tokenizer_class": "CLIPTokenizer", "model_max_length": 77}
            ),
        },
    )
    return CLIPTokenizer.from_pretrained(directory)


def t5_tokenizer():
    """A character-level T5 tokenizer: a Unigram model over printable ASCII, 98 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer

    vocab = [(token, 0.0) for token in T5_SPECIAL] + [(c, -1.0) for c in T5_CHARS]
    backend = Tokenizer(models.Unigram(vocab, unk_id=T5_SPECIAL.index("<unk>")))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    directory = _cached_files(
        "t5",
        {
            "tokenizer.json": backend.to_str(),
            "tokenizer_config.json": json.dumps(
                {
                    "tokenizer_class": "T5Tokenizer",
                    "model_max_length": 512,
                    "extra_ids": 0,  # no <extra_id_*> sentinels: they would grow the vocabulary
                    "eos_token": "</s>",
                    "unk_token": "<unk>",
                    "pad_token": "<pad>",
                }
            ),
        },
    )
    return AutoTokenizer.from_pretrained(directory)


# Sizes. The default tiny workload (256x256, 4 steps) takes roughly 0.3-0.5 s per call in float32 on a
# 2-core CPU (tiny-sdxl, whose UNet is wider, about 1.4 s), most of it in convolutions and attention
# rather than Python overhead. The VAEs have the
# real four levels (8x downsampling) and a sample_size of 128, so VAE tiling acts at 256x256.
TINY_RESOLUTION = 256
TINY_STEPS = 4
_CLIP = dict(hidden_size=32, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2)
_T5 = dict(d_model=64, d_kv=32, d_ff=128, num_heads=2, num_layers=2)
_VAE = dict(
    block_out_channels=(8, 16, 32, 32),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    norm_num_groups=4,
    sample_size=128,
)
_LATENT_SIZE = TINY_RESOLUTION // 8


def build(family: str):
    """A tiny pipeline of `family` ("sdxl", "sd15", "sd3", "flux") in float32 on the CPU, eval mode.

    The same weights on every call: the builder seeds its own random stream and leaves the global
    one as it was.
    """
    builders = {"sdxl": _sdxl, "sd15": _sd15, "sd3": _sd3, "flux": _flux}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe = builders[family]()
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()  # T5 dropout would make outputs random otherwise
    return pipe


def _clip(with_projection: bool, hidden_act: str):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        **_CLIP,
        projection_dim=_CLIP["hidden_size"],
        hidden_act=hidden_act,
        vocab_size=1000,  # above the generated tokenizer's 514 ids
        max_position_embeddings=77,
        # eos_token_id 2, as in the published SD configs: pooling takes argmax(input_ids), which is
        # <|endoftext|>, the generated vocabulary's highest id.
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
    )
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _t5():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        **_T5,
        vocab_size=128,  # above the generated tokenizer's ids
        feed_forward_proj="gated-gelu",  # T5 v1.1, as in SD3 and Flux
        dropout_rate=0.0,
    )
    return T5EncoderModel(config)


def _vae(**overrides):
    from diffusers import AutoencoderKL

    return AutoencoderKL(**{**_VAE, **overrides})


def _sdxl():
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    text_encoder = _clip(with_projection=False, hidden_act="quick_gelu")
    text_encoder_2 = _clip(with_projection=True, hidden_act="gelu")
    time_embed_dim = 8
    unet = UNet2DConditionModel(
        sample_size=_LATENT_SIZE,
        # Wide enough (70M parameters) that the UNet's matmuls and convolutions, not Python
        # overhead, set the time: bf16 + channels_last then runs it 1.76x faster than float32 on an
        # AMX CPU (194 vs 341 ms a forward), as at full size; at (32, 64, 128) bf16 was slower.
        block_out_channels=(96, 192, 384),
        layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(6, 12, 24),  # heads per level (diffusers' SDXL naming): head size 16
        transformer_layers_per_block=(1, 1, 2),
        use_linear_projection=True,
        norm_num_groups=8,
        # Both encoders' hidden states, concatenated; pooled projection of the second plus six time ids.
        cross_attention_dim=2 * _CLIP["hidden_size"],
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=6 * time_embed_dim + _CLIP["hidden_size"],
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    return StableDiffusionXLPipeline(
        vae=_vae(),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
    )


def _sd15():
    from diffusers import PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    unet = UNet2DConditionModel(
        sample_size=_LATENT_SIZE,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=2,  # heads (diffusers' SD naming); attention runs at full latent size, as in SD1.5
        norm_num_groups=8,
        cross_attention_dim=_CLIP["hidden_size"],
    )
    scheduler = PNDMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        skip_prk_steps=True,
        set_alpha_to_one=False,
    )
    return StableDiffusionPipeline(
        vae=_vae(),
        text_encoder=_clip(with_projection=False, hidden_act="quick_gelu"),
        tokenizer=clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    heads, head_dim = 4, 16
    transformer = SD3Transformer2DModel(
        sample_size=_LATENT_SIZE,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=4,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        caption_projection_dim=heads * head_dim,
        # The CLIP hidden states (2 x 32) are zero-padded to the T5 width and joined to the T5 tokens.
        joint_attention_dim=_T5["d_model"],
        pooled_projection_dim=2 * _CLIP["hidden_size"],
        pos_embed_max_size=_LATENT_SIZE,  # patches: up to 2x the default resolution
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                 scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=_clip(with_projection=True, hidden_act="quick_gelu"),
        tokenizer=clip_tokenizer(),
        text_encoder_2=_clip(with_projection=True, hidden_act="gelu"),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=_t5(),
        tokenizer_3=t5_tokenizer(),
    )


def _flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=2,
        num_single_layers=4,
        num_attention_heads=4,
        attention_head_dim=16,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        joint_attention_dim=_T5["d_model"],
        pooled_projection_dim=_CLIP["hidden_size"],  # CLIP's pooled output
        guidance_embeds=True,  # as FLUX.1-dev
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=_vae(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                 scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=_clip(with_projection=False, hidden_act="quick_gelu"),
        tokenizer=clip_tokenizer(),
        text_encoder_2=_t5(),
        tokenizer_2=t5_tokenizer(),
        transformer=transformer,
    )
