"""What the directory formats share: their adapter_config.json, and where a
vision model's language model sits."""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import InvalidAdapter

CONFIG_FILE = "adapter_config.json"


def read_config(path: Path) -> dict:
    """The adapter's config as a dict, or InvalidAdapter naming what is wrong."""
    config_file = path / CONFIG_FILE
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise InvalidAdapter(f"Adapter at {path} has no {CONFIG_FILE}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidAdapter(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{config_file} must hold a JSON object.")
    return config


# The vision side of a vision-language model, by mlx-vlm's names and Hugging Face's (under
# PEFT's base_model.model.): its tower and the projector into the language model.
VISION_PARTS = ("vision_tower", "visual", "vision_model", "multi_modal_projector", "connector", "mm_projector",
                "aligner")
# Where the language model's decoder sits: mlx-vlm's (mlx_vlm.train), then Hugging Face's
# (Qwen2-VL since transformers 4.52, Idefics3), as mola lays a vision model out (mola.models.vision).
LANGUAGE_PREFIXES = (("language_model.model.", "model."), ("language_model.layers.", "model.layers."),
                     ("model.language_model.", "model."), ("model.text_model.", "model."),
                     ("language_model.lm_head", "lm_head"))


def language_path(module: str, source) -> str:
    """An adapter module's path on the base as mola lays it out: a vision
    model's ``language_model.model.layers.0...`` (mlx-vlm) or
    ``model.language_model.layers.0...`` (Hugging Face) is
    ``model.layers.0...``; a text model's paths are left as they are. A LoRA
    on the vision tower or its projector is refused (InvalidAdapter naming
    ``source``): the tower runs once per image in the prefill, outside the
    batch whose rows pick their adapters."""
    first = module.removeprefix("model.").split(".", 1)[0]
    if first in VISION_PARTS:
        raise InvalidAdapter(
            f"{source} adapts '{module}', part of the vision tower or its projector; mola serves LoRA "
            "on a vision model's language model only (its vision tower runs once per image, outside the "
            "multi-LoRA batch).")
    for old, new in LANGUAGE_PREFIXES:
        if module.startswith(old):
            return new + module[len(old):]
    return module
