"""Command line: arguments -> ServeConfig -> serve."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .blas import maybe_reexec_with_openblas
from .config import (DEMO_CHOICES, DTYPE_CHOICES, FIELDS, AdapterSpec, ServeConfig, load_config_file, merge_adapters,
                     parse_adapter_arg, parse_bytes)


def _adapter(value: str) -> AdapterSpec:
    try:
        return parse_adapter_arg(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _size(value: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mola", description="Multi-LoRA inference server on MLX.")
    parser.add_argument("--version", action="version", version=f"mola {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="serve a base model and its adapters over an OpenAI-compatible API",
        description="Settings come from defaults, then --config FILE, then the flags given.",
        argument_default=argparse.SUPPRESS,
    )
    serve.add_argument("--config", help="a TOML or YAML file declaring the model, adapters and settings")
    serve.add_argument("--model", help="base model: a local mlx-lm directory, a Hugging Face hub id, "
                       "or a llama.cpp GGUF file (or a directory holding one) "
                       "(default: the demo, SmolLM2-135M-Instruct with three adapters, fetched on "
                       "first run; offline, the echo demo)")
    serve.add_argument("--demo", choices=DEMO_CHOICES,
                       help="with no --model: chat (default; the echo demo when its model cannot be "
                       "fetched) or echo (a tiny base that echoes the message, built in seconds)")
    serve.add_argument("--served-model-name", help="the id clients use for the base model "
                       "(default: the model directory's name, or the GGUF file's name without .gguf)")
    serve.add_argument("--dtype", choices=DTYPE_CHOICES,
                       help="weights at load: keep (quantized layers stay quantized), float16, "
                       "bfloat16 or float32 (dequantized); auto (default): GGUF files float32 on a "
                       "CPU and kept on a GPU, mlx-lm directories as they are")
    serve.add_argument("--adapter", dest="adapters", action="append", type=_adapter, metavar="NAME=PATH",
                       help="serve the adapter at PATH (a directory, .gguf file or hub id) as model "
                       "id NAME (repeatable)")
    serve.add_argument("--adapter-dir", dest="adapter_dirs", action="append", metavar="DIR",
                       help="every subdirectory or .gguf file of DIR is an adapter named after it, "
                       "loaded on first use (repeatable)")
    serve.add_argument("--allow-any-adapter-path", action="store_true",
                       help="let adapters load from any path, not only under --adapter-dir (or named at start)")
    serve.add_argument("--allow-adapter-symlinks", action="store_true",
                       help="follow symlinks inside an --adapter-dir wherever they lead (default: an "
                       "adapter's real path must lie under an --adapter-dir)")
    serve.add_argument("--adapter-resolver", dest="adapter_resolvers", action="append", metavar="SPEC",
                       help="where a model id no adapter has is looked for (repeatable, tried in "
                       "order; off by default): dir:PATH tries PATH/<id>; hf:ORG/* (or "
                       "hf:ORG/A,ORG/B) an ORG/NAME hub repo, through huggingface-hub's cache")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--max-loras", type=int, help="adapter slots, i.e. resident adapters (default 8)")
    serve.add_argument("--max-lora-rank", type=int, help="largest adapter rank (default 64)")
    serve.add_argument("--max-cpu-loras", type=int, metavar="N",
                       help="keep up to N recently used adapters read and prepared in host memory, "
                       "so that loading one into a slot is only the copy (default: no host tier)")
    serve.add_argument("--adapter-cache-bytes", type=_size, metavar="SIZE",
                       help="cap the host tier's memory, e.g. 4GB or 512MiB (with or without "
                       "--max-cpu-loras; default: no host tier)")
    serve.add_argument("--max-adapter-wait", type=float, metavar="SECONDS",
                       help="a request that waited this long for its adapter's slot gets the next slot "
                       "that frees, ahead of busier adapters (default 2)")
    serve.add_argument("--max-num-seqs", type=int, help="rows in one decode batch (default 32)")
    serve.add_argument("--prefill-step-size", type=int,
                       help="prompt tokens prefilled per engine step (default 512)")
    serve.add_argument("--max-model-len", type=int, help="context limit (default: the model's own)")
    serve.add_argument("--prompt-cache-bytes", type=_size, metavar="SIZE",
                       help="KV state of earlier prompts and outputs kept for reuse, per adapter "
                       "(e.g. 512MB, 2GiB; default 1GiB; 0 turns the prompt cache off)")
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--no-openblas", action="store_true",
                       help="on Linux CPU, do not preload the system's OpenBLAS (see mola/blas.py)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every /v1 route "
                       "(default: $MOLA_API_KEY)")
    serve.add_argument("--admin-key", help="require this key to load and unload adapters "
                       "(default: $MOLA_ADMIN_KEY)")
    serve.add_argument("--protect-metrics", action="store_true",
                       help="require the API key on /metrics and /health too")
    serve.add_argument("--max-request-bytes", type=int, metavar="N",
                       help="refuse request bodies larger than N bytes with a 413 (default 4 MiB)")
    serve.add_argument("--max-queue", type=int,
                       help="sequences waiting beyond the batch before 429s (default 256)")
    serve.add_argument("--max-stored-responses", type=int,
                       help="responses kept in memory for previous_response_id, least recently used "
                       "evicted first (default 1024)")
    serve.add_argument("--request-timeout", type=float,
                       help="seconds a request may run (or wait) before it ends (default: no limit)")
    serve.add_argument("--shutdown-timeout", type=float,
                       help="seconds running requests may take to finish on SIGTERM (default 30)")
    serve.add_argument("--distributed", action="store_true",
                       help="shard the base over the ranks started by mlx.launch (see README)")
    serve.add_argument("--speculative", choices=["ngram", "draft"],
                       help="speculative decoding: ngram (prompt lookup: drafts copied from the prompt "
                       "and output so far) or draft (a --draft-model drafts); default off")
    serve.add_argument("--draft-model", help="--speculative draft: a small model with the same tokenizer "
                       "(a local directory or hub id); it runs without adapters")
    serve.add_argument("--num-draft-tokens", type=int, metavar="N",
                       help="most tokens a row drafts in one step (default 8)")
    serve.add_argument("--prompt-lookup-min", type=int, metavar="N",
                       help="shortest n-gram prompt lookup matches (default 2)")
    serve.add_argument("--prompt-lookup-max", type=int, metavar="N",
                       help="longest n-gram prompt lookup matches, tried first (default 4)")
    serve.add_argument("--speculative-max-batch", type=int, metavar="N",
                       help="steps with more decode rows than N do not speculate (default 8)")
    serve.add_argument("--speculate-always", action="store_true",
                       help="speculate whenever a row has a draft (default: only when the step costs "
                       "measured as the server runs say it pays)")
    add_train_parser(commands)
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
    add_validate_parser(commands)
    add_chat_parser(commands)
    return parser


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
    validate.add_argument("--max-lora-rank", type=int, default=ServeConfig.max_lora_rank,
                          help="the server's --max-lora-rank to check against (default 64)")
    return validate


def add_train_parser(commands) -> argparse.ArgumentParser:
    """`mola train`: a LoRA adapter from a data folder, with mlx-lm's tuner."""
    from . import train as t

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
    train.add_argument("--dtype", choices=t.TRAIN_DTYPES, default="keep",
                       help="keep (default: a quantized base, GGUF Q4_0/Q4_1/Q8_0 included, is trained as it "
                       "is) or a float dtype to dequantize it to")
    train.add_argument("--data", required=True, metavar="DIR", help="directory with train.jsonl (and valid.jsonl)")
    train.add_argument("--out", required=True, action="append", metavar="ADAPTER_DIR|FILE.gguf",
                       help="where to write the adapter: a directory (an mlx-lm adapter) or a FILE.gguf "
                       "(a llama.cpp GGUF LoRA); give it twice for both, from the same weights")
    train.add_argument("--gguf-outtype", choices=t.GGUF_OUTTYPES, default="f32",
                       help="tensor type of a .gguf output, as llama.cpp's converter's --outtype (default f32)")
    train.add_argument("--rank", type=int, default=t.DEFAULT_RANK, help="LoRA rank (default 8)")
    train.add_argument("--scale", type=float, default=t.DEFAULT_SCALE,
                       help="LoRA scale, mlx-lm's lora_parameters.scale (default 20)")
    train.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (default 0)")
    train.add_argument("--layers", type=int, default=None, metavar="N",
                       help="adapt the last N transformer blocks; -1: all (default 16, or all when fewer)")
    train.add_argument("--iters", type=int, default=t.DEFAULT_ITERS, help="training iterations (default 1000)")
    train.add_argument("--batch-size", type=int, default=t.DEFAULT_BATCH_SIZE, help="batch size (default 4)")
    train.add_argument("--learning-rate", type=float, default=t.DEFAULT_LEARNING_RATE,
                       help="Adam learning rate (default 1e-5)")
    train.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                       help="constant, or cosine decay to 10%% (default constant)")
    train.add_argument("--warmup", type=int, default=0, metavar="N", help="linear warm-up iterations (default 0)")
    train.add_argument("--target", dest="targets", metavar="NAMES", type=lambda v: tuple(v.split(",")),
                       help="comma-separated modules of each block to adapt, e.g. q_proj,v_proj or "
                       "self_attn.q_proj (default: every linear layer, as mlx-lm does)")
    train.add_argument("--max-seq-length", type=int, default=t.DEFAULT_MAX_SEQ_LENGTH,
                       help="longer examples are truncated (default 2048)")
    train.add_argument("--mask-prompt", action="store_true",
                       help="learn the completions only, not the prompts (chat and completions data)")
    train.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    train.add_argument("--steps-per-report", type=int, default=10, help="iterations between loss reports")
    train.add_argument("--steps-per-eval", type=int, default=200,
                       help="iterations between validation losses (with valid.jsonl)")
    train.add_argument("--val-batches", type=int, default=25,
                       help="validation batches per evaluation; -1: all (default 25)")
    train.add_argument("--grad-checkpoint", action="store_true", help="trade compute for memory")
    train.add_argument("--force", action="store_true", help="replace ADAPTER_DIR if it exists and is not empty")
    train.add_argument("--serve-url", metavar="URL",
                       help="when done, hot-load the adapter into the mola server at URL "
                       "(POST URL/v1/adapters); the server must allow the path")
    train.add_argument("--name", help="the adapter's model id for --serve-url (default: ADAPTER_DIR's name)")
    train.add_argument("--api-key", help="bearer key for --serve-url when the server wants one "
                       "(default: $MOLA_ADMIN_KEY, else $MOLA_API_KEY)")
    train.add_argument("--no-openblas", action="store_true",
                       help="on Linux CPU, do not preload the system's OpenBLAS (see mola/blas.py)")
    return train


