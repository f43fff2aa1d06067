"""Write LoRA adapters in Hugging Face PEFT's format (what
``PeftModel.save_pretrained`` writes), for tests and devtools: an mlx-lm adapter's
PEFT twin has the same delta on every module.

    adapter_config.json        {"peft_type": "LORA", "r", "lora_alpha", "target_modules", ...}
    adapter_model.safetensors  base_model.model.<module>.lora_A.weight  [r, in]   (= a.T)
                               base_model.model.<module>.lora_B.weight  [out, r]  (= b.T)

Mixture-of-experts adapters (expert modules at mlx-lm SwitchLinear paths) are
written in either of PEFT's two layouts for them (see
mola/adapters/formats/peft_expert_paths.py for the layouts and their sources):
``save_peft_per_expert_adapter`` (one linear per expert, transformers 4) and
``save_peft_expert_params_adapter`` (``target_parameters`` on transformers 5's
3-D expert parameters).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..adapters.formats.peft import CONFIG_FILE, PREFIX, WEIGHTS_FILE
from ..adapters.formats.peft_config import module_scale, targets_module
from ..adapters.formats.peft_expert_paths import LAYOUTS
from ..adapters.weights import LoRAWeights, ModuleLoRA


@dataclass(frozen=True)
class _Entry:
    """One LoRA as PEFT saves it."""

    key: str  # what rank_pattern / alpha_pattern match: the module, or a ParamWrapper's parameter
    module: str  # the name its factors are saved under
    lora_a: mx.array  # [r, in], or [r*E, in] for an expert parameter
    lora_b: mx.array  # [out, r], or [out, r*E]
    rank: int
    scale: float


def _alpha_for(scale: float, r: int, use_rslora: bool) -> float:
    """The lora_alpha that gives ``scale`` at rank ``r``."""
    alpha = scale * (math.sqrt(r) if use_rslora else r)
    return int(alpha) if float(alpha).is_integer() else alpha


def _config(target_modules, base_model_name_or_path, use_rslora, layers_to_transform=None) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
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
    }


def _write(path: Path, entries: list[_Entry], config: dict, r: int | None, lora_alpha: float | None,
           dtype: mx.Dtype, magnitudes: dict[str, mx.array] | None = None) -> Path:
    """Set r / lora_alpha (the most common rank, and the alpha of the most
    common scale at it) and the rank_pattern / alpha_pattern entries that keep
    every other LoRA exact, and write the directory."""
    use_rslora = config["use_rslora"]
    ranks = Counter(e.rank for e in entries)
    if r is None:
        r = max(ranks, key=lambda k: (ranks[k], k))
    if lora_alpha is None:
        scales = Counter(e.scale for e in entries if e.rank == r) or Counter(e.scale for e in entries)
        lora_alpha = _alpha_for(max(scales, key=lambda k: (scales[k], k)), r, use_rslora)
    config.update(r=r, lora_alpha=lora_alpha, rank_pattern={}, alpha_pattern={})
    for e in sorted(entries, key=lambda e: e.key):
        if e.rank != r:
            config["rank_pattern"][e.key] = e.rank
        _, scale = module_scale(config, e.key)
        if not math.isclose(scale, e.scale, rel_tol=1e-12):
            config["alpha_pattern"][e.key] = _alpha_for(e.scale, e.rank, use_rslora)
    tensors = {}
    for e in entries:
        tensors[f"{PREFIX}{e.module}.lora_A.weight"] = mx.contiguous(e.lora_a.astype(dtype))
        tensors[f"{PREFIX}{e.module}.lora_B.weight"] = mx.contiguous(e.lora_b.astype(dtype))
    for module, m in (magnitudes or {}).items():  # DoRA (use_dora: true)
        tensors[f"{PREFIX}{module}.lora_magnitude_vector"] = mx.contiguous(m.astype(dtype))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / WEIGHTS_FILE), tensors, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path


def _linear(key: str, module: str, m: ModuleLoRA) -> _Entry:
    return _Entry(key, module, m.a.T, m.b.T, m.rank, m.scale)  # [r, in], [out, r]


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
    """Write ``weights`` (linears only) as a PEFT LoRA adapter directory.

    ``r`` defaults to the most common module rank; ``lora_alpha`` defaults to
    the value that gives the most common module scale at that rank
    (``scale * r``, or ``scale * sqrt(r)`` with ``use_rslora``). Modules whose
    rank or scale differs get ``rank_pattern`` / ``alpha_pattern`` entries
    (their full path), so the written adapter equals ``weights`` exactly
    whatever ``r`` and ``lora_alpha`` are. ``target_modules`` defaults to the
    modules' last names (``["q_proj", "v_proj"]``); a given one (or
    ``layers_to_transform``) must still target every module of ``weights``.
    A DoRA adapter (``weights.magnitudes``) is written with ``use_dora: true``.
    """
    if not weights.modules:
        raise ValueError("no modules to write")
    experts = sorted(p for p, m in weights.modules.items() if m.num_experts)
    if experts:
        raise ValueError(f"{experts[0]} holds experts: write it with save_peft_per_expert_adapter "
                         "or save_peft_expert_params_adapter")
    if target_modules is None:
        target_modules = sorted({p.rpartition(".")[2] for p in weights.modules})
    config = _config(target_modules, base_model_name_or_path, use_rslora, layers_to_transform)
    config["use_dora"] = bool(weights.magnitudes)
    for module in sorted(weights.modules):
        if not targets_module(config, module):
            raise ValueError(
                f"target_modules {target_modules!r} / layers_to_transform "
                f"{layers_to_transform!r} do not target {module}"
            )
    entries = [_linear(p, p, m) for p, m in weights.modules.items()]
    return _write(Path(path), entries, config, r, lora_alpha, dtype, weights.magnitudes)


# ---- mixtures of experts ------------------------------------------------------------------


def _expert_path(layout, path: str) -> tuple[str, str] | None:
    """(model.layers.N, projection) of an mlx-lm expert SwitchLinear path."""
    m = re.fullmatch(rf"(model\.layers\.\d+)\.{layout.mlx_block}\.{layout.mlx_experts}\.(\w+)", path)
    return (m[1], m[2]) if m else None


def save_peft_per_expert_adapter(path: str | Path, weights: LoRAWeights, model_type: str, **kwargs) -> Path:
    """Write an mlx-lm MoE adapter as PEFT on transformers 4's per-expert linears:
    expert K of ``model.layers.N.block_sparse_moe.switch_mlp.gate_proj`` becomes
    ``model.layers.N.block_sparse_moe.experts.K.w1`` (lora_A = a[K].T [r, in],
    lora_B = b[K].T [out, r]) for mixtral, ``mlp.experts.K.gate_proj`` for the
    Qwen MoEs; every other module keeps its name. ``kwargs`` go to
    :func:`save_peft_adapter` (target_modules defaults to the last names:
    w1, w2, w3, gate, q_proj, ...)."""
    layout = LAYOUTS[model_type]
    if layout.per_expert_block is None:
        raise ValueError(f"transformers never stored {model_type}'s experts as one linear each")
    name_of = {proj: name for name, proj in layout.per_expert.items()}
    modules = {}
    for p, m in weights.modules.items():
        expert = _expert_path(layout, p) if m.num_experts else None
        if expert is None:
            modules[p] = m
            continue
        layer, proj = expert
        for k in range(m.num_experts):
            name = f"{layer}.{layout.per_expert_block}.experts.{k}.{name_of[proj]}"
            modules[name] = ModuleLoRA(a=m.a[k], b=m.b[k], scale=m.scale)  # [in, r], [r, out]
    return save_peft_adapter(path, LoRAWeights(weights.source, "peft", modules), **kwargs)


def _fuse_gate_up(gate: ModuleLoRA | None, up: ModuleLoRA | None, interleaved: bool) -> ModuleLoRA:
    """gate_up_proj's LoRA from gate's and up's (expert modules): A shared when
    theirs are equal, else side by side with B block-diagonal, as PEFT converts
    per-expert LoRA for transformers 5 (transformers_weight_conversion.py
    ``PeftConcatenate``); B's columns [gate; up], or interleaved for gpt-oss."""
    present = [m for m in (gate, up) if m is not None]
    scale = present[0].scale
    width = present[0].b.shape[2]
    if gate is not None and up is not None and gate.scale == up.scale and mx.array_equal(gate.a, up.a):
        a, b_gate, b_up = gate.a, gate.b, up.b  # [E, in, r], [E, r, I] x2
    else:
        a = mx.concatenate([m.a for m in present], axis=2)  # [E, in, r_gate + r_up]
        blocks = []
        for m in (gate, up):
            if m is None:
                blocks.append(None)
                continue
            b = m.b if m.scale == scale else m.b * (m.scale / scale)
            rows = [b if n is m else mx.zeros((b.shape[0], n.rank, width), b.dtype) for n in present]
            blocks.append(mx.concatenate(rows, axis=1))  # [E, r_gate + r_up, I]
        zero = mx.zeros((a.shape[0], a.shape[2], width), a.dtype)
        b_gate, b_up = (blk if blk is not None else zero for blk in blocks)
    if interleaved:  # column 2j is gate j, 2j + 1 up j
        b = mx.stack([b_gate, b_up], axis=-1).reshape(*b_gate.shape[:2], 2 * width)
    else:
        b = mx.concatenate([b_gate, b_up], axis=2)  # [E, r, 2I]
    return ModuleLoRA(a=a, b=b, scale=scale)


