"""Adapter file formats, each read into a :class:`mola.adapters.weights.LoRAWeights`
whose module paths are the mlx-lm model's own (``model.layers.3.self_attn.q_proj``).

    mlx_lm.py              mlx-lm directories: adapter_config.json + adapters.safetensors
    peft.py                Hugging Face PEFT directories: adapter_config.json + adapter_model.safetensors
    peft_config.py         what a PEFT config declares: its checks, PEFT's module matching and scales
    peft_experts.py        PEFT LoRA on 3-D expert parameters (target_parameters)
    peft_expert_paths.py   PEFT's expert LoRA (either layout) -> mlx-lm's SwitchLinear paths
    gguf.py                llama.cpp GGUF LoRA files (general.type = adapter): header, tensor names
    gguf_tensors.py        GGUF tensors -> mola's factors
    gguf_names.py          llama.cpp's tensor names <-> mlx-lm module paths, per architecture
    gguf_writer.py         mola's own GGUF LoRA writer (mola train --format gguf)
    common.py              what the directory formats share: adapter_config.json
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ...errors import AdapterPathNotFound, InvalidAdapter
from ..weights import LoRAWeights
from . import gguf, mlx_lm, peft


def detect_format(path: Path) -> str:
    """"mlx-lm", "peft" or "gguf"; InvalidAdapter if none fits."""
    if path.is_file():
        if gguf.is_gguf_file(path):
            return "gguf"
        raise InvalidAdapter(
            f"{path} is a file but not a GGUF adapter; an mlx-lm or PEFT adapter is a directory."
        )
    if mlx_lm.is_mlx_lm_adapter(path):
        return "mlx-lm"
    if peft.is_peft_adapter(path):
        return "peft"
    if (path / "adapter_config.json").is_file():
        # A config without recognisable weights: let the mlx-lm reader name
        # what is missing (or what is wrong with the config).
        return "peft" if peft.looks_like_peft_config(path) else "mlx-lm"
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf"
    raise InvalidAdapter(
        f"No adapter found at {path}: expected an mlx-lm adapter (adapter_config.json + "
        "adapters.safetensors), a PEFT adapter (adapter_config.json + "
        "adapter_model.safetensors) or a llama.cpp GGUF LoRA file."
    )


def read_adapter(
    path: str | Path,
    dtype: mx.Dtype | None = None,
    model_type: str | None = None,
    model_config: dict | None = None,
    rows_as_stored: bool = False,
) -> LoRAWeights:
    """Read the adapter at ``path`` in whichever supported format it is.

    ``dtype`` is the base model's compute dtype (factors are cast to it);
    ``model_type`` is the base's mlx-lm model type (``config.json``'s
    ``model_type``), which formats that name modules their own way need;
    ``model_config`` is the base's whole config (GGUF needs its head counts to
    put llama's q/k rows back in the base's order, PEFT its expert count and
    widths; ``rows_as_stored`` leaves GGUF rows as stored, to describe an
    adapter without its base).
    """
    try:
        path = Path(path).expanduser()
        exists = path.exists()
    except (RuntimeError, OSError, ValueError) as e:
        raise AdapterPathNotFound(f"The adapter path {str(path)!r} is not usable: {e}") from None
    if not exists:
        raise AdapterPathNotFound(f"The adapter path does not exist: {path}")
    kind = detect_format(path)
    if kind == "gguf":
        file = path if path.is_file() else sorted(path.glob("*.gguf"))[0]
        return gguf.read_gguf_adapter(file, dtype, model_type, model_config=model_config,
                                      rows_as_stored=rows_as_stored)
    if kind == "peft":
        return peft.read_peft_adapter(path, dtype, model_type, model_config)
    return mlx_lm.read_mlx_lm_adapter(path, dtype)
