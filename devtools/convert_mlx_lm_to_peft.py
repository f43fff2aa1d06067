"""Convert an mlx-lm-format LoRA adapter directory into a Hugging Face PEFT one
(adapter_config.json + adapter_model.safetensors) with the same delta.

    python devtools/convert_mlx_lm_to_peft.py SRC OUT [--rslora] [--dtype float32]
        [--base-model NAME_OR_PATH]
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

from mola.errors import MolaError
from mola.lora.formats import read_adapter
from mola.synthetic.peft import save_peft_adapter

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
    a = p.parse_args()
    try:
        weights = read_adapter(a.src)
    except MolaError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 1
    path = save_peft_adapter(
        a.out, weights, use_rslora=a.rslora, dtype=DTYPES[a.dtype],
        base_model_name_or_path=a.base_model,
    )
    print(f"wrote {path} ({len(weights.modules)} modules, rank {weights.rank})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
