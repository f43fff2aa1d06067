"""Adapters pushed from memory (PUT /v1/adapters/{name}/weights): a training
loop sends its LoRA factors as one safetensors body, no file in between.

The body holds mlx-lm's factor names (``model.layers.0.self_attn.q_proj.lora_a``
[in, r] and ``.lora_b`` [r, out], as its LoRALinear names its parameters) and
its adapter_config.json as the safetensors metadata entry ``adapter_config``
(``lora_parameters.scale`` is read from it). The factors are kept here, in
host memory, under a source name of their own (``pushed:NAME@N``), which the
registry treats as it treats an adapter's path: slot writes, evictions and
reloads read it from here (mola.adapters.recipe.read_checked). Nothing is
written to disk.
"""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import mlx.core as mx

from ..errors import InvalidAdapter
from .formats.mlx_lm import adapter_scale, mlx_lm_weights
from .weights import LoRAWeights, ModuleLoRA

PREFIX = "pushed:"
CONFIG_KEY = "adapter_config"  # the safetensors metadata entry holding adapter_config.json

_store: dict[str, LoRAWeights] = {}  # source name -> its factors (float32, as sent)
_numbers = itertools.count(1)


def is_pushed(path: str) -> bool:
    return str(path).startswith(PREFIX)


def parse(name: str, body: bytes) -> LoRAWeights:
    """The factors of a pushed body; InvalidAdapter naming what is wrong."""
    import safetensors.numpy

    where = f"the adapter pushed as '{name}'"
    if len(body) < 8:
        raise InvalidAdapter(f"{where} is not a safetensors body ({len(body)} bytes).")
    (size,) = struct.unpack("<Q", body[:8])
    try:
        header = json.loads(body[8 : 8 + size])
        tensors = safetensors.numpy.load(body)
    except Exception as e:
        raise InvalidAdapter(f"{where} is not a readable safetensors body: {e}") from None
    text = (header.get("__metadata__") or {}).get(CONFIG_KEY)
    if text is None:
        raise InvalidAdapter(f"{where} has no '{CONFIG_KEY}' metadata entry (its adapter_config.json, with "
                             "lora_parameters.scale).")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidAdapter(f"{where}: its '{CONFIG_KEY}' metadata is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{where}: its '{CONFIG_KEY}' metadata is not a JSON object.")
    scale = adapter_scale(config, Path(f"<{name}>"))
    arrays = {k: mx.array(v) for k, v in tensors.items()}
    return mlx_lm_weights(arrays, scale, where, where)


def keep(name: str, weights: LoRAWeights) -> str:
    """Hold ``weights`` under a new source name, returned."""
    source = f"{PREFIX}{name}@{next(_numbers)}"
    _store[source] = weights
    return source


def drop(source: str) -> None:
    _store.pop(source, None)


def is_held(source: str) -> bool:
    return source in _store


def read_pushed(source: str, dtype: mx.Dtype | None) -> LoRAWeights:
    weights = _store.get(source)
    if weights is None:
        raise InvalidAdapter(f"the pushed adapter {source} is no longer held (it was replaced or unloaded).")
    if dtype is None:
        return weights
    modules = {p: ModuleLoRA(a=m.a.astype(dtype), b=m.b.astype(dtype), scale=m.scale)
               for p, m in weights.modules.items()}
    return LoRAWeights(source=weights.source, format="pushed", modules=modules)
