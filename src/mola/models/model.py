"""What the loader hands the engine: the mlx-lm model and what the frontend
needs to know about it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.nn as nn


@dataclass
class LoadedModel:
    """What the loader hands the engine: the mlx-lm model and what the
    frontend needs to know about it."""

    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict  # the model's config.json
    path: Path | None = None  # the local directory it came from
    draft: nn.Module | None = None  # --speculative draft: the draft model (the same tokenizer)
    takes_images: bool = False  # a vision-language base: chat messages may carry images (docs/vision.md)
    processor: Any = None  # a vision base's: mlx-vlm's processor (chat template, images -> tokens); None: text

    @property
    def vocab_size(self) -> int:
        size = self.config.get("vocab_size") or self.config.get("text_config", {}).get("vocab_size")
        return int(size) if size else len(self.tokenizer)

    @property
    def max_model_len(self) -> int | None:
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx"):
            value = self.config.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return None