def train_config_from_args(args: argparse.Namespace):
    import os

    from .train import TrainConfig

    return TrainConfig(
        model=args.model, data=args.data, out=tuple(args.out), rank=args.rank, scale=args.scale,
        dropout=args.dropout, layers=args.layers, iters=args.iters, batch_size=args.batch_size,
        learning_rate=args.learning_rate, targets=args.targets, lr_schedule=args.lr_schedule,
        warmup=args.warmup, max_seq_length=args.max_seq_length, mask_prompt=args.mask_prompt,
        seed=args.seed, steps_per_report=args.steps_per_report, steps_per_eval=args.steps_per_eval,
        val_batches=args.val_batches, grad_checkpoint=args.grad_checkpoint, force=args.force,
        name=args.name, serve_url=args.serve_url, gguf_outtype=args.gguf_outtype, dtype=args.dtype,
        api_key=args.api_key or os.environ.get("MOLA_ADMIN_KEY") or os.environ.get("MOLA_API_KEY") or None,
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Defaults <- config file <- flags."""
    values: dict = {}
    given = {k: v for k, v in vars(args).items() if k in FIELDS}
    config_file = getattr(args, "config", None)
    if config_file:
        values.update(load_config_file(config_file))
    if "adapters" in given:
        given["adapters"] = merge_adapters(values.get("adapters", ()), tuple(given["adapters"]))
    if "adapter_dirs" in given:
        given["adapter_dirs"] = tuple(values.get("adapter_dirs", ())) + tuple(given["adapter_dirs"])
    if "adapter_resolvers" in given:
        given["adapter_resolvers"] = tuple(values.get("adapter_resolvers", ())) + tuple(given["adapter_resolvers"])
    values.update(given)
    for field, env in (("api_key", "MOLA_API_KEY"), ("admin_key", "MOLA_ADMIN_KEY")):
        if values.get(field) is None and os.environ.get(env):
            values[field] = os.environ[env]
    return ServeConfig(**values)


def run_convert(args: argparse.Namespace) -> int:
    import time

    from .errors import MolaError
    from .models.convert import convert

    t0 = time.perf_counter()
    try:
        out = convert(args.src, args.out, dtype=args.dtype, force=args.force)
    except MolaError as e:
        print(f"[mola] error: {e.message}", file=sys.stderr)
        return 1
    print(f"[mola] wrote {out} ({args.dtype}) in {time.perf_counter() - t0:.1f} s; "
          f"e.g. mlx_lm.generate --model {out} --prompt 'Hello'", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            config = config_from_args(args)
        except (ValueError, TypeError) as e:
            parser.error(str(e))
        maybe_reexec_with_openblas(argv, enabled=not getattr(args, "no_openblas", False))
        from .serve import serve

        return serve(config)
    if args.command == "train":
        try:
            train_config = train_config_from_args(args)
        except ValueError as e:
            parser.error(str(e))
        maybe_reexec_with_openblas(argv, enabled=not args.no_openblas)
        from .train import run

        return run(train_config)
    if args.command == "convert":
        return run_convert(args)
    if args.command == "chat":
        from .chat.command import main as chat

        return chat(args)
    if args.command == "validate":
        from .validate import run as validate

        return validate(args.adapter, args.model, args.json, args.max_lora_rank, args.dtype)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
