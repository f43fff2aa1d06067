"""A base model's LoRA targets, offline and without reading its weights.

An mlx-lm directory (or hub id) is built by mlx-lm's own loader, lazily
(``load_model(lazy=True)``): ``mx.load`` reads only the safetensors headers
and nothing is evaluated, so the weights stay on disk while the module tree,
the shapes (a quantized linear's packed ones included) and the dtypes are
those mola serve wraps (``pack.geometry_of``, which ``AdapterPacks.install``
shares). A GGUF file gives its config from its metadata (mola.models.metadata,
as mola serve reads it) and its tensor infos (names, shapes, codecs; no
tensor data): mlx-lm's class for it is built, unevaluated, and every target's
tensor is checked against it. Unknown architectures are refused by name.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path

from ..engine.config import DEFAULT_EXPERT_RANK
from ..adapters.formats.gguf_names import tensor_base_name
from ..lora.pack import SlotGeometry, geometry_of
from ..models.fit import MemoryPlan, free_bytes
from ..models.loader import ModelLoadError, check_gguf, resolve_dtype, resolve_model_path
from ..models.vision import vision_model_type


@dataclass(frozen=True)
class ModelShape:
    path: Path  # resolved: a model directory or a GGUF file
    config: dict  # the mlx-lm config mola serve reads adapters against
    geometry: SlotGeometry  # what an adapter must fit
    memory: MemoryPlan | None = None  # a GGUF file's, by tensor group, in the dtype serve would pick
    conversion: str | None = None  # a GGUF file's: from the conversion cache, or converted (models/gguf_cache.py)

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    @property
    def num_layers(self) -> int:
        v = self.geometry.vocab
        vocab = (v.embed_path, v.head_path) if v is not None else ()
        return len({p.split(".")[2] for p in self.geometry.targets if p not in vocab})


def model_shape(model: str, max_rank: int, dtype: str = "auto", max_expert_rank: int = DEFAULT_EXPERT_RANK) -> ModelShape:
    """The LoRA targets of ``model`` (a directory, a GGUF file or a hub id,
    through the hub's cache) as mola serve --dtype ``dtype`` would load it;
    ModelLoadError naming the problem."""
    path = resolve_model_path(model)
    if path.is_file():
        return _gguf_shape(path, max_rank, dtype, max_expert_rank)
    vision = vision_model_type(path)
    if vision is not None:
        return _vision_shape(path, vision, max_rank)
    return _mlx_lm_shape(path, max_rank, resolve_dtype(dtype, is_gguf=False), max_expert_rank)


def _mlx_lm_shape(path: Path, max_rank: int, dtype: str, max_expert_rank: int) -> ModelShape:
    from mlx_lm.utils import load_model

    from ..models.gguf import DTYPES

    try:
        module, config = load_model(path, lazy=True)
        geometry = geometry_of(module, max_rank, num_slots=2, expert_slots=1, max_expert_rank=max_expert_rank)
    except Exception as e:  # unknown model types, missing or mismatched weights
        raise ModelLoadError(f"mlx-lm could not load the model at {path}: {e}") from None
    if dtype != "keep":  # dequantized to this dtype at load (mola serve --dtype)
        geometry = dataclasses.replace(geometry, dtype=DTYPES[dtype])
    return ModelShape(path=path, config=config, geometry=geometry)


def _vision_shape(path: Path, model_type: str, max_rank: int) -> ModelShape:
    """An mlx-vlm model directory's decoder targets, built lazily by mlx-vlm's
    own loader and laid out as mola serve lays it out (mola.models.vision)."""
    import json

    from ..models.vision import VisionLanguageModel, check_served

    check_served(model_type, path)
    try:
        from mlx_vlm.utils import load_model

        module = VisionLanguageModel(load_model(path, lazy=True))
        geometry = geometry_of(module, max_rank, num_slots=2)
    except Exception as e:  # mlx-vlm missing, unknown model types, mismatched weights
        raise ModelLoadError(f"mlx-vlm could not load the vision model at {path}: {e}") from None
    return ModelShape(path=path, config=json.loads((path / "config.json").read_text()), geometry=geometry)


def _gguf_shape(path: Path, max_rank: int, dtype: str, max_expert_rank: int) -> ModelShape:
    from ..models.codecs import codec_name
    from ..models.gguf import DTYPES, keep_dtype
    from ..models.gguf_file import open_gguf
    from ..models.metadata import model_config

    f = open_gguf(path)
    dtype, memory = check_gguf(f, dtype, free_bytes())  # codecs it cannot read, memory it would not fit
    tensors = {t.name: t for t in f.reader.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path} has no token_embd.weight.")
    config = model_config(f, set(tensors), int(embed.shape[-1]))
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    skeleton = module.Model(module.ModelArgs.from_dict(config))  # parameters never evaluated
    geometry = geometry_of(skeleton, max_rank, num_slots=2, expert_slots=1, max_expert_rank=max_expert_rank)
    codecs = {codec_name(t.tensor_type) for t in tensors.values() if len(t.shape) > 1}
    geometry = dataclasses.replace(geometry, dtype=keep_dtype(codecs) if dtype == "keep" else DTYPES[dtype])
    for target, g in geometry.targets.items():
        name = tensor_base_name(target)
        if name is None:  # no llama.cpp name: nothing in the file to check it against
            continue
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{path} has no {name}, which its metadata's {config['model_type']} model has")
        ne = tuple(int(n) for n in tensor.shape[:2])  # ggml order: [in, out]
        if ne != g.dims:
            raise ModelLoadError(f"{path}: {name} has ne {list(ne)}, but its metadata make "
                                 f"{target} a {g.input_dims}->{g.output_dims} linear")
    try:
        from ..models.gguf_cache import describe

        conversion = describe(f, dtype)
    except (OSError, ValueError) as e:
        conversion = f"unknown ({e})"
    return ModelShape(path=path, config=config, geometry=geometry, memory=memory, conversion=conversion)
