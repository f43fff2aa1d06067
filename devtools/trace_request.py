"""Which of mola's source files one request enters: a tiny random model behind
the real app, one request driven in process (httpx.ASGITransport), traced
with ``sys.setprofile`` on the event loop's thread and the tokenizer lanes'
threads. The engine's own thread (its step loop) is not traced: it is the
same for every dialect.

    python devtools/trace_request.py [chat|completions|messages|responses] [--list]

A first request warms everything up (imports, lazy setup); the second is the
one counted. Prints the number of files entered, and with --list each file
with how many calls entered it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
from pathlib import Path

import httpx

import mola

SRC = str(Path(mola.__file__).parent)
BODIES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
}


class Tracer:
    """Counts calls into each of mola's files while ``on``."""

    def __init__(self):
        self.entered: collections.Counter = collections.Counter()
        self.on = False

    def __call__(self, frame, event, arg):
        if self.on and event == "call":
            path = frame.f_code.co_filename
            if path.startswith(SRC):
                self.entered[path[len(SRC) + 1:]] += 1


async def trace(model: Path, dialect: str) -> collections.Counter:
    from mola.config import ServeConfig
    from mola.server.app import create_app
    from mola.bases.control import close_state
    from mola.server.metrics import Metrics
    from mola.server.startup import start_base

    config = ServeConfig.from_settings(model=str(model), log_level="warning")
    state = await start_base(config, Metrics())
    tracer = Tracer()
    try:
        app = create_app(state)
        path, body = BODIES[dialect]
        body = {"model": state.base_id, **body}
        lanes = {state.prompts.short[1], state.prompts.long[1]}
        for lane in lanes:  # the tokenizer threads
            await asyncio.get_running_loop().run_in_executor(lane, sys.setprofile, tracer)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mola") as client:
            (await client.post(path, json=body)).raise_for_status()  # warm-up
            sys.setprofile(tracer)
            tracer.on = True
            response = await client.post(path, json=body)
            tracer.on = False
            sys.setprofile(None)
            response.raise_for_status()
        for lane in lanes:
            await asyncio.get_running_loop().run_in_executor(lane, sys.setprofile, None)
    finally:
        await close_state(state)
    return tracer.entered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dialect", nargs="?", default="chat", choices=sorted(BODIES))
    parser.add_argument("--list", action="store_true", help="each file, with the calls that entered it")
    args = parser.parse_args()
    from mola.testing.model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        entered = asyncio.run(trace(make_tiny_model(Path(tmp) / "tiny"), args.dialect))
    if args.list:
        for path, calls in sorted(entered.items()):
            print(f"{calls:6d}  {path}")
    print(f"{args.dialect}: {len(entered)} of mola's files entered")


if __name__ == "__main__":
    main()
