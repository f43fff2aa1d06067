"""Loading the base model: a local directory or a Hugging Face hub id."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ..errors import MolaError
from .engine import LoadedModel

log = logging.getLogger("mola.loader")

# What a model directory needs (mlx-lm downloads the same set).
MODEL_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                  "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]


class ModelLoadError(MolaError):
    """The base model cannot be found or loaded."""


def looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local directory as is; otherwise a hub id through huggingface-hub's
    cache (downloading only if the hub is reachable)."""
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory: it has no config.json")
        return path
    if not looks_like_hub_id(model):
        raise ModelLoadError(f"The model path does not exist: {path}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=MODEL_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated, ...
        raise ModelLoadError(
            f"Could not fetch '{model}' from the Hugging Face hub (nor find it in "
            f"the local cache): {type(e).__name__}: {e}"
        ) from e


def load_base_model(model: str, revision: str | None = None, group=None) -> LoadedModel:
    """Load model and tokenizer with mlx-lm; with a distributed ``group``,
    this rank's tensor-parallel shard (mlx-lm's own sharding). Call on the
    engine thread."""
    from mlx_lm.utils import load, sharded_load

    path = resolve_model_path(model, revision)
    log.info("loading model from %s%s", path, f" (shard {group.rank() + 1} of {group.size()})" if group else "")
    t0 = time.perf_counter()
    try:
        if group is not None:
            model_obj, tokenizer, config = sharded_load(
                str(path), tensor_group=group, return_config=True,
                tokenizer_config={"trust_remote_code": False},
            )
        else:
            model_obj, tokenizer, config = load(str(path), return_config=True)
    except Exception as e:
        raise ModelLoadError(f"mlx-lm could not load the model at {path}: {e}") from e
    log.info("model loaded in %.1f s", time.perf_counter() - t0)
    return LoadedModel(model=model_obj, tokenizer=tokenizer, config=config, path=path)
