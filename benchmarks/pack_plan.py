"""Slot packs at start (sized at the ceilings, as before issue 43) against
packs sized to the adapters loaded, from the plan code alone (no weights
read): SlotGeometry.max_pack_bytes and SlotGeometry.pack_bytes.

    python benchmarks/pack_plan.py

A Qwen3-8B-shaped model (36 blocks, 4096 / 12288, 32 / 8 heads), 4-bit with
float16 scales as mlx-community ships it (so the packs are float16), is built
lazily (nothing is evaluated), with the defaults --max-loras 8 and
--max-lora-rank 64, and several sets of adapters loaded.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
ALL = ATTENTION + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
WEIGHTS_GB = 4.6  # Qwen3-8B-4bit's safetensors


def qwen3_8b() -> nn.Module:
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                           num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-6, vocab_size=151936,
                           max_position_embeddings=40960, rope_theta=1e6, head_dim=128, tie_word_embeddings=False)
    model = qwen3.Model(args)
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=64, bits=4)
    return model


def main() -> int:
    from mola.lora.pack import geometry_of

    g = geometry_of(qwen3_8b(), max_rank=64, num_slots=8 + 1)
    blocks = range(36)

    def paths(keys):
        return [f"model.layers.{i}.{k}" for i in blocks for k in keys]

    cases = {
        "eight rank-16 adapters, all linears": [(16, paths(ALL))] * 8,
        "eight rank-8 adapters, q/k/v/o": [(8, paths(ATTENTION))] * 8,
        "one rank-16 adapter, all linears": [(16, paths(ALL))],
        "no adapter": [],
    }
    print(f"packs' dtype {g.dtype}; weights {WEIGHTS_GB} GB")
    print(f"  {'at start, sized at the ceilings (before)':<44} {g.max_pack_bytes / 1e9:6.2f} GB "
          f"({g.max_pack_bytes / 1e9 / WEIGHTS_GB:.0%} of the weights)")
    for name, adapters in cases.items():
        n = g.pack_bytes(adapters)
        print(f"  {name + ' (after)':<44} {n / 1e9:6.2f} GB ({n / 1e9 / WEIGHTS_GB:.0%} of the weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
