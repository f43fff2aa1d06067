"""Vision-language bases: an mlx-vlm model directory, loaded through mlx-vlm's
own loader and processor, served as an mlx-lm-like text model whose decoder
mola's LoRA layers wrap.

:class:`VisionLanguageModel` lays the language model out as mlx-lm's are
(``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``), so
adapters name the same paths as for a text model (Idefics3's head stays at
``model.lm_head``, where mlx-vlm keeps it), and keeps the vision tower beside
it. Its forward pass takes what the runner computed per row: the input
embeddings (image features merged in by mlx-vlm's own code) and, for the
Qwen2-VL family, the multimodal rotary positions [3, B, L] (M-RoPE), so that
each row of a shared batch keeps its own positions through decode (its rope
delta, see :func:`decode_positions`); Idefics3's llama decoder reads each
row's positions from its cache's offsets, as mlx-lm's text models do.

Families (mlx-vlm's ``model_type``): SERVED are those checked to answer in
the mixed batch exactly as mlx-vlm's own generate does (tests/test_vision_rows.py);
any other is refused at start, saying why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..errors import ModelLoadError

# mlx-vlm families mola serves: Qwen2-VL's M-RoPE decoders, which take each row's positions
# [3, B, L]; Idefics3's (SmolVLM's) llama decoder, whose RoPE reads each row's cache offset.
SERVED = ("qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm")
# Families refused at start, and why (any other: not checked, refused too).
REFUSED: dict[str, str] = {}
VISION_FILES = ("preprocessor_config.json", "processor_config.json")


def vision_model_type(path: Path) -> str | None:
    """The mlx-vlm ``model_type`` of a model directory that holds a vision
    model (a config with a ``vision_config`` and an image processor's config);
    None for a text model."""
    if not path.is_dir() or not (path / "config.json").is_file():
        return None
    try:
        config = json.loads((path / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # the text loader names the broken file
    if not isinstance(config, dict) or "vision_config" not in config:
        return None
    if not any((path / f).is_file() for f in VISION_FILES):
        return None
    return str(config.get("model_type"))


def check_served(model_type: str, path: Path) -> None:
    if model_type in SERVED:
        return
    why = REFUSED.get(model_type, "mola has not checked that its decoder can take per-row positions")
    raise ModelLoadError(f"{path} is an mlx-vlm '{model_type}' vision model, which mola does not serve: {why}. "
                         f"mola serves vision models of the families {', '.join(SERVED)}")


@dataclass(frozen=True)
class _Held:
    """mlx-vlm's whole model, kept out of the module tree (its language model's
    modules are the wrapper's own, under other paths)."""

    vlm: Any


class VisionLanguageModel(nn.Module):
    """An mlx-vlm model (of SERVED) as an mlx-lm-like one (see the module doc)."""

    def __init__(self, vlm: nn.Module):
        super().__init__()
        lm = vlm.language_model
        # Qwen2-VL: lm.model is the decoder (embed_tokens, layers, norm), lm.lm_head beside it, and it
        # takes positions. Idefics3: lm is the decoder and its head, and its RoPE reads the cache's offsets.
        self.takes_positions = hasattr(lm, "model") and hasattr(lm.model, "layers")
        self.model = lm.model if self.takes_positions else lm  # the very modules mlx-vlm's model calls
        self.tied = self.takes_positions and bool(lm.args.tie_word_embeddings)
        if self.takes_positions and not self.tied:
            self.lm_head = lm.lm_head
        self.vision_tower = getattr(vlm, "vision_tower", None) or vlm.vision_model
        if hasattr(vlm, "connector"):
            self.connector = vlm.connector  # Idefics3's projector into the decoder
        self.held = _Held(vlm)
        self.model_type = vlm.config.model_type

    @property
    def layers(self):
        return self.model.layers

    @property
    def image_token_id(self) -> int:
        return int(self.held.vlm.config.image_token_id)

    def __call__(self, inputs: mx.array, cache=None, embeds: mx.array | None = None,
                 positions: mx.array | None = None) -> mx.array:
        """Logits [B, L, V] of ``inputs`` [B, L]; ``embeds`` [B, L, D] (None: the
        tokens' own), ``positions`` [3, B, L] (None: each row's next positions
        by its cache, as a text model's, for rows without an image)."""
        if not self.takes_positions:  # each row's positions are its cache's offsets
            return self.model(inputs, inputs_embeds=embeds, cache=cache).logits
        if positions is None:
            positions = decode_positions(cache, mx.zeros((inputs.shape[0],), dtype=mx.int32), inputs.shape[1])
        h = self.model(inputs, inputs_embeds=embeds, cache=cache, position_ids=positions)
        return self.model.embed_tokens.as_linear(h) if self.tied else self.lm_head(h)

    def image_rows(self, tokens: list[int], arrays: dict[str, mx.array]) -> tuple:
        """One prompt's embeddings [1, L, D] with the images' features merged
        in, its positions [3, 1, L] and rope delta, as mlx-vlm computes them
        (its get_input_embeddings: the vision tower, the merge, get_rope_index)
        from the processor's ``arrays`` (pixel_values, image_grid_thw)."""
        ids = mx.array([tokens], dtype=mx.int32)  # [1, L]
        arrays = dict(arrays)
        out = self.held.vlm.get_input_embeddings(ids, arrays.pop("pixel_values"), **arrays)
        if out.position_ids is None:  # a 1-D family: its positions are its tokens' indices
            return out.inputs_embeds, None, 0
        return out.inputs_embeds, out.position_ids, int(out.rope_deltas.reshape(-1)[0].item())


    def image_positions(self, tokens: list[int], arrays: dict[str, mx.array]) -> tuple:
        """One prompt's positions [3, 1, L] and rope delta without its
        images' features (mlx-vlm's get_rope_index reads the grids alone);
        (None, 0) for a 1-D family."""
        if not self.takes_positions:
            return None, 0
        ids = mx.array([tokens], dtype=mx.int32)  # [1, L]
        lm = self.held.vlm.language_model
        positions, deltas = lm.get_rope_index(ids, arrays.get("image_grid_thw"), arrays.get("video_grid_thw"))
        return positions, int(deltas.reshape(-1)[0].item())


def decode_positions(cache, deltas: mx.array, length: int) -> mx.array:
    """[3, B, L] positions of the next ``length`` tokens of each row: its
    tokens so far (the cache's offset, per row in a batch cache) plus its rope
    delta ``deltas`` [B] (0 for a text row)."""
    offset = cache[0].offset if cache else 0
    offset = offset if isinstance(offset, mx.array) else mx.array([offset] * deltas.shape[0])
    pos = (offset + deltas)[:, None] + mx.arange(length)[None, :]  # [B, L]
    return mx.broadcast_to(pos[None], (3, *pos.shape))


def load_vision_model(path: Path, model_type: str):
    """(VisionLanguageModel, mlx-vlm's processor, config dict): through
    mlx-vlm's own ``load``; ModelLoadError when mlx-vlm is missing or fails."""
    check_served(model_type, path)
    try:
        from mlx_vlm import load
    except ImportError as e:
        raise ModelLoadError(f"{path} is a vision model ('{model_type}'); serving it needs mlx-vlm: "
                             f"pip install 'mola[vision]' ({e})") from None
    try:
        vlm, processor = load(str(path))
    except Exception as e:
        raise ModelLoadError(f"mlx-vlm could not load the vision model at {path}: {e}") from e
    config = json.loads((path / "config.json").read_text())
    return VisionLanguageModel(vlm), processor, config
