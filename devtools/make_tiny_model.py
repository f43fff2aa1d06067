"""Write a random-weight mlx-lm model (llama architecture, byte-level BPE
tokenizer trained offline, ChatML template) that `mlx_lm.load` accepts.

    python devtools/make_tiny_model.py OUT [--hidden-size 64 --layers 2 ...]

The defaults make a ~0.1M-parameter model for tests; for a ~100M-parameter
float32 benchmark model try --hidden-size 768 --layers 12 --intermediate-size 2048
--heads 12 --kv-heads 4 --vocab-size 8192.
"""

from __future__ import annotations

import argparse
import sys

from mola.testing.model import TinyModelSpec, make_tiny_model, num_parameters


def main() -> int:
    d = TinyModelSpec()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--layers", type=int, default=d.num_hidden_layers)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--heads", type=int, default=d.num_attention_heads)
    p.add_argument("--kv-heads", type=int, default=d.num_key_value_heads)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantize-bits", type=int, help="quantize the linears (e.g. 4)")
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args()
    spec = TinyModelSpec(
        hidden_size=a.hidden_size, num_hidden_layers=a.layers, intermediate_size=a.intermediate_size,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab_size,
        max_position_embeddings=a.max_position_embeddings, dtype=a.dtype,
        quantize_bits=a.quantize_bits, seed=a.seed,
    )
    path = make_tiny_model(a.out, spec)
    print(f"wrote {path} (~{num_parameters(spec) / 1e6:.1f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
