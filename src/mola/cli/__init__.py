"""Command line: arguments -> ServeConfig -> serve (and mola's other commands).

    serve_flags.py  mola serve's flags
    config_file.py  mola serve --config FILE: the settings a TOML, YAML or JSON file declares
    commands.py     mola train, convert, chat and validate: their parsers
    cache_command.py  mola cache list|clear: the conversion cache of GGUF models
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..blas import maybe_reexec_with_openblas
from ..config import SETTINGS, ServeConfig
from .commands import (add_chat_parser, add_convert_parser, add_train_parser, add_validate_parser, run_convert,
                       train_config_from_args)
from .cache_command import add_cache_parser, run_cache
from .config_file import load_config_file, merge_adapters
from .serve_flags import add_serve_parser
from ..distill.command import add_distill_parser

__all__ = ["build_parser", "config_from_args", "main", "train_config_from_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mola", description="Multi-LoRA inference server on MLX.")
    parser.add_argument("--version", action="version", version=f"mola {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    add_train_parser(commands)
    add_distill_parser(commands)
    add_convert_parser(commands)
    add_validate_parser(commands)
    add_chat_parser(commands)
    add_cache_parser(commands)
    return parser


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Defaults <- config file <- flags."""
    values: dict = {}
    given = {k: v for k, v in vars(args).items() if k in SETTINGS}
    config_file = getattr(args, "config", None)
    if config_file:
        values.update(load_config_file(config_file))
    if "adapters" in given:
        given["adapters"] = merge_adapters(values.get("adapters", ()), tuple(given["adapters"]))
    if "models" in given:
        given["models"] = merge_adapters(values.get("models", ()), tuple(given["models"]))  # by name, too
    if "adapter_dirs" in given:
        given["adapter_dirs"] = tuple(values.get("adapter_dirs", ())) + tuple(given["adapter_dirs"])
    if "adapter_resolvers" in given:
        given["adapter_resolvers"] = tuple(values.get("adapter_resolvers", ())) + tuple(given["adapter_resolvers"])
    values.update(given)
    for field, env in (("api_key", "MOLA_API_KEY"), ("admin_key", "MOLA_ADMIN_KEY")):
        if values.get(field) is None and os.environ.get(env):
            values[field] = os.environ[env]
    return ServeConfig.from_settings(**values)


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
        if getattr(args, "replicas", None) is not None or getattr(args, "autoscaling", None) is not None:
            from ..ray.command import serve_replicas

            return serve_replicas(config, getattr(args, "replicas", None) or 1, getattr(args, "ray_address", None),
                                  getattr(args, "autoscaling", None))
        from ..serve import serve

        return serve(config)
    if args.command == "train":
        try:
            train_config = train_config_from_args(args)
        except ValueError as e:
            parser.error(str(e))
        maybe_reexec_with_openblas(argv, enabled=not args.no_openblas)
        from ..train import run

        return run(train_config)
    if args.command == "distill":
        from ..distill.command import main as distill

        return distill(args, parser, argv)
    if args.command == "convert":
        return run_convert(args)
    if args.command == "cache":
        return run_cache(args)
    if args.command == "chat":
        from ..chat.command import main as chat

        return chat(args)
    if args.command == "validate":
        from ..validate import run as validate

        return validate(args.adapter, args.model, args.json, args.max_lora_rank, args.dtype,
                        args.max_expert_lora_rank)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
