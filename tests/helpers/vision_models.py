"""Tiny random vision-language models built offline, in mlx-vlm's own layout:
config.json, random safetensors, a BPE tokenizer trained here (with the
family's image tokens) and an image processor config written as JSON, so that
``mlx_vlm.load`` reads them as it reads a converted hub model."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mola.demo.tokenizer import train_tokenizer

QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL's chat template, cut to what the tests send: text parts, and an
# image part as <|vision_start|><|image_pad|><|vision_end|> (the processor
# repeats the pad once per merged patch).
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

PATCH = 4  # vision patch size in pixels (the real model's is 14)


def qwen2_vl_config(tok, hidden: int = 64, layers: int = 2) -> dict:
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN2_VL_TOKENS}
    half = hidden // 4 // 2  # rotary pairs of a head (4 heads)
    t = half // 4
    sections = [t, (half - t) // 2, half - t - (half - t) // 2]  # frames, rows, columns: [2, 3, 3] at 64 wide
    return {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 2 * hidden,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": len(tok), "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": sections},  # sums to the head's rotary pairs
        "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        "vision_config": {
            "model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": hidden, "num_heads": 2,
            "mlp_ratio": 2, "in_channels": 3, "patch_size": PATCH, "spatial_patch_size": PATCH,
            "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
    }


def qwen2_vl_preprocessor(max_pixels: int = 32 * 32) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "patch_size": PATCH, "merge_size": 2, "temporal_patch_size": 2,
        "min_pixels": (2 * PATCH) ** 2, "max_pixels": max_pixels,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    }


def random_weights(model, gain: float, seed: int) -> dict:
    """Every parameter of ``model``, its linears' weights scaled by ``gain``
    (a plain initialisation makes a model that repeats one token)."""
    mx.random.seed(seed)
    flat = {}
    for path, w in tree_flatten(model.parameters()):
        if path.endswith("weight") and w.ndim == 2 and "embed" not in path and "norm" not in path:
            w = w * gain
        flat[path] = w
    return flat


def vlm_from_config(config: dict):
    """mlx-vlm's model of ``config`` (a config.json's dict), built as its
    ``load_model`` builds it, with its initial weights."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads(json.dumps(config))
    arch, _ = get_model_and_args(config=config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = update_module_configs(arch.ModelConfig.from_dict(config), arch, config,
                                         ["text", "vision", "perceiver", "projector"])
    return arch.Model(model_config)


QWEN2_5_VL_VISION = {  # Qwen2.5-VL's tower: windowed attention, full attention in its last block
    "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64,
    "num_heads": 2, "in_channels": 3, "patch_size": PATCH, "spatial_patch_size": PATCH, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "window_size": 4 * PATCH, "fullatt_block_indexes": [1], "tokens_per_second": 2,
}


def make_tiny_qwen2_5_vl(path: str | Path, seed: int = 0, gain: float = 3.0) -> Path:
    """A random Qwen2.5-VL directory that ``mlx_vlm.load`` accepts."""
    return make_tiny_qwen2_vl(path, seed, gain, qwen2_5=True)


def make_tiny_qwen2_vl(path: str | Path, seed: int = 0, gain: float = 3.0, qwen2_5: bool = False,
                       hidden: int = 64, layers: int = 2, max_pixels: int = 32 * 32) -> Path:
    """A random Qwen2-VL directory that ``mlx_vlm.load`` accepts (``qwen2_5``:
    Qwen2.5-VL), its decoder ``hidden`` wide and ``layers`` deep, its images
    resized to ``max_pixels`` at most."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(512, QWEN2_VL_TOKENS)
    tok.chat_template = QWEN2_VL_TEMPLATE
    config = qwen2_vl_config(tok, hidden, layers)
    if qwen2_5:
        config.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"],
                      vision_config=QWEN2_5_VL_VISION)
    mx.random.seed(seed)
    model = vlm_from_config(config)
    mx.save_safetensors(str(path / "model.safetensors"), random_weights(model, gain, seed))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    preprocessor = qwen2_vl_preprocessor(max_pixels) | ({"processor_class": "Qwen2_5_VLProcessor"} if qwen2_5 else {})
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    tok.save_pretrained(str(path))
    (path / "chat_template.jinja").write_text(QWEN2_VL_TEMPLATE)
    return path


def make_vlm_adapter(path: str | Path, model_dir: Path, rank: int = 4, seed: int = 1,
                     keys=("q_proj", "v_proj", "o_proj", "down_proj"), gain: float = 0.5,
                     vision_too: bool = False) -> Path:
    """An adapter as ``mlx_vlm.train`` writes it (adapters.safetensors and
    adapter_config.json naming full layer paths), made by mlx-vlm's own
    get_peft_model and save_adapter, its factors random (lora_b starts at 0).
    ``vision_too``: the vision tower's qkv linears get LoRA as well."""
    from mlx.utils import tree_unflatten
    from mlx_vlm import load
    from mlx_vlm.trainer.peft.utils import get_peft_model, save_adapter

    path = Path(path)
    model, _ = load(str(model_dir))
    layers = list(keys) + (["vision_tower.blocks.0.attn.qkv"] if vision_too else [])
    get_peft_model(model, layers, rank=rank, alpha=2.0 * rank, dropout=0.0, verbose=False)
    mx.random.seed(seed)
    flat = tree_flatten(model.trainable_parameters())
    model.update(tree_unflatten([(k, gain * mx.random.normal(v.shape)) for k, v in flat]))
    save_adapter(model, path / "adapters.safetensors")
    return path


def merged_vlm(model_dir: Path, adapter_dir: Path | None = None, scale: float = 1.0, more=()):
    """(mlx-vlm's model with ``adapter_dir`` loaded by mlx-vlm and fused into
    its weights at ``scale`` times its own scale, processor); ``more``:
    (adapter, scale) pairs fused after it, one by one (a stack)."""
    from mlx_vlm import load
    from mlx_vlm.trainer.peft.utils import apply_lora_layers

    model, processor = load(str(model_dir), adapter_path=str(adapter_dir) if adapter_dir else None)
    fuse_loras(model, scale)
    for adapter, s in more:
        fuse_loras(apply_lora_layers(model, str(adapter)), s)
    return model, processor


def fuse_loras(model, scale: float) -> None:
    """Every mlx-vlm LoRALinear of ``model`` fused into its weights at ``scale`` times its own scale."""
    from mlx_vlm.trainer.peft.lora_layers import LoRALinear

    fused = []
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.scale = m.scale * scale
            fused.append((name, m.fuse()))
    if fused:
        from mlx.utils import tree_unflatten

        model.update_modules(tree_unflatten(fused))


def vlm_greedy(model, processor, messages, images, max_tokens: int, **generate_args) -> list[int]:
    """mlx-vlm's own greedy answer (its generate; ``generate_args``: more of its arguments) as token ids."""
    from mlx_vlm import generate

    from mola.frontend.vision_prompt import templater

    prompt = templater(processor).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = generate(model, processor, prompt, image=list(images) or None, max_tokens=max_tokens,
                   temperature=0.0, verbose=False, **generate_args)
    return list(out.token_ids)


def random_image(seed: int, size: tuple[int, int] = (24, 20)):
    """A random RGB PIL image of ``size`` (width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def image_input(seed: int, size: tuple[int, int] = (24, 20)):
    """What the frontend hands on for an image part (frontend/images_in.py's
    ImageInput): the PIL image, and the SHA-256 of its PNG bytes."""
    import hashlib
    import io
    from types import SimpleNamespace

    im = random_image(seed, size)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return SimpleNamespace(image=im, sha256=hashlib.sha256(buf.getvalue()).hexdigest(), width=size[0], height=size[1])


def image_chat(question: str, num_images: int = 1) -> list[dict]:
    """A one-turn chat whose user message has ``num_images`` image parts, then ``question``."""
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": question}]}]


IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
IDEFICS3_TEMPLATE = QWEN2_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def make_tiny_idefics3(path: str | Path, seed: int = 0, gain: float = 3.0, image_size: int = 32) -> Path:
    """A random Idefics3 (SmolVLM's architecture) directory that ``mlx_vlm.load``
    accepts: a llama decoder, a SigLIP tower of ``image_size`` pixels in 8-pixel
    patches, and no image splitting (one global tile per image)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(512, IDEFICS3_TOKENS)
    tok.chat_template = IDEFICS3_TEMPLATE
    seq_len = (image_size // 8) ** 2 // 4  # tokens per image: patches, pixel-shuffled by scale_factor 2
    config = {
        "model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"], "scale_factor": 2,
        "image_token_id": tok.convert_tokens_to_ids("<image>"), "vocab_size": len(tok),
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"), "tie_word_embeddings": False,
        "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                        "vocab_size": len(tok), "num_hidden_layers": 2, "rope_theta": 10000.0,
                        "max_position_embeddings": 2048, "tie_word_embeddings": False},
        "vision_config": {"model_type": "idefics3_vision", "hidden_size": 32, "num_attention_heads": 2,
                          "patch_size": 8, "num_hidden_layers": 2, "intermediate_size": 64,
                          "image_size": image_size},
    }
    model = vlm_from_config(config)
    mx.save_safetensors(str(path / "model.safetensors"), random_weights(model, gain, seed))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor",
        "do_resize": True, "size": {"longest_edge": 2 * image_size}, "max_image_size": {"longest_edge": image_size},
        "do_image_splitting": False, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True, "resample": 1,
        "do_convert_rgb": True}, indent=2))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": seq_len,
                                                            "processor_class": "Idefics3Processor"}))
    tok.save_pretrained(str(path))
    (path / "chat_template.jinja").write_text(IDEFICS3_TEMPLATE)
    return path
