"""Twin: what convert_hf_to_gguf.py does for one model type, for gguf_model.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Twin:
    # (TinyModelSpec) -> config.json keys a tiny model of this type needs beyond
    # TinyModelSpec.config()'s (head_dim, soft-capping, sliding windows, ...)
    tiny_config: Callable[[object], dict] | None = None
    # (gguf.GGUFWriter, config.json) -> None: the metadata the converter's
    # set_gguf_parameters writes beyond gguf_model._hyperparameters (which it may overwrite)
    hparams: Callable[[object, dict], None] | None = None
    # (GGUF tensor name, float32 data, config.json) -> the data the converter writes
    tensor: Callable[[str, np.ndarray, dict], np.ndarray] | None = None
    # mlx-lm weight name -> the Hugging Face name gguf-py's TensorNameMap knows, where they differ
    hf_name: Callable[[str], str] | None = None
    # (config.json) -> more tensors the converter writes (GGUF name -> float32 data)
    extra_tensors: Callable[[dict], dict[str, np.ndarray]] | None = None
