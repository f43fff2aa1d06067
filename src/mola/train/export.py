"""The trained adapter as a llama.cpp GGUF LoRA (``mola train --out FILE.gguf``):
the mlx-lm adapter mlx-lm's trainer wrote, read back by mola's own reader and
written by mola's GGUF writer (adapters/formats/gguf_writer.py) with llama.cpp's
tensor names, its q/k row order for llama, and adapter.lora.alpha = scale * rank."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import TrainError
from ..adapters.formats.gguf_names import ARCHITECTURES, MODULE_TENSORS, architecture_for


def check_gguf_export(model_config: dict, keys: list[str]) -> str:
    """The GGUF architecture the adapter will be written for; TrainError, before
    training, when llama.cpp's format cannot hold it."""
    model_type = model_config.get("model_type")
    arch = architecture_for(model_type)
    if arch is None:
        raise TrainError(f"--out *.gguf: mola writes GGUF LoRA adapters for "
                         f"{', '.join(sorted(t for a in ARCHITECTURES.values() for t in a.model_types))} "
                         f"bases; this model's type is {model_type!r} (write an adapter directory instead)")
    unmapped = [k for k in keys if k not in MODULE_TENSORS]
    if unmapped:
        raise TrainError(f"--out *.gguf: llama.cpp's LoRA format has no tensor name for "
                         f"{', '.join(unmapped)} (it names {', '.join(sorted(MODULE_TENSORS))})")
    return arch.name


def write_gguf(adapter_dir: Path, out: Path, model_config: dict, base: str, outtype: str) -> None:
    """Write the mlx-lm adapter at ``adapter_dir`` as the GGUF LoRA ``out``
    (through a temporary file beside it, then renamed into place)."""
    from ..adapters.formats import read_adapter
    from ..adapters.formats.gguf_writer import save_gguf_adapter

    weights = read_adapter(adapter_dir)
    n_head = model_config.get("num_attention_heads")
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".gguf", dir=out.resolve().parent)
    os.close(fd)
    try:
        save_gguf_adapter(tmp, weights, architecture=check_gguf_export(model_config, _keys(weights)),
                          n_head=n_head, n_kv_head=model_config.get("num_key_value_heads") or n_head,
                          dtype=outtype, name=out.stem, base_model=base)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _keys(weights) -> list[str]:
    return sorted({path.split(".", 3)[3] for path in weights.modules})
