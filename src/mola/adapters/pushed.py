"""Adapters pushed from memory (PUT /v1/adapters/{name}/weights): a training
loop sends its LoRA factors as one safetensors body, no file in between.

The body holds the factors by the names of an adapter directory's weights
file, with that directory's adapter_config.json as the safetensors metadata
entry ``adapter_config``:

- mlx-lm's (``model.layers.0.self_attn.q_proj.lora_a`` [in, r] and
  ``.lora_b`` [r, out], as its LoRALinear names its parameters; the config's
  ``lora_parameters.scale``), or
- PEFT's (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
  [r, in] and ``lora_B.weight`` [out, r]; the config's ``r``, ``lora_alpha``,
  ``target_modules``... checked as a PEFT directory's are).

Either may name an activated LoRA's ``alora_invocation_tokens``. Factors come
in float32, float16 or bfloat16. A base's :class:`PushedAdapters` (its
loader's; the registry keeps and drops them) holds them in host memory under
a source name of their own (``pushed:NAME@N``), which the registry treats as
it treats an adapter's path: slot writes, evictions and reloads read it from
there (mola.adapters.recipe.read_checked). Nothing is written to disk, unless
the push asks for it (``?persist=true``: :func:`persist` writes the adapter
directory the body describes).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from ..errors import AdapterDirExists, InvalidAdapter, PersistFailed
from .formats.common import CONFIG_FILE
from .host_safetensors import read_safetensors
from .formats.mlx_lm import WEIGHTS_FILE as MLX_LM_WEIGHTS_FILE, adapter_scale, is_dora, mlx_lm_weights
from .formats.peft import WEIGHTS_FILE as PEFT_WEIGHTS_FILE, peft_weights
from .weights import LoRAWeights, ModuleLoRA, alora_tokens, with_invocation

PREFIX = "pushed:"
CONFIG_KEY = "adapter_config"  # the safetensors metadata entry holding adapter_config.json
MARKER = ".mola-pushed"  # in a directory persist() wrote: a later push of the name may replace it
FLOATS = (mx.float32, mx.float16, mx.bfloat16)
# The largest |scale| a pushed config may give its factors (mlx-lm's
# lora_parameters.scale, PEFT's lora_alpha / r): 50 times mlx-lm's and mola
# train's default of 20. ?scale= (the slot's own strength) multiplies it, within
# [-10, 10]; a scale past this bound only overflows the activations.
MAX_CONFIG_SCALE = 1000.0

@dataclasses.dataclass(frozen=True)
class Pushed:
    """A pushed body read: its factors, and the adapter directory it describes."""
    weights: LoRAWeights
    files: dict[str, bytes]  # file name -> contents: adapter_config.json and the weights file


def is_pushed(path: str) -> bool:
    return str(path).startswith(PREFIX)


def parse(name: str, body: bytes, model_config: dict | None = None, vocab_size: int | None = None) -> Pushed:
    """The factors of a pushed body (``model_config``: the base's, which places
    PEFT's expert factors; ``vocab_size``: the base's, which bounds an
    activated LoRA's invocation tokens); InvalidAdapter naming what is wrong."""
    where = f"the adapter pushed as '{name}'"
    if not body:
        raise InvalidAdapter(f"The request body is empty; {where} is sent as one safetensors body.")
    pushed = _parse(name, where, body, model_config)
    _check_bounds(where, pushed.weights, vocab_size)
    return pushed


def _parse(name: str, where: str, body: bytes, model_config: dict | None) -> Pushed:
    metadata, tensors = _read_safetensors(body, where)
    text = metadata.get(CONFIG_KEY)
    if text is None:
        raise InvalidAdapter(f"{where} has no '{CONFIG_KEY}' metadata entry (its adapter_config.json: mlx-lm's, "
                             "with lora_parameters.scale, or PEFT's).")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidAdapter(f"{where}: its '{CONFIG_KEY}' metadata is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{where}: its '{CONFIG_KEY}' metadata is not a JSON object.")
    files = {CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode()}
    if any(n in k for k in tensors for n in (".lora_A", ".lora_B", ".lora_embedding_", ".token_adapter.")):  # PEFT's
        model_config = model_config or {}
        weights = peft_weights(config, tensors, Path(f"<{name}>"), Path(f"<{name}: body>"),
                               model_type=model_config.get("model_type"), model_config=model_config)
        return Pushed(dataclasses.replace(weights, source=where), {**files, PEFT_WEIGHTS_FILE: body})
    scale = adapter_scale(config, Path(f"<{name}>"))
    weights = with_invocation(mlx_lm_weights(tensors, scale, where, where, dora=is_dora(config)),
                              alora_tokens(config, where))
    return Pushed(weights, {**files, MLX_LM_WEIGHTS_FILE: body})


def _check_bounds(where: str, weights: LoRAWeights, vocab_size: int | None) -> None:
    """A pushed config's scale within [-MAX_CONFIG_SCALE, MAX_CONFIG_SCALE], and
    its invocation tokens in the vocabulary (else the aLoRA is never invoked)."""
    for path, m in sorted(weights.modules.items()):
        if not -MAX_CONFIG_SCALE <= m.scale <= MAX_CONFIG_SCALE:
            raise InvalidAdapter(f"{where}: its config gives {path} the scale {m.scale:g}; a pushed adapter's "
                                 f"scale (lora_parameters.scale, or lora_alpha / r) must be within "
                                 f"[-{MAX_CONFIG_SCALE:g}, {MAX_CONFIG_SCALE:g}].")
    outside = [t for t in weights.invocation_tokens or () if vocab_size is not None and t >= vocab_size]
    if outside:
        raise InvalidAdapter(f"{where}: alora_invocation_tokens holds token id {outside[0]}, outside the base's "
                             f"vocabulary (size {vocab_size}); the adapter could never be invoked.")


def _check_offsets(body: bytes, where: str) -> None:
    """Tensors whose data_offsets overlap, or run past the body, are refused
    (MLX's reader takes them); a header that is not JSON is left to it."""
    try:
        n = int.from_bytes(body[:8], "little")
        header = json.loads(body[8 : 8 + n])
        spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items()
                       if k != "__metadata__" and len(v["data_offsets"]) == 2)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return
    size, end, last = len(body) - 8 - n, 0, None
    for begin, stop, key in spans:
        if not (type(begin) is int and type(stop) is int and 0 <= begin <= stop <= size):
            raise InvalidAdapter(f"{where}: '{key}' has data_offsets [{begin}, {stop}], outside the body's "
                                 f"{size} data bytes.")
        if begin < end:
            raise InvalidAdapter(f"{where}: the data_offsets of '{key}' [{begin}, {stop}] overlap those of "
                                 f"'{last}' (ending at {end}); each tensor has bytes of its own.")
        if stop > end:
            end, last = stop, key


