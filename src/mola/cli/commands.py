"""The parsers and small runners of `mola train`, `mola convert`, `mola chat`
and `mola validate` (their work lives in mola.train, mola.models.convert,
mola.chat and mola.validate)."""

from __future__ import annotations

import argparse
import sys

from ..config import DEMO_CHOICES
from ..engine.config import EngineConfig
from ..models import DTYPE_CHOICES


def add_train_parser(commands) -> argparse.ArgumentParser:
    """`mola train`: a LoRA adapter from a data folder, with mlx-lm's tuner."""
    from .. import train as t
    from ..train.flags import add_recipe_flags

    train = commands.add_parser(
        "train", help="train a LoRA adapter on a folder of JSONL data (mlx-lm's tuner)",
        description="Train a LoRA adapter with mlx-lm's tuner. DIR holds train.jsonl and optionally "
        "valid.jsonl, one example per line: {\"messages\": [...]} (chat), {\"prompt\", \"completion\"} "
        "or {\"text\"}. The data and the output path are checked before the model loads. The "
        "adapter (adapter_config.json + adapters.safetensors) loads in mola serve --adapter, "
        "POST /v1/adapters and mlx_lm's --adapter-path; a FILE.gguf output in llama.cpp too. "
        "A quantized base is trained as it is (LoRA on its quantized linears, as mlx-lm's tuner does).",
    )
    train.add_argument("--model", required=True, help="base model: a local directory, a GGUF file or a "
                       "Hugging Face hub id")
    train.add_argument("--data", required=True, metavar="DIR", help="directory with train.jsonl (and valid.jsonl)")
    train.add_argument("--out", required=True, action="append", metavar="ADAPTER_DIR|FILE.gguf",
                       help="where to write the adapter: a directory (an mlx-lm adapter) or a FILE.gguf "
                       "(a llama.cpp GGUF LoRA); give it twice for both, from the same weights")
    train.add_argument("--alora-invocation", metavar="TEXT",
                       help="train an activated LoRA: its delta applies from the last place TEXT's tokens start "
                       "in each example (e.g. the assistant's role header), the base model alone before it; "
                       "served so, the base model's cached prompt is reused up to there")
    train.add_argument("--fine-tune-type", choices=("lora", "dora"), default="lora",
                       help="lora (default), or dora: mlx-lm's DoRA (a learnt magnitude per output beside the "
                       "LoRA factors), served unmerged beside LoRA adapters; not with a .gguf output")
    add_recipe_flags(train, iters=t.DEFAULT_ITERS, learning_rate=t.DEFAULT_LEARNING_RATE,
                     dtype_help="keep (default: a quantized base, GGUF Q4_0/Q4_1/Q8_0 included, is trained as it "
                     "is) or a float dtype to dequantize it to")
    train.add_argument("--mask-prompt", action="store_true",
                       help="learn the completions only, not the prompts (chat and completions data)")
    train.add_argument("--steps-per-eval", type=int, default=200,
                       help="iterations between validation losses (with valid.jsonl)")
    train.add_argument("--val-batches", type=int, default=25,
                       help="validation batches per evaluation; -1: all (default 25)")
    train.add_argument("--serve-url", metavar="URL",
                       help="when done, hot-load the adapter into the mola server at URL "
                       "(POST URL/v1/adapters); the server must allow the path")
    return train


def train_config_from_args(args: argparse.Namespace):
    import os

    from ..train import TrainConfig

    return TrainConfig(
        model=args.model, data=args.data, out=tuple(args.out), rank=args.rank, scale=args.scale,
        dropout=args.dropout, layers=args.layers, iters=args.iters, batch_size=args.batch_size,
        learning_rate=args.learning_rate, targets=args.targets, lr_schedule=args.lr_schedule,
        warmup=args.warmup, grad_clip=args.grad_clip, max_seq_length=args.max_seq_length,
        mask_prompt=args.mask_prompt,
        seed=args.seed, steps_per_report=args.steps_per_report, steps_per_eval=args.steps_per_eval,
        val_batches=args.val_batches, grad_checkpoint=args.grad_checkpoint, force=args.force,
        name=args.name, serve_url=args.serve_url, gguf_outtype=args.gguf_outtype, dtype=args.dtype,
        alora_invocation=getattr(args, "alora_invocation", None),
        fine_tune_type=getattr(args, "fine_tune_type", "lora"),
        api_key=args.api_key or os.environ.get("MOLA_ADMIN_KEY") or os.environ.get("MOLA_API_KEY") or None,
    )


