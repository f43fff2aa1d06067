"""A base model's LoRA targets, offline and without reading its weights.

mlx-lm's own loader builds the model lazily (``load_model(lazy=True)``):
``mx.load`` reads only the safetensors headers, and nothing is evaluated, so
the weights stay on disk while the module tree, the shapes (a quantized
linear's packed ones included) and the dtypes are exactly those mola serve
would wrap (``pack.geometry_of``, the function ``AdapterPacks.install``
shares). Unknown architectures are refused by mlx-lm, naming the type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..engine.loader import ModelLoadError, resolve_model_path
from ..lora.pack import SlotGeometry, geometry_of


@dataclass(frozen=True)
class ModelShape:
    path: Path  # resolved
    config: dict  # config.json as mlx-lm reads it (what adapters are read against)
    geometry: SlotGeometry  # what an adapter must fit

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    @property
    def num_layers(self) -> int:
        return len({p.split(".")[2] for p in self.geometry.targets})


def model_shape(model: str, max_rank: int) -> ModelShape:
    """The LoRA targets of ``model`` (a directory or a hub id, through the
    hub's cache); ModelLoadError naming the problem."""
    from mlx_lm.utils import load_model

    path = resolve_model_path(model)
    try:
        module, config = load_model(path, lazy=True)
        geometry = geometry_of(module, max_rank, num_slots=2)
    except Exception as e:  # unknown model types, missing or mismatched weights
        raise ModelLoadError(f"mlx-lm could not load the model at {path}: {e}") from None
    return ModelShape(path=path, config=config, geometry=geometry)
