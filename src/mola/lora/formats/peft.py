"""Hugging Face PEFT LoRA adapters (not implemented yet: see issue 3)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ...errors import InvalidAdapter
from ..weights import LoRAWeights


def is_peft_adapter(path: Path) -> bool:
    return False


def looks_like_peft_config(path: Path) -> bool:
    return False


def read_peft_adapter(path: Path, dtype: mx.Dtype | None = None, model_type: str | None = None) -> LoRAWeights:
    raise InvalidAdapter(f"PEFT adapters are not supported yet: {path}")
