"""Write the llama.cpp GGUF LoRA twin of an mlx-lm adapter (the file llama.cpp's
convert_lora_to_gguf.py would write for the same weights as a PEFT adapter).

    python devtools/convert_mlx_lm_to_gguf.py SRC OUT.gguf --model MODEL_DIR
        [--architecture llama|qwen2|qwen3] [--outtype f32|f16|bf16|q8_0]

The head counts (for llama's q/k row order) come from MODEL_DIR/config.json, or from
the metadata when MODEL is a GGUF model file; the architecture defaults to the one
its model_type converts to in llama.cpp.
adapter.lora.alpha is written as scale * rank, which llama.cpp reads back as the
adapter's scale (alpha / rank).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mola.adapters.formats import read_adapter
from mola.adapters.formats.gguf_names import ARCHITECTURES, architecture_for
from mola.adapters.formats.gguf_writer import OUTTYPES, save_gguf_adapter
from mola.models.metadata import read_model_config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="the adapter to convert (an mlx-lm adapter directory)")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--model", required=True,
                   help="the base model: a directory (its config.json) or a GGUF model file (its metadata)")
    p.add_argument("--architecture", choices=sorted(ARCHITECTURES),
                   help="general.architecture (default: from the model's model_type)")
    p.add_argument("--outtype", choices=OUTTYPES, default="f32", help="tensor type (default f32)")
    a = p.parse_args()

    config = read_model_config(Path(a.model))
    arch = a.architecture or getattr(architecture_for(config.get("model_type")), "name", None)
    if arch is None:
        p.error(f"model_type {config.get('model_type')!r} has no GGUF LoRA architecture mola "
                "knows; pass --architecture")
    weights = read_adapter(a.src, model_type=config.get("model_type"))
    n_head = config.get("num_attention_heads")
    path = save_gguf_adapter(
        a.out, weights, architecture=arch, n_head=n_head,
        n_kv_head=config.get("num_key_value_heads") or n_head, dtype=a.outtype,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
