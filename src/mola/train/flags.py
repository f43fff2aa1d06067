"""The command-line flags `mola train` and `mola distill` share: the LoRA, the
optimiser, the run and the output (each command adds its own beside them)."""

from __future__ import annotations

import argparse

from .config import (DEFAULT_BATCH_SIZE, DEFAULT_MAX_SEQ_LENGTH, DEFAULT_RANK, DEFAULT_SCALE, GGUF_OUTTYPES,
                     TRAIN_DTYPES)


def add_recipe_flags(p: argparse.ArgumentParser, *, iters: int, learning_rate: float, step: str = "iteration",
                     dtype_help: str = "keep (default) or a float dtype to dequantize the base to") -> None:
    """``iters`` and ``learning_rate``: the command's defaults; ``step``: what it calls one."""
    p.add_argument("--dtype", choices=TRAIN_DTYPES, default="keep", help=dtype_help)
    p.add_argument("--gguf-outtype", choices=GGUF_OUTTYPES, default="f32",
                   help="a .gguf output's tensor type (as llama.cpp's convert_lora_to_gguf.py --outtype; "
                   "default f32)")
    p.add_argument("--rank", type=int, default=DEFAULT_RANK, help=f"LoRA rank (default {DEFAULT_RANK})")
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                   help=f"LoRA scale, mlx-lm's lora_parameters.scale (default {DEFAULT_SCALE:g})")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (default 0)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="adapt the last N transformer blocks; -1: all (default 16, or all when fewer)")
    p.add_argument("--target", dest="targets", metavar="NAMES", type=lambda v: tuple(v.split(",")),
                   help="comma-separated modules of each block to adapt, e.g. q_proj,v_proj or "
                   "self_attn.q_proj (default: every linear layer, as mlx-lm does)")
    p.add_argument("--iters", type=int, default=iters, help=f"training {step}s (default {iters})")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                   help=f"batch size (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--learning-rate", type=float, default=learning_rate,
                   help=f"Adam learning rate (default {learning_rate:g})")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="constant, or cosine decay to 10%% (default constant)")
    p.add_argument("--warmup", type=int, default=0, metavar="N", help=f"linear warm-up {step}s (default 0)")
    p.add_argument("--grad-clip", type=float, metavar="NORM", help="clip the gradient's global norm (default: no)")
    p.add_argument("--max-seq-length", type=int, default=DEFAULT_MAX_SEQ_LENGTH,
                   help=f"longer examples are truncated (default {DEFAULT_MAX_SEQ_LENGTH})")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--steps-per-report", type=int, default=10, help=f"{step}s between progress lines")
    p.add_argument("--grad-checkpoint", action="store_true", help="trade compute for memory")
    p.add_argument("--force", action="store_true", help="replace ADAPTER_DIR if it exists and is not empty")
    p.add_argument("--name", help="the adapter's model id on the server it is loaded into "
                   "(default: ADAPTER_DIR's name)")
    p.add_argument("--api-key", help="bearer key for that server when it wants one "
                   "(default: $MOLA_ADMIN_KEY, else $MOLA_API_KEY)")
    p.add_argument("--no-openblas", action="store_true",
                   help="on Linux CPU, do not preload the system's OpenBLAS (see mola/blas.py)")
