"""The real app over a scripted engine, in process: no model, no port.

:class:`ScriptedEngine` has :class:`mola.engine.client.AsyncEngine`'s
methods. Each sequence answers ``script(seq)`` (token ids; by default the
prompt's own tokens again), one token a step, and finishes with "length" at
its max_tokens, with "stop" at a stop token or at the script's end. A test
may hold every step behind ``hold`` (an asyncio.Event) to see what happens
while a request is in flight, and reads ``submitted`` for what was asked.
:func:`inprocess_app` builds the app around one with the tiny model's
tokenizer, and :func:`client` drives it through httpx.ASGITransport.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

import httpx
import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from mola.config import ServeConfig
from mola.engine.outputs import EngineSnapshot, SeqOutput
from mola.engine.sequence import FinishReason, Sequence
from mola.lora.pack import SlotGeometry
from mola.models.eog import end_of_generation_ids
from mola.models.model import LoadedModel
from mola.server.app import create_app
from mola.server.startup import serve_state


class ScriptedEngine:
    """An engine client whose answers are scripted (see the module's docstring)."""

    def __init__(self, script: Callable[[Sequence], list[int]] | None = None, num_slots: int = 3):
        self.script = script or (lambda seq: list(seq.prompt))
        self.hold: asyncio.Event | None = None  # set: steps run; clear: every step waits
        self.submitted: list[Sequence] = []
        self.aborted = 0
        self.fail_with: str | None = None  # the next step fails with this error
        self.is_alive = True
        self.snapshot = EngineSnapshot()
        self.geometry = SlotGeometry(targets={}, max_rank=8, num_slots=num_slots, dtype=mx.float32)
        self._ids = itertools.count()

    async def generate(self, seq: Sequence):
        seq.seq_id = next(self._ids)
        self.submitted.append(seq)
        answer = self.script(seq)
        done = False
        try:
            for i in itertools.count():
                if self.hold is not None:
                    await self.hold.wait()
                await asyncio.sleep(0)  # one step: others run between
                if self.fail_with is not None:
                    done = True
                    yield SeqOutput(seq.seq_id, finish_reason=FinishReason.ERROR, error=self.fail_with)
                    return
                out, done = self._step(seq, answer, i)
                yield out
                if done:
                    return
        finally:
            if not done:
                self.aborted += 1  # left early: the real engine aborts the row

    @staticmethod
    def _step(seq: Sequence, answer: list[int], i: int) -> tuple[SeqOutput, bool]:
        if i >= len(answer):
            return SeqOutput(seq.seq_id, finish_reason=FinishReason.STOP), True
        token = answer[i]
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = ((-0.5, [(token, -0.5)] * seq.params.logprobs),)
        if token in seq.params.stop_token_ids:
            return SeqOutput(seq.seq_id, (token,), FinishReason.STOP, logprobs=logprobs), True
        finish = FinishReason.LENGTH if i + 1 >= seq.params.max_tokens else None
        return SeqOutput(seq.seq_id, (token,), finish, logprobs=logprobs), finish is not None

    async def call(self, fn):
        return fn()

    def write_slot(self, slot, rows, recipe) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def clear_slot(self, slot: int) -> None:
        return None

    async def forget_prompts(self, adapter_keys) -> int:
        return 0


def tokenizer_model(path: Path) -> LoadedModel:
    """What a loaded model tells the server, without its weights."""
    tokenizer = load_tokenizer(path)
    tokenizer.eos_token_ids = end_of_generation_ids(tokenizer, path)
    return LoadedModel(model=None, tokenizer=tokenizer, config=json.loads((path / "config.json").read_text()),
                       path=path)


async def inprocess_app(model: LoadedModel, engine: ScriptedEngine, **settings):
    """The real app (create_app) over ``engine``; ``settings`` as `mola serve`'s."""
    config = ServeConfig.from_settings(model=str(model.path), served_model_name="tiny", **settings)
    state = await serve_state(config, engine, model)
    return create_app(state), state


@asynccontextmanager
async def client(model: LoadedModel, engine: ScriptedEngine | None = None, **settings):
    """An httpx client on the app over ``engine`` (a fresh ScriptedEngine by default)."""
    engine = engine or ScriptedEngine()
    app, state = await inprocess_app(model, engine, **settings)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://mola", timeout=30) as c:
            c.engine, c.state, c.app = engine, state, app
            yield c
    finally:
        state.registry.close()
        state.loader.close()
        state.prompts.close()
