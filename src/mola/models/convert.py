"""`mola convert FILE.gguf OUT_DIR`: a GGUF model as an mlx-lm model directory
(config.json, model.safetensors, tokenizer files) that mlx_lm.load, mlx_lm.generate
and mlx_lm.server load. The weights are exactly what `mola serve` holds for the file
at the same --dtype (keep: quantized layers stay quantized, with their quantization
in config.json; but Q6_K matrices, which mola holds as two quantized halves that no
mlx-lm layer reads, are written dequantized, in float32, exactly), written with
mlx-lm's own save_model / save_config."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from ..errors import ModelLoadError
from .gguf import load_gguf_model
from .metadata import find_gguf
from .quantized_pair import unpair
from .tokenizer import tokenizer_files

CONVERT_DTYPES = ("keep", "float16", "bfloat16", "float32")


def convert(src: str | Path, out: str | Path, dtype: str = "keep", force: bool = False) -> Path:
    """Write the mlx-lm directory for the GGUF model at ``src`` to ``out`` (built in a
    temporary directory next to it and renamed into place)."""
    from mlx_lm.utils import save_config, save_model

    src, out = Path(src).expanduser(), Path(out).expanduser()
    if dtype not in CONVERT_DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(CONVERT_DTYPES)}")
    path = find_gguf(src) if src.exists() else None
    if path is None:
        raise ModelLoadError(f"{src} is not a GGUF model file (nor a directory holding one)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise ModelLoadError(f"{out} exists and is not an empty directory; pass --force to replace it")
    model, config, f = load_gguf_model(path, dtype)
    unpaired = unpair(model, mx.float32)  # mlx-lm has no layer of two quantized halves: Q6_K as float32
    if unpaired:
        config["quantization"] = {k: v for k, v in config["quantization"].items() if k not in unpaired}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_model(tmp, model)
        stops = tokenizer_files(f.metadata, f.arch.name, tmp, config.get("max_position_embeddings"))
        if stops:
            config["eos_token_id"] = stops if len(stops) > 1 else stops[0]
        save_config(dict(config), tmp / "config.json")
        (tmp / "mola_convert.json").write_text(json.dumps(
            {"source": path.name, "dtype": dtype, "architecture": f.arch.name}, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
