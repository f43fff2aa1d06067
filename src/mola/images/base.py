"""The resident image base: an mflux FLUX.2-klein model, loaded through mflux's own
constructor, its LoRA target linears wrapped in mola's multi-LoRA layer.

What the model is comes from its directory: an mflux-saved FLUX.2-klein
(``mflux-save``: vae/, transformer/, text_encoder/, tokenizer/) is FLUX.2-klein-4B,
unless a ``mola_image.json`` beside them says otherwise::

    {"base": "flux2-klein-9b"}                 # another mflux FLUX.2 config
    {"transformer": {...}, "text_encoder": {...},  # ModelConfig overrides (a small model)
     "vae_block_out_channels": [32, 32, 32, 32]}   # the VAE's widths (mflux's: 128, 256, 512, 512)

A PATH that is not a directory is an mflux model name (``flux2-klein-4b``), fetched by mflux.

mflux keeps its compute dtype in a class attribute, ``ModelConfig.precision``,
read while loading and at every step: one per process, set here from
--image-dtype. Everything here runs on the image worker thread.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import ModelLoadError
from ..lora.routing import LoRARouting
from .lora import DiffusionLoRALinear

SIDECAR = "mola_image.json"
MFLUX_VERSION = "0.24.0"  # the mflux this code follows (pinned: docs/images.md)
DEFAULT_BASE = "flux2-klein-4b"


@dataclass
class ImageBase:
    """The loaded model and mola's layers in it (worker thread only)."""

    model: nn.Module  # mflux's Flux2Klein
    routing: LoRARouting  # which slot each row uses, read by every layer
    layers: dict[str, DiffusionLoRALinear]  # module path in model.transformer -> its layer
    mapping: list  # mflux's Flux2LoRAMapping targets (what read_lora matches keys against)
    num_slots: int  # slot 0 included
    max_rank: int


def import_mflux():
    """mflux, or ModelLoadError saying how to install it."""
    try:
        import mflux
    except ImportError as e:
        raise ModelLoadError(f"images need mflux ({e}): pip install -e '.[images]' && "
                             f"pip install --no-deps mflux=={MFLUX_VERSION} (docs/images.md)") from None
    version = getattr(mflux, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version
        version = dist_version("mflux")
    if version != MFLUX_VERSION:
        raise ModelLoadError(f"images follow mflux {MFLUX_VERSION}; this environment has mflux {version}")
    return mflux


def model_config(path: str):
    """(mflux ModelConfig, VAE widths or None, local directory or None) for ``path``."""
    from mflux.models.common.config.model_config import ModelConfig

    root = Path(path).expanduser()
    if not root.is_dir():
        try:
            return ModelConfig.from_name(path), None, None
        except Exception as e:  # mflux's InvalidBaseModel and friends
            raise ModelLoadError(f"the image model {path!r} is neither a directory nor an mflux model name: "
                                 f"{e}") from None
    sidecar = root / SIDECAR
    spec = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    config = ModelConfig.from_name(spec.get("base", DEFAULT_BASE))
    if "transformer" in spec or "text_encoder" in spec:
        config = ModelConfig(
            priority=999, aliases=[root.name], model_name=root.name, base_model=None, controlnet_model=None,
            custom_transformer_model=None, num_train_steps=config.num_train_steps,
            max_sequence_length=config.max_sequence_length, supports_guidance=config.supports_guidance,
            requires_sigma_shift=config.requires_sigma_shift,
            transformer_overrides=spec.get("transformer"), text_encoder_overrides=spec.get("text_encoder"))
    widths = spec.get("vae_block_out_channels")
    return config, (tuple(widths) if widths else None), str(root)


@contextlib.contextmanager
def vae_widths(widths: tuple[int, ...] | None):
    """While loading: mflux's initializer builds a FLUX.2 VAE of these block widths
    (it always builds the full-size one; no constructor argument reaches it)."""
    if widths is None:
        yield
        return
    import mflux.models.flux2.flux2_initializer as initializer
    from mflux.models.flux2.model.flux2_vae.decoder.decoder import Flux2Decoder
    from mflux.models.flux2.model.flux2_vae.encoder.encoder import Flux2Encoder
    from mflux.models.flux2.model.flux2_vae.vae import Flux2VAE

    class SizedFlux2VAE(Flux2VAE):  # same module names: mflux's weight loader fills it
        def __init__(self, decoder_block_out_channels=widths):
            super().__init__(decoder_block_out_channels=widths)
            self.encoder = Flux2Encoder(block_out_channels=widths)
            self.decoder = Flux2Decoder(block_out_channels=widths)

    original = initializer.Flux2VAE
    initializer.Flux2VAE = SizedFlux2VAE
    try:
        yield
    finally:
        initializer.Flux2VAE = original


def load_mflux(path: str, dtype: str = "bfloat16", lora_paths: list[str] | None = None,
               lora_scales: list[float] | None = None, bake_lora: bool = True) -> nn.Module:
    """mflux's own Flux2Klein for ``path``, LoRAs applied its way (the reference the tests compare with)."""
    import_mflux()
    from mflux.models.common.config.model_config import ModelConfig
    from mflux.models.flux2.variants.txt2img.flux2_klein import Flux2Klein

    ModelConfig.precision = getattr(mx, dtype)
    config, widths, local = model_config(path)
    try:
        with vae_widths(widths):
            return Flux2Klein(model_path=local, model_config=config, lora_paths=lora_paths,
                              lora_scales=lora_scales, bake_lora=bake_lora)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"could not load the image model {path!r}: {type(e).__name__}: {e}") from None


def load_image_base(path: str, dtype: str, num_slots: int, max_rank: int) -> ImageBase:
    """The resident base: ``path`` loaded, every LoRA target linear of its transformer
    wrapped with ``num_slots`` slots (slot 0: no LoRA) of rank up to ``max_rank``."""
    from mflux.models.flux2.weights.flux2_lora_mapping import Flux2LoRAMapping

    model = load_mflux(path, dtype)
    mapping = Flux2LoRAMapping.get_mapping()
    routing = LoRARouting(sort_threshold=None)
    layers = {}
    for name in target_paths(model.transformer, mapping):
        *parents, last = name.split(".")
        parent = model.transformer
        for part in parents:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        layer = DiffusionLoRALinear.wrap(_child(parent, last), routing, num_slots, max_rank)
        if last.isdigit():
            parent[int(last)] = layer
        else:
            setattr(parent, last, layer)
        layers[name] = layer
    mx.eval(model.parameters())
    return ImageBase(model, routing, layers, mapping, num_slots, max_rank)


def target_paths(transformer: nn.Module, mapping: list) -> list[str]:
    """The module paths mflux's LoRA mapping can reach that are linears of this transformer."""
    linears = {name for name, m in transformer.named_modules() if type(m) is nn.Linear}
    found = []
    for target in mapping:
        template = target.model_path
        names = [n for n in linears if _matches(template, n)] if "{block}" in template else [template]
        found += [n for n in names if n in linears and n not in found]
    return sorted(found)


def _matches(template: str, name: str) -> bool:
    head, _, tail = template.partition("{block}")
    middle = name[len(head):len(name) - len(tail)] if name.startswith(head) and name.endswith(tail) else ""
    return middle.isdigit()


def _child(parent: nn.Module, key: str) -> nn.Module:
    return parent[int(key)] if key.isdigit() else getattr(parent, key)
