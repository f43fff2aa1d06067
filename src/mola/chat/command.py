"""`mola chat`'s start: reach the server (or start one), pick the model id,
then the REPL."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from .client import ChatClient, ServerError
from .local import LocalServer
from .repl import run_chat
from .session import Session


def serve_args(args: argparse.Namespace) -> list[str]:
    """The `mola serve` flags of an in-process chat."""
    out = []
    for flag, value in (("--model", args.model), ("--demo", args.demo), ("--config", args.config),
                        ("--max-lora-rank", args.max_lora_rank)):
        if value is not None:
            out += [flag, str(value)]
    for spec in args.adapters or ():
        out += ["--adapter", spec]
    for folder in args.adapter_dirs or ():
        out += ["--adapter-dir", folder]
    return out


def main(args: argparse.Namespace) -> int:
    if sys.stdin.isatty():
        # Ctrl-C stops an answer. A process started with SIGINT ignored (a
        # background job of a shell, some CI runners) would never see it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.url is not None and serve_args(args):
        print("[mola] error: --model, --demo, --adapter, --adapter-dir, --config and --max-lora-rank start the "
              "chat's own server; with --url the server is already running", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("MOLA_API_KEY") or None
    server = client = None
    try:
        url = args.url
        if url is None:
            what = args.model or args.config or "the demo"
            print(f"[mola] starting mola serve for {what} on 127.0.0.1 ...", file=sys.stderr, flush=True)
            server = LocalServer(serve_args(args), start_timeout=args.start_timeout)
            url = server.start()
        client = ChatClient(url, api_key)
        cards = client.models()
        model = args.model_id or next(c["id"] for c in cards if c.get("parent") is None)
        session = Session(model=model, system=args.system, max_tokens=args.max_tokens,
                          temperature=args.temperature)
        print(f"[mola] chatting with {model} at {url}; /help lists the commands, Ctrl-D leaves",
              file=sys.stderr, flush=True)
        return run_chat(client, session, args.history)
    except ServerError as e:
        print(f"[mola] error: {e.message}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # while the server starts
        return 130
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
