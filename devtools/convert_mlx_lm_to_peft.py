"""Convert an mlx-lm-format LoRA adapter directory into a Hugging Face PEFT one
(adapter_config.json + adapter_model.safetensors) with the same delta.

    python devtools/convert_mlx_lm_to_peft.py SRC OUT [--rslora] [--dtype float32]
        [--base-model NAME_OR_PATH] [--moe MODEL_TYPE --moe-layout per-expert|fused]

An adapter with LoRA on the experts of a mixture of experts needs --moe (the
base's mlx-lm model type: qwen3_moe, qwen2_moe, mixtral, gpt_oss) and a
layout: per-expert linears (transformers 4) or fused target_parameters
(transformers 5, and gpt-oss).
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

from mola.errors import MolaError
from mola.adapters.formats import read_adapter
from mola.testing.peft import save_peft_adapter, save_peft_expert_params_adapter, save_peft_per_expert_adapter

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="the mlx-lm adapter directory")
    p.add_argument("out", help="the PEFT adapter directory to write")
    p.add_argument("--rslora", action="store_true",
                   help="write use_rslora: true (lora_alpha = scale * sqrt(r))")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="storage dtype of the factors (default: float32)")
    p.add_argument("--base-model", help="base_model_name_or_path to record in the config")
    p.add_argument("--moe", metavar="MODEL_TYPE", help="the MoE base's mlx-lm model type (expert adapters)")
    p.add_argument("--moe-layout", choices=("per-expert", "fused"), default="fused",
                   help="PEFT's layout for the experts (default: fused target_parameters)")
    a = p.parse_args()
    try:
        weights = read_adapter(a.src)
    except MolaError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    common = dict(use_rslora=a.rslora, dtype=DTYPES[a.dtype], base_model_name_or_path=a.base_model)
    if weights.expert_modules and a.moe is None:
        print("error: the adapter has LoRA on experts: name the base's model type with --moe", file=sys.stderr)
        return 1
    try:
        if a.moe is None:
            path = save_peft_adapter(a.out, weights, **common)
        elif a.moe_layout == "fused":
            path = save_peft_expert_params_adapter(a.out, weights, a.moe, **common)
        else:
            path = save_peft_per_expert_adapter(a.out, weights, a.moe, **common)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({len(weights.modules)} modules, rank {weights.rank})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
