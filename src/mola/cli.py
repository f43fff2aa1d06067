"""Command line: arguments -> ServeConfig -> serve."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .config import ServeConfig, parse_adapter_arg


def _adapter(value: str) -> tuple[str, str]:
    try:
        return parse_adapter_arg(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mola", description="Multi-LoRA inference server on MLX.")
    parser.add_argument("--version", action="version", version=f"mola {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="serve a base model and its adapters over an OpenAI-compatible API"
    )
    serve.add_argument("--model", help="base model: a local directory or a Hugging Face hub id "
                       "(default: the embedded demo, built offline on first run)")
    serve.add_argument("--served-model-name", help="the id clients use for the base model "
                       "(default: the model directory's name)")
    serve.add_argument("--adapter", action="append", default=[], type=_adapter, metavar="NAME=PATH",
                       help="serve the adapter at PATH as model id NAME (repeatable)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-loras", type=int, default=8, help="adapter slots (default 8)")
    serve.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank (default 64)")
    serve.add_argument("--max-num-seqs", type=int, default=32, help="rows in one decode batch (default 32)")
    serve.add_argument("--prefill-step-size", type=int, default=512,
                       help="prompt tokens prefilled per engine step (default 512)")
    serve.add_argument("--max-model-len", type=int, help="context limit (default: the model's own)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    return parser


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        adapters=tuple(args.adapter),
        host=args.host,
        port=args.port,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_num_seqs=args.max_num_seqs,
        prefill_step_size=args.prefill_step_size,
        max_model_len=args.max_model_len,
        log_level=args.log_level,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            config = config_from_args(args)
        except ValueError as e:
            parser.error(str(e))
        from .serve import serve

        return serve(config)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
