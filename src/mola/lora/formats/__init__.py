"""Adapter file formats, each read into a :class:`mola.lora.weights.LoRAWeights`."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ...errors import AdapterPathNotFound, InvalidAdapter
from ..weights import LoRAWeights
from .mlx_lm import is_mlx_lm_adapter, read_mlx_lm_adapter


def read_adapter(path: str | Path, dtype: mx.Dtype | None = None) -> LoRAWeights:
    """Read the adapter at ``path`` in whichever supported format it is."""
    path = Path(path).expanduser()
    if not path.exists():
        raise AdapterPathNotFound(f"The adapter path does not exist: {path}")
    if not path.is_dir():
        raise InvalidAdapter(f"The adapter path is not a directory: {path}")
    if is_mlx_lm_adapter(path) or (path / "adapter_config.json").exists():
        return read_mlx_lm_adapter(path, dtype)
    raise InvalidAdapter(
        f"No adapter found at {path}: expected adapter_config.json and "
        "adapters.safetensors (mlx-lm format)."
    )
