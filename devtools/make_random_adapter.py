"""Write a random LoRA adapter in mlx-lm's format for a model directory
(B is non-zero, so the adapter changes the model's outputs).

    python devtools/make_random_adapter.py OUT --model MODEL [--rank 8]
        [--keys self_attn.q_proj,self_attn.v_proj] [--num-layers N] [--scale 2.0] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys

from mola.testing.adapter import DEFAULT_KEYS, make_random_adapter


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", required=True, help="the base model directory")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma-separated module keys")
    p.add_argument("--num-layers", type=int, help="the last N blocks (default: all)")
    p.add_argument("--scale", type=float, default=2.0)
    p.add_argument("--std", type=float, default=0.2, help="standard deviation of B")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    path = make_random_adapter(
        a.out, a.model, rank=a.rank, keys=tuple(k for k in a.keys.split(",") if k),
        num_layers=a.num_layers, scale=a.scale, std=a.std, seed=a.seed,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