def _read_safetensors(body: bytes, where: str) -> tuple[dict, dict[str, mx.array]]:
    """(metadata, tensors) of a safetensors body in memory; float32, float16
    and bfloat16 factors only."""
    _check_offsets(body, where)
    read = read_safetensors(body)  # on the host: no MLX task waits behind the engine's steps
    if read is not None:
        return read
    try:  # other dtypes, malformed bodies: MLX's reader says what is wrong
        tensors, metadata = mx.load(io.BytesIO(body), format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError) as e:  # MLX's reader names what is wrong with the bytes
        raise InvalidAdapter(f"{where} is not a readable safetensors body: {e}") from None
    for key, value in tensors.items():
        if value.dtype not in FLOATS:
            raise InvalidAdapter(f"{where}: '{key}' is of type {value.dtype}; pushed factors are float32, "
                                 "float16 or bfloat16.")
    return metadata, tensors


class PushedAdapters:
    """The factors pushed onto one base, held in host memory under their source
    names. One per base, made with its loader (which reads from it) and gone
    with it; the registry keeps and drops entries as it serves and unloads
    pushed adapters."""

    def __init__(self):
        self._weights: dict[str, LoRAWeights] = {}  # source name -> its factors, as sent
        self._numbers = itertools.count(1)

    def keep(self, name: str, weights: LoRAWeights) -> str:
        """Hold ``weights`` under a new source name, returned."""
        source = f"{PREFIX}{name}@{next(self._numbers)}"
        self._weights[source] = weights
        return source

    def drop(self, source: str) -> None:
        self._weights.pop(source, None)

    def clear(self) -> None:
        self._weights.clear()

    def __contains__(self, source: str) -> bool:
        return source in self._weights

    def __len__(self) -> int:
        return len(self._weights)

    def read(self, source: str, dtype: mx.Dtype | None) -> LoRAWeights:
        """The factors held as ``source``, cast to ``dtype``; InvalidAdapter if
        they are no longer held."""
        weights = self._weights.get(source)
        if weights is None:
            raise InvalidAdapter(f"the pushed adapter {source} is no longer held (it was replaced or unloaded).")
        return cast(weights, dtype)


def cast(weights: LoRAWeights, dtype: mx.Dtype | None) -> LoRAWeights:
    """Pushed factors in ``dtype`` (the slot packs'; None: as sent)."""
    if dtype is None:
        return weights
    modules = {p: ModuleLoRA(a=m.a.astype(dtype), b=m.b.astype(dtype), scale=m.scale)
               for p, m in weights.modules.items()}
    mx.eval([(m.a, m.b) for m in modules.values()])  # at once (validate reads them on the host)
    return dataclasses.replace(weights, format="pushed", modules=modules)


def persist(name: str, pushed: Pushed, root: Path) -> Path:
    """Write the adapter directory a push describes as ``root/name``, through a
    temporary directory beside it (the old one, if a push wrote it, replaced
    whole). A directory there that no push wrote is not touched: AdapterDirExists."""
    target = Path(root) / name
    if not target.resolve().is_relative_to(Path(root).resolve()):
        raise InvalidAdapter(f"'{name}' does not name a directory under {root}.")
    if target.exists() and not (target / MARKER).is_file():
        raise AdapterDirExists(f"{target} exists and was not written by a push; persist=true will not replace "
                               "it (move it, or push under another name).", param="persist")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.push-", dir=target.parent))
    except OSError as e:
        raise PersistFailed(f"the pushed adapter could not be written under {root}: {e}") from None
    try:
        for file, data in {**pushed.files, MARKER: b""}.items():
            (tmp / file).write_bytes(data)
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        raise PersistFailed(f"the pushed adapter could not be written to {target}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
