"""llama.cpp GGUF LoRA adapters (not implemented yet: see issue 3)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ...errors import InvalidAdapter
from ..weights import LoRAWeights


def is_gguf_file(path: Path) -> bool:
    return False


def read_gguf_adapter(path: Path, dtype: mx.Dtype | None = None, model_type: str | None = None) -> LoRAWeights:
    raise InvalidAdapter(f"GGUF adapters are not supported yet: {path}")