def add_convert_parser(commands) -> argparse.ArgumentParser:
    """`mola convert`: a GGUF model as an mlx-lm directory."""
    convert = commands.add_parser(
        "convert", help="write a GGUF model as an mlx-lm model directory",
        description="Write the llama.cpp GGUF model SRC as an mlx-lm model directory OUT "
        "(config.json, model.safetensors, tokenizer files) that mlx_lm.load, mlx_lm.generate "
        "and mlx_lm.server load: the weights mola serve holds for the file at the same --dtype.")
    convert.add_argument("src", metavar="FILE.gguf", help="the GGUF model (or a directory holding one)")
    convert.add_argument("out", metavar="OUT_DIR", help="the directory to write")
    convert.add_argument("--dtype", choices=("keep", "float16", "bfloat16", "float32"), default="keep",
                         help="keep (default: quantized layers stay quantized) or a float dtype")
    convert.add_argument("--force", action="store_true", help="replace OUT_DIR if it is not empty")
    return convert


def run_convert(args: argparse.Namespace) -> int:
    import time

    from ..errors import MolaError
    from ..models.convert import convert

    import logging

    # a long conversion's progress: a bar on a terminal, else these log lines (models/progress.py)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[mola] %(message)s"))
    loader_log = logging.getLogger("mola.loader")
    level = loader_log.level
    loader_log.addHandler(handler)
    loader_log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        out = convert(args.src, args.out, dtype=args.dtype, force=args.force)
    except MolaError as e:
        print(f"[mola] error: {e.message}", file=sys.stderr)
        return 1
    finally:
        loader_log.removeHandler(handler)
        loader_log.setLevel(level)
    print(f"[mola] wrote {out} ({args.dtype}) in {time.perf_counter() - t0:.1f} s; "
          f"e.g. mlx_lm.generate --model {out} --prompt 'Hello'", file=sys.stderr)
    return 0


def add_chat_parser(commands) -> argparse.ArgumentParser:
    """`mola chat`: an interactive chat with a running server, or with one of its own."""
    from pathlib import Path

    chat = commands.add_parser(
        "chat", help="chat interactively with a mola server (or one started for the chat)",
        description="Chat with a running mola server (--url), or start one on 127.0.0.1 for the chat "
        "from --model/--adapter/--adapter-dir/--config as mola serve takes them (no --url and no model: "
        "the demo). Answers stream as they decode. /model ID switches the model id and keeps the "
        "conversation; /adapter off|on|SCALE sets lora_scale; /help lists the commands. Ctrl-C stops "
        "an answer, Ctrl-D leaves.",
    )
    chat.add_argument("model_id", nargs="?", metavar="MODEL_ID",
                      help="the model id to talk to first (default: the server's base model)")
    chat.add_argument("--url", help="a running mola (or any OpenAI-compatible) server, e.g. http://127.0.0.1:8000")
    chat.add_argument("--api-key", help="bearer key for --url (default: $MOLA_API_KEY)")
    chat.add_argument("--model", help="without --url: the base model of the chat's own server")
    chat.add_argument("--demo", choices=DEMO_CHOICES,
                      help="without --url and --model: which demo its server serves (chat, the default, or echo)")
    chat.add_argument("--adapter", dest="adapters", action="append", metavar="NAME=PATH",
                      help="without --url: serve this adapter too (repeatable)")
    chat.add_argument("--adapter-dir", dest="adapter_dirs", action="append", metavar="DIR",
                      help="without --url: an adapter directory (repeatable)")
    chat.add_argument("--config", help="without --url: a mola serve config file")
    chat.add_argument("--max-lora-rank", type=int, help="without --url: the server's --max-lora-rank")
    chat.add_argument("--start-timeout", type=float, default=600.0,
                      help="seconds the chat's own server may take to load (default 600)")
    chat.add_argument("--system", help="a system prompt to start with")
    chat.add_argument("--max-tokens", type=int, help="tokens per answer at most (default: the server's)")
    chat.add_argument("--temperature", type=float, help="sampling temperature (default: the server's, 1)")
    chat.add_argument("--history", type=Path, help="readline history file (default: chat_history in "
                      "mola's cache directory, $MOLA_CACHE or ~/.cache/mola)")
    return chat


def add_validate_parser(commands) -> argparse.ArgumentParser:
    """`mola validate`: describe an adapter, and check it against a base offline."""
    validate = commands.add_parser(
        "validate", help="describe an adapter and check it against a base model, offline",
        description="Name an adapter's format, ranks, scale (and alpha), target modules and layers, "
        "dtype, size and the base it declares. With --model, check every module and shape against "
        "that model without loading its weights, with the same readers and checks as mola serve. "
        "Exit status 0 when the adapter would load, 1 (with serve's message) when it would not.",
    )
    validate.add_argument("adapter", metavar="ADAPTER",
                          help="an adapter directory (mlx-lm or PEFT), a .gguf file, or a hub id")
    validate.add_argument("--model", help="base model to check against: a local directory, a GGUF file "
                          "or a hub id (read offline: config and tensor shapes, not weights)")
    validate.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                          help="the --dtype mola serve would load the model with (default auto)")
    validate.add_argument("--json", action="store_true", help="print the report as JSON")
    validate.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank,
                          help="the server's --max-lora-rank to check against (default 64)")
    validate.add_argument("--max-expert-lora-rank", type=int, default=EngineConfig.max_expert_rank,
                          help="the server's --max-expert-lora-rank to check against (default 16)")
    return validate
