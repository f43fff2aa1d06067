"""Adapters in mlx-lm's own format (what ``mlx_lm.lora`` writes):

    adapter_config.json   {"fine_tune_type": "lora", "num_layers": N,
                           "lora_parameters": {"rank", "scale", "dropout", "keys"}}
    adapters.safetensors  model.layers.3.self_attn.q_proj.lora_a  [in, r]
                          model.layers.3.self_attn.q_proj.lora_b  [r, out]

mlx-vlm's trainer (``mlx_vlm.train``) writes the same, its paths under
``language_model.`` (read as mola lays a vision model out: language_path).

delta(x) = scale * (x @ lora_a) @ lora_b, as mlx-lm's LoRALinear computes it.
An activated LoRA's config also holds ``alora_invocation_tokens`` (PEFT's name).
A DoRA adapter (``fine_tune_type: dora``, mlx-lm's DoRALinear) also stores
``<module>.m`` [out], its magnitude (mola.adapters.dora).

The experts of a mixture of experts (mlx-lm's LoRASwitchLinear) store
lora_a [E, r, in] and lora_b [E, out, r]; they are read as a [E, in, r] and
b [E, r, out] (see weights.ModuleLoRA).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import mlx.core as mx

from ...errors import InvalidAdapter
from .common import CONFIG_FILE, language_path, read_config
from ..host_safetensors import read_safetensors_file
from ..dora import take_magnitudes
from ..weights import LoRAWeights, ModuleLoRA, alora_tokens, with_invocation

WEIGHTS_FILE = "adapters.safetensors"
MAGNITUDE_KEY = re.compile(r"^(?P<module>.+)\.m$")  # DoRALinear's magnitude


def is_mlx_lm_adapter(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def adapter_scale(config: dict, where: Path) -> float:
    fine_tune_type = config.get("fine_tune_type", "lora")
    if fine_tune_type not in ("lora", "dora"):
        raise InvalidAdapter(
            f"Adapter at {where} has fine_tune_type '{fine_tune_type}'; mola serves "
            "LoRA and DoRA adapters only (a 'full' fine-tune is a separate model)."
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise InvalidAdapter(f"{where / CONFIG_FILE} lacks a 'lora_parameters' object.")
    scale = params.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InvalidAdapter(
            f"{where / CONFIG_FILE}: lora_parameters.scale must be a number, got {scale!r}."
        )
    if not math.isfinite(scale):
        raise InvalidAdapter(f"{where / CONFIG_FILE}: lora_parameters.scale is {scale}.")
    return float(scale)


def read_mlx_lm_adapter(path: Path, dtype: mx.Dtype | None = None) -> LoRAWeights:
    """Read (and evaluate) an mlx-lm adapter directory. Shapes are checked
    against the model later, by :func:`mola.adapters.weights.validate`."""
    config = read_config(path)
    scale = adapter_scale(config, path)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise InvalidAdapter(f"Adapter at {path} has no {WEIGHTS_FILE}.")
    tensors = read_safetensors_file(str(weights_file))  # on the host (mola.adapters.host_safetensors)
    try:
        tensors = mx.load(str(weights_file)) if tensors is None else tensors
    except Exception as e:  # mlx raises RuntimeError/ValueError for bad files
        raise InvalidAdapter(f"{weights_file} is not a readable safetensors file: {e}")
    weights = mlx_lm_weights(tensors, scale, str(path), str(weights_file), dtype, is_dora(config))
    return with_invocation(weights, alora_tokens(config, path / CONFIG_FILE))


def is_dora(config: dict) -> bool:
    return config.get("fine_tune_type") == "dora"


def mlx_lm_weights(tensors: dict[str, mx.array], scale: float, source: str, weights_file: str,
                   dtype: mx.Dtype | None = None, dora: bool = False) -> LoRAWeights:
    """mlx-lm's factors (``module.lora_a`` [in, r] / ``module.lora_b`` [r, out],
    as its LoRALinear names them) at one ``scale``, as LoRAWeights, with
    ``dora`` also each module's magnitude ``module.m`` [out]; InvalidAdapter
    naming ``weights_file`` for anything else."""
    magnitudes = None
    if dora:
        tensors, magnitudes = take_magnitudes(tensors, MAGNITUDE_KEY)
        if not magnitudes:
            raise InvalidAdapter(f"{weights_file} holds no DoRA magnitudes ('<module>.m'), though its config's "
                                 "fine_tune_type is 'dora'.")
    pairs: dict[str, dict[str, mx.array]] = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b") or not module:
            hint = " (a DoRA magnitude, but the config's fine_tune_type is not 'dora')" if leaf == "m" else ""
            raise InvalidAdapter(
                f"{weights_file} holds '{key}', which is not a LoRA factor "
                f"(expected keys ending in .lora_a / .lora_b){hint}."
            )
        pairs.setdefault(language_path(module, weights_file), {})[leaf] = value
    modules = {}
    for module, factors in sorted(pairs.items()):
        if set(factors) != {"lora_a", "lora_b"}:
            missing = ({"lora_a", "lora_b"} - set(factors)).pop()
            raise InvalidAdapter(f"{weights_file}: {module} has no {missing}.")
        a, b = factors["lora_a"], factors["lora_b"]
        if a.ndim == 3 and b.ndim == 3:  # LoRASwitchLinear: [E, r, in] and [E, out, r]
            a, b = a.swapaxes(1, 2), b.swapaxes(1, 2)
        if dtype is not None:
            a, b = a.astype(dtype), b.astype(dtype)
        modules[module] = ModuleLoRA(a=a, b=b, scale=scale)
    try:
        mx.eval([(m.a, m.b) for m in modules.values()], magnitudes or {})
    except Exception as e:
        raise InvalidAdapter(f"{weights_file} could not be read: {e}") from None
    return LoRAWeights(source=source, format="mlx-lm", modules=modules, magnitudes=magnitudes)
