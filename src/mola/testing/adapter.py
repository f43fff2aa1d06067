"""Write random LoRA adapters in mlx-lm's format, for tests and benchmarks.

B is non-zero (unlike a freshly initialised trainable LoRA), so the adapter
changes the model's outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..adapters.weights import LoRAWeights, ModuleLoRA
from ..models.metadata import read_model_config

DEFAULT_KEYS = ("self_attn.q_proj", "self_attn.v_proj")


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(input_dims, output_dims) of each llama-style block linear (and phi3's fused ones)."""
    h = config["hidden_size"]
    i = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    if config.get("model_type") == "phi3":  # fused q/k/v and gate/up
        return {
            "self_attn.qkv_proj": (h, (heads + 2 * kv_heads) * head_dim),
            "self_attn.o_proj": (heads * head_dim, h),
            "mlp.gate_up_proj": (h, 2 * i),
            "mlp.down_proj": (i, h),
        }
    return {
        "self_attn.q_proj": (h, heads * head_dim),
        "self_attn.k_proj": (h, kv_heads * head_dim),
        "self_attn.v_proj": (h, kv_heads * head_dim),
        "self_attn.o_proj": (heads * head_dim, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }


def random_lora(
    model_path: str | Path,
    *,
    rank: int = 8,
    keys: tuple[str, ...] = DEFAULT_KEYS,
    num_layers: int | None = None,
    scale: float = 2.0,
    std: float = 0.2,
    seed: int = 0,
) -> LoRAWeights:
    """A random adapter for the model at ``model_path``, on the last
    ``num_layers`` blocks (all when None)."""
    config = read_model_config(Path(model_path))
    total = config["num_hidden_layers"]
    num_layers = total if num_layers is None else min(num_layers, total)
    shapes = linear_shapes(config)
    rng = np.random.default_rng(seed)
    modules = {}
    for layer in range(total - num_layers, total):
        for key in keys:
            if key not in shapes:
                raise ValueError(f"unknown LoRA key {key!r}; known: {sorted(shapes)}")
            in_dims, out_dims = shapes[key]
            a = rng.normal(0.0, 1.0 / np.sqrt(in_dims), (in_dims, rank))
            b = rng.normal(0.0, std, (rank, out_dims))
            modules[f"model.layers.{layer}.{key}"] = ModuleLoRA(
                a=mx.array(a.astype(np.float32)), b=mx.array(b.astype(np.float32)), scale=scale
            )
    return LoRAWeights(source="random", format="mlx-lm", modules=modules)


def save_mlx_lm_adapter(
    path: str | Path, weights: LoRAWeights, *, num_layers: int, keys: tuple[str, ...] | None = None
) -> Path:
    """Write ``weights`` as an mlx-lm adapter directory (one shared scale)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    scale = weights.scale
    if scale is None:
        raise ValueError("mlx-lm's format holds one scale per adapter")
    tensors = {}
    for module, m in weights.modules.items():
        tensors[f"{module}.lora_a"] = m.a
        tensors[f"{module}.lora_b"] = m.b
    mx.save_safetensors(str(path / "adapters.safetensors"), tensors)
    config = {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": {
            "rank": weights.rank,
            "scale": scale,
            "dropout": 0.0,
            "keys": sorted(keys) if keys else sorted({m.split(".", 3)[3] for m in weights.modules}),
        },
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def make_random_adapter(path: str | Path, model_path: str | Path, **options) -> Path:
    """Write :func:`random_lora` (``model_path``, ``options``) as an mlx-lm
    adapter directory at ``path``."""
    weights = random_lora(model_path, **options)
    num_layers = len({module.split(".")[2] for module in weights.modules})
    return save_mlx_lm_adapter(path, weights, num_layers=num_layers, keys=options.get("keys", DEFAULT_KEYS))


def make_mlx_lm_lora(
    path: str | Path,
    model_path: str | Path,
    *,
    rank: int = 8,
    keys: tuple[str, ...] | None = None,
    num_layers: int | None = None,
    scale: float = 2.0,
    std: float = 0.2,
    seed: int = 0,
    fine_tune_type: str = "lora",
) -> Path:
    """Write an adapter the way mlx-lm's tuner does: its own
    ``linear_to_lora_layers`` wraps the model (``keys`` None: mlx-lm's default
    keys, every linear of a block, the experts' SwitchLinears included), the
    factors are drawn at random (B non-zero) and the trainable parameters are
    saved as ``mlx_lm.lora`` saves them. ``fine_tune_type`` "dora": mlx-lm's
    DoRALinear, its magnitudes m drawn around their start (the base's row norms)."""
    return make_mlx_lm_loras([(path, seed)], model_path, rank=rank, keys=keys, num_layers=num_layers,
                             scale=scale, std=std, fine_tune_type=fine_tune_type)[0]


def make_mlx_lm_loras(
    paths_and_seeds: list[tuple[str | Path, int]],
    model_path: str | Path,
    *,
    rank: int = 8,
    keys: tuple[str, ...] | None = None,
    num_layers: int | None = None,
    scale: float = 2.0,
    std: float = 0.2,
    fine_tune_type: str = "lora",
) -> list[Path]:
    """make_mlx_lm_lora for several adapters of one model (loaded once), one
    seed each."""
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(model_path))
    total = len(model.layers)
    num_layers = total if num_layers is None else min(num_layers, total)
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = list(keys)
    linear_to_lora_layers(model, num_layers, params, use_dora=fine_tune_type == "dora")
    out = []
    for path, seed in paths_and_seeds:
        rng = np.random.default_rng(seed)

        def draw(p: str, w: mx.array) -> mx.array:
            if p.endswith(".m"):  # DoRA's magnitude: its start (the row norms), each moved up to 30 %
                return w * mx.array(rng.uniform(0.7, 1.3, w.shape).astype(np.float32)).astype(w.dtype)
            fan_in = w.shape[-1] if p.endswith("lora_a") else w.shape[-2]
            sd = 1.0 / np.sqrt(fan_in) if p.endswith("lora_a") else std
            return mx.array(rng.normal(0.0, sd, w.shape).astype(np.float32)).astype(w.dtype)

        model.update(tree_map_with_path(draw, model.trainable_parameters()))
        weights = dict(tree_flatten(model.trainable_parameters()))
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(path / "adapters.safetensors"), weights)
        modules = sorted({k.split(".", 3)[3].rsplit(".", 1)[0] for k in weights})
        config = {"fine_tune_type": fine_tune_type, "num_layers": num_layers,
                  "lora_parameters": {**params, "keys": modules}}
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
        out.append(path)
    return out
