"""Write LoRA adapters in Hugging Face PEFT's format (what
``PeftModel.save_pretrained`` writes), for tests and devtools: an mlx-lm adapter's
PEFT twin has the same delta on every module.

    adapter_config.json        {"peft_type": "LORA", "r", "lora_alpha", "target_modules", ...}
    adapter_model.safetensors  base_model.model.<module>.lora_A.weight  [r, in]   (= a.T)
                               base_model.model.<module>.lora_B.weight  [out, r]  (= b.T)
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import mlx.core as mx

from ..lora.formats.peft import CONFIG_FILE, PREFIX, WEIGHTS_FILE, module_scale, targets_module
from ..lora.weights import LoRAWeights


def _alpha_for(scale: float, r: int, use_rslora: bool) -> float:
    """The lora_alpha that gives ``scale`` at rank ``r``."""
    alpha = scale * (math.sqrt(r) if use_rslora else r)
    return int(alpha) if float(alpha).is_integer() else alpha


def save_peft_adapter(
    path: str | Path,
    weights: LoRAWeights,
    *,
    r: int | None = None,
    lora_alpha: float | None = None,
    use_rslora: bool = False,
    target_modules: list[str] | str | None = None,
    layers_to_transform: list[int] | int | None = None,
    dtype: mx.Dtype = mx.float32,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``weights`` as a PEFT LoRA adapter directory.

    ``r`` defaults to the most common module rank; ``lora_alpha`` defaults to
    the value that gives the most common module scale at that rank
    (``scale * r``, or ``scale * sqrt(r)`` with ``use_rslora``). Modules whose
    rank or scale differs get ``rank_pattern`` / ``alpha_pattern`` entries
    (their full path), so the written adapter equals ``weights`` exactly
    whatever ``r`` and ``lora_alpha`` are. ``target_modules`` defaults to the
    modules' last names (``["q_proj", "v_proj"]``); a given one (or
    ``layers_to_transform``) must still target every module of ``weights``.
    """
    path = Path(path)
    if not weights.modules:
        raise ValueError("no modules to write")
    ranks = Counter(m.rank for m in weights.modules.values())
    if r is None:
        r = max(ranks, key=lambda k: (ranks[k], k))
    if lora_alpha is None:
        scales = Counter(
            m.scale for m in weights.modules.values() if m.rank == r
        ) or Counter(m.scale for m in weights.modules.values())
        lora_alpha = _alpha_for(max(scales, key=lambda k: (scales[k], k)), r, use_rslora)
    if target_modules is None:
        target_modules = sorted({p.rpartition(".")[2] for p in weights.modules})

    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "use_rslora": use_rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "target_modules": target_modules,
        "layers_to_transform": layers_to_transform,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    for module, m in sorted(weights.modules.items()):
        if not targets_module(config, module):
            raise ValueError(
                f"target_modules {target_modules!r} / layers_to_transform "
                f"{layers_to_transform!r} do not target {module}"
            )
        if m.rank != r:
            config["rank_pattern"][module] = m.rank
        _, scale = module_scale(config, module)
        if not math.isclose(scale, m.scale, rel_tol=1e-12):
            config["alpha_pattern"][module] = _alpha_for(m.scale, m.rank, use_rslora)

    tensors = {}
    for module, m in weights.modules.items():
        tensors[f"{PREFIX}{module}.lora_A.weight"] = mx.contiguous(m.a.T.astype(dtype))
        tensors[f"{PREFIX}{module}.lora_B.weight"] = mx.contiguous(m.b.T.astype(dtype))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / WEIGHTS_FILE), tensors, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path
