"""A tiny random-weight FLUX.2-klein for mflux 0.24.0, and LoRA files for it, built
offline in seconds (tests/test_images.py, benchmarks/images.py). Needs mflux.

The model is written by mflux's own ModelSaver (the ``mflux-save`` layout: vae/,
transformer/, text_encoder/, tokenizer/) with a ``mola_image.json`` giving its
sizes (mola/images/base.py reads it): a 1+1-block, 32-wide transformer, a
27-layer 32-wide Qwen3 text encoder (FLUX.2-klein reads its hidden states 9, 18
and 27) and a VAE of 32-channel blocks, with a ~300-token byte-level BPE
tokenizer trained here as Qwen2TokenizerFast. Its compute dtype is float32:
mflux keeps that in ModelConfig.precision, one per process, which
mola.images.base.load_mflux sets.

LoRA files come in the key styles mflux's FLUX.2 mapping reads: diffusers/PEFT
(``transformer.<path>.lora_A.weight``), kohya (``lora_unet_<path_>.lora_down.weight``)
and BFL (``diffusion_model.double_blocks.N.img_attn.qkv.lora_A.weight``, one
fused q/k/v pair); and the kinds images refuse (LoKr, DoRA, a .diff patch).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..images.base import SIDECAR, load_mflux, target_paths

TEXT_HIDDEN = 32
TINY_TEXT_ENCODER = dict(vocab_size=320, hidden_size=TEXT_HIDDEN, num_hidden_layers=27, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=1024)
TINY_TRANSFORMER = dict(
    in_channels=128,  # 32 latent channels x 2x2 patches
    num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16,
    axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
    joint_attention_dim=3 * TEXT_HIDDEN,  # three text-encoder layers stacked
    timestep_guidance_channels=32, mlp_ratio=3.0)
TINY_VAE = (32, 32, 32, 32)  # GroupNorm's 32 groups: multiples of 32
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SENTENCES = ["a photo of a cat", "a red fox in the snow", "a watercolor city at night", "user assistant system"]


def tiny_tokenizer():
    """A byte-level BPE of ~300 tokens trained on a few sentences, as Qwen2TokenizerFast."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    hf = transformers.Qwen2TokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                         unk_token=None, bos_token=None)
    hf.chat_template = CHAT_TEMPLATE
    assert len(hf) <= TINY_TEXT_ENCODER["vocab_size"]
    return hf


def build_tiny_image_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model's directory at ``out_dir`` (random weights from ``seed``)."""
    from mflux.models.common.config.model_config import ModelConfig
    from mflux.models.common.tokenizer import LanguageTokenizer
    from mflux.models.common.weights.saving.model_saver import ModelSaver
    from mflux.models.flux2.flux2_initializer import Flux2Initializer
    from mflux.models.flux2.variants.txt2img.flux2_klein import Flux2Klein
    from mflux.models.flux2.weights.flux2_weight_definition import (
        Flux2KleinWeightDefinition,
    )

    from ..images.base import model_config, vae_widths

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / SIDECAR).write_text(json.dumps({"transformer": TINY_TRANSFORMER, "text_encoder": TINY_TEXT_ENCODER,
                                           "vae_block_out_channels": list(TINY_VAE)}, indent=1))
    ModelConfig.precision = mx.float32
    mx.random.seed(seed)
    model = Flux2Klein.__new__(Flux2Klein)  # mflux's own parts, built without weights to load
    nn.Module.__init__(model)
    Flux2Initializer._init_config(model, model_config(str(out))[0])
    model.small_text_encoder = False
    with vae_widths(TINY_VAE):
        Flux2Initializer._init_models(model)
    bn = model.vae.bn  # batch-norm stats of 0 and 1 would leave the VAE's normalisation untested
    key = mx.random.key(seed + 1)
    bn.running_mean = 0.1 * mx.random.normal(bn.running_mean.shape, key=key)
    bn.running_var = 1.0 + 0.1 * mx.random.uniform(shape=bn.running_var.shape, key=mx.random.split(key)[0])
    mx.eval(model.parameters())
    model.tokenizers = {"qwen3": LanguageTokenizer(tiny_tokenizer())}
    model.bits = None
    ModelSaver.save_model(model=model, bits=None, base_path=str(out), weight_definition=Flux2KleinWeightDefinition)
    return out


