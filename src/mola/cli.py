"""Command line: arguments -> ServeConfig -> serve."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .blas import maybe_reexec_with_openblas
from .config import FIELDS, AdapterSpec, ServeConfig, load_config_file, merge_adapters, parse_adapter_arg


def _adapter(value: str) -> AdapterSpec:
    try:
        return parse_adapter_arg(value)
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
    serve.add_argument("--model", help="base model: a local directory or a Hugging Face hub id "
                       "(default: the embedded demo, built offline on first run)")
    serve.add_argument("--served-model-name", help="the id clients use for the base model "
                       "(default: the model directory's name)")
    serve.add_argument("--adapter", dest="adapters", action="append", type=_adapter, metavar="NAME=PATH",
                       help="serve the adapter at PATH (a directory, .gguf file or hub id) as model "
                       "id NAME (repeatable)")
    serve.add_argument("--adapter-dir", dest="adapter_dirs", action="append", metavar="DIR",
                       help="every subdirectory or .gguf file of DIR is an adapter named after it, "
                       "loaded on first use (repeatable)")
    serve.add_argument("--allow-any-adapter-path", action="store_true",
                       help="let POST /v1/adapters load from any path, not only under --adapter-dir")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--max-loras", type=int, help="adapter slots, i.e. resident adapters (default 8)")
    serve.add_argument("--max-lora-rank", type=int, help="largest adapter rank (default 64)")
    serve.add_argument("--max-num-seqs", type=int, help="rows in one decode batch (default 32)")
    serve.add_argument("--prefill-step-size", type=int,
                       help="prompt tokens prefilled per engine step (default 512)")
    serve.add_argument("--max-model-len", type=int, help="context limit (default: the model's own)")
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--no-openblas", action="store_true",
                       help="on Linux CPU, do not preload the system's OpenBLAS (see mola/blas.py)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every /v1 route "
                       "(default: $MOLA_API_KEY)")
    serve.add_argument("--admin-key", help="require this key to load and unload adapters "
                       "(default: $MOLA_ADMIN_KEY)")
    serve.add_argument("--protect-metrics", action="store_true",
                       help="require the API key on /metrics and /health too")
    serve.add_argument("--max-queue", type=int,
                       help="sequences waiting beyond the batch before 429s (default 256)")
    serve.add_argument("--request-timeout", type=float,
                       help="seconds a request may run (or wait) before it ends (default: no limit)")
    serve.add_argument("--shutdown-timeout", type=float,
                       help="seconds running requests may take to finish on SIGTERM (default 30)")
    serve.add_argument("--distributed", action="store_true",
                       help="shard the base over the ranks started by mlx.launch (see README)")
    return parser


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
    values.update(given)
    for field, env in (("api_key", "MOLA_API_KEY"), ("admin_key", "MOLA_ADMIN_KEY")):
        if values.get(field) is None and os.environ.get(env):
            values[field] = os.environ[env]
    return ServeConfig(**values)


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
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