def _expert_param(key: str, module: str, m: ModuleLoRA) -> _Entry:
    """A 3-D ParamWrapper's factors: lora_A [r*E, in] expert-major, lora_B
    [out, r*E] expert-minor (PEFT's ParamWrapper.get_delta_weight reshapes)."""
    experts, in_dims, r = m.a.shape
    out_dims = m.b.shape[2]
    lora_a = m.a.transpose(0, 2, 1).reshape(experts * r, in_dims)
    lora_b = m.b.transpose(2, 1, 0).reshape(out_dims, r * experts)
    return _Entry(key, module, lora_a, lora_b, r, m.scale)


def save_peft_expert_params_adapter(
    path: str | Path, weights: LoRAWeights, model_type: str, *, dtype: mx.Dtype = mx.float32,
    use_rslora: bool = False, base_model_name_or_path: str | None = None,
) -> Path:
    """Write an mlx-lm MoE adapter as PEFT on transformers 5's modules: each
    layer's experts as ``target_parameters`` ``mlp.experts.gate_up_proj`` (gate
    and up fused, :func:`_fuse_gate_up`) and ``mlp.experts.down_proj`` -- the
    first nested inside the second, so saved under ``mlp.experts.base_layer``
    when both are targeted -- the router as ``mlp.gate.weight``
    (``mlp.router.weight`` for gpt-oss; mixtral's block_sparse_moe is mlp), and
    every other linear through ``target_modules``."""
    layout = LAYOUTS[model_type]
    router = "router" if model_type == "gpt_oss" else "gate"
    experts: dict[str, dict[str, ModuleLoRA]] = {}
    entries, plain, routers = [], [], False
    for p, m in sorted(weights.modules.items()):
        expert = _expert_path(layout, p) if m.num_experts else None
        if expert is not None:
            experts.setdefault(expert[0], {})[expert[1]] = m
        elif re.fullmatch(rf"model\.layers\.\d+\.{layout.mlx_block}\.{router}", p):
            module = p.replace(f".{layout.mlx_block}.", ".mlp.")
            entries.append(_linear(f"{module}.weight", module, m))  # a 2-D ParamWrapper
            routers = True
        else:
            entries.append(_linear(p, p, m))
            plain.append(p)
    params = sorted({"gate_up_proj" if proj != "down_proj" else "down_proj"
                     for projs in experts.values() for proj in projs})
    for layer, projs in experts.items():
        module = f"{layer}.mlp.experts"
        if "gate_proj" in projs or "up_proj" in projs:
            fused = _fuse_gate_up(projs.get("gate_proj"), projs.get("up_proj"), layout.interleaved)
            inner = f"{module}.base_layer" if len(params) == 2 else module  # registered before down_proj
            entries.append(_expert_param(f"{module}.gate_up_proj", inner, fused))
        if "down_proj" in projs:
            entries.append(_expert_param(f"{module}.down_proj", module, projs["down_proj"]))
    target_parameters = [f"mlp.experts.{p}" for p in params]
    if routers:
        target_parameters.append(f"mlp.{router}.weight")
    config = _config(sorted({p.rpartition(".")[2] for p in plain}), base_model_name_or_path, use_rslora)
    config["target_parameters"] = target_parameters
    return _write(Path(path), entries, config, None, None, dtype)