def load_reference(model_dir: str | Path, loras: list[tuple[str, float]] = (), bake_lora: bool = True):
    """mflux's own Flux2Klein of the tiny model, with ``loras`` [(path, scale)] applied its way."""
    paths = [str(p) for p, _ in loras] or None
    scales = [s for _, s in loras] or None
    return load_mflux(str(model_dir), "float32", lora_paths=paths, lora_scales=scales, bake_lora=bake_lora)


def _shapes(transformer: nn.Module) -> dict[str, tuple[int, int]]:
    from mflux.models.flux2.weights.flux2_lora_mapping import Flux2LoRAMapping

    modules = dict(transformer.named_modules())
    return {p: modules[p].weight.shape for p in target_paths(transformer, Flux2LoRAMapping.get_mapping())}


def _factors(shape: tuple[int, int], rank: int, key: mx.array, strength: float) -> tuple[mx.array, mx.array]:
    out_dims, in_dims = shape
    k1, k2 = mx.random.split(key)
    down = mx.random.normal((rank, in_dims), key=k1) / in_dims**0.5  # [r, in]
    up = strength * mx.random.normal((out_dims, rank), key=k2) / rank**0.5  # [out, r]
    return down, up


def write_lora(out: str | Path, transformer: nn.Module, rank: int, seed: int, style: str = "diffusers",
               alpha: float | None = None, strength: float = 0.5) -> Path:
    """A random LoRA on every FLUX.2 target linear of ``transformer``, in key ``style``
    "diffusers" or "kohya"; ``alpha`` adds each module's alpha (mflux scales B by alpha / r)."""
    tensors = {}
    for i, (path, shape) in enumerate(sorted(_shapes(transformer).items())):
        down, up = _factors(shape, rank, mx.random.key(seed * 100003 + i), strength)
        if style == "diffusers":
            stem, names = f"transformer.{path}", ("lora_A.weight", "lora_B.weight")
        elif style == "kohya":
            stem, names = "lora_unet_" + path.replace(".", "_"), ("lora_down.weight", "lora_up.weight")
        else:
            raise ValueError(f"unknown LoRA key style {style!r}")
        tensors[f"{stem}.{names[0]}"], tensors[f"{stem}.{names[1]}"] = down, up
        if alpha is not None:
            tensors[f"{stem}.alpha"] = mx.array(alpha, dtype=mx.float32)
    mx.save_safetensors(str(out), tensors)
    return Path(out)


def write_bfl_qkv_lora(out: str | Path, transformer: nn.Module, rank: int, seed: int, strength: float = 0.5) -> Path:
    """A BFL-style LoRA on each double block's fused image q/k/v projection
    (``diffusion_model.double_blocks.N.img_attn.qkv``), which mflux splits onto to_q, to_k, to_v."""
    shapes = _shapes(transformer)
    tensors = {}
    for block in range(len(transformer.transformer_blocks)):
        out_dims, in_dims = shapes[f"transformer_blocks.{block}.attn.to_q"]
        down, up = _factors((3 * out_dims, in_dims), rank, mx.random.key(seed * 7919 + block), strength)
        stem = f"diffusion_model.double_blocks.{block}.img_attn.qkv"
        tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = down, up
    mx.save_safetensors(str(out), tensors)
    return Path(out)


def write_not_lora(out: str | Path, kind: str) -> Path:
    """A small file of an adapter kind images refuse: "lokr", "dora" or "diff"."""
    stem = "transformer.transformer_blocks.0.attn.to_q"
    w = mx.zeros((4, 4))
    tensors = {"lokr": {f"{stem}.lokr_w1": w, f"{stem}.lokr_w2": w},
               "dora": {f"{stem}.lora_A.weight": w, f"{stem}.lora_B.weight": w, f"{stem}.dora_scale": w},
               "diff": {f"{stem}.diff": w}}[kind]
    mx.save_safetensors(str(out), tensors)
    return Path(out)
