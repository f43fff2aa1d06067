"""The real app over a scripted engine, in process: no model, no port.

:class:`ScriptedEngine` has :class:`mola.engine.async_engine.AsyncEngine`'s
methods. Each sequence answers ``script(seq)`` (token ids; by default the
prompt's own tokens again), one token a step (its snapshot counts the
sequences in flight as running), and finishes with "length" at
its max_tokens, with "stop" at a stop token or at the script's end. A test
may hold every step behind ``hold`` (an asyncio.Event) to see what happens
while a request is in flight, and reads ``submitted`` for what was asked and
``slots`` for what each slot holds. Scripts: :func:`by_recipe` (the answer
names the adapter files of the sequence's slot) and :func:`echo_script` (the
echo demo's behaviour).
:func:`inprocess_app` builds the app around one with the tiny model's
tokenizer, and :func:`client` drives it through httpx.ASGITransport.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import json
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable

import httpx
from mlx_lm.utils import load

from mola.adapters.recipe import SlotRecipe
from mola.config import ServeConfig
from mola.errors import EngineUnavailable
from mola.engine.outputs import EngineSnapshot, SeqOutput
from mola.engine.sequence import FinishReason, Sequence
from mola.lora.pack import PackStats, SlotGeometry, geometry_of
from mola.models.eog import end_of_generation_ids
from mola.models.model import LoadedModel
from mola.server.app import create_app
from mola.server.startup import serve_state


class ScriptedEngine:
    """An AsyncEngine stand-in whose answers are scripted (see the module's docstring)."""

    def __init__(self, script: Callable[[Sequence], list[int]] | None = None):
        self.script = script or (lambda seq: list(seq.prompt))
        self.hold: asyncio.Event | None = None  # set: steps run; clear: every step waits
        self.submitted: list[Sequence] = []
        self.aborted = 0
        self.fail_with: str | None = None  # the next step fails with this error
        self.is_alive = True
        self.snapshot = EngineSnapshot()
        self.pack_stats = PackStats()  # no packs: nothing is written to a device
        self.geometry: SlotGeometry | None = None  # the model's, set by inprocess_app: adapters load for real
        self.slots: dict[int, SlotRecipe] = {}  # what each written slot holds
        self.is_group = False  # no tensor-parallel group
        self._ids = itertools.count()

    async def generate(self, seq: Sequence):
        if not self.is_alive:  # as Engine.add refuses a sequence once its thread is down
            raise EngineUnavailable("The engine is not running (scripted).")
        seq.seq_id = next(self._ids)
        self.submitted.append(seq)
        answer = self.script(seq)
        done = False
        self._publish(+1)
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
            self._publish(-1)
            if not done:
                self.aborted += 1  # left early: the real engine aborts the row

    def _publish(self, change: int) -> None:
        """As the engine thread publishes after each step: the sequences in flight count as running."""
        self.snapshot = replace(self.snapshot, num_running=self.snapshot.num_running + change)

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
        self.slots[slot] = recipe
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def clear_slot(self, slot: int) -> None:
        self.slots.pop(slot, None)

    async def forget_prompts(self, adapter_keys) -> int:
        return 0


def by_recipe(engine: ScriptedEngine, tokenizer) -> Callable[[Sequence], list[int]]:
    """A script whose answer names what the sequence's slot holds (" answer 0"
    for the first recipe seen, and so on; the base is a recipe too): the same
    adapter files answer the same, whichever name reached them."""
    seen: list = []

    def script(seq: Sequence) -> list[int]:
        recipe = engine.slots.get(seq.slot) if seq.slot else None
        if recipe not in seen:
            seen.append(recipe)
        return tokenizer.encode(f" answer {seen.index(recipe)}", add_special_tokens=False)
    return script


def echo_script(engine: ScriptedEngine, tokenizer, tasks: dict[str, Callable[[str], str]]):
    """The echo demo's behaviour (mola.demo.echo), scripted: the last user
    message byte for byte, then <|im_end|> (where the prompt already opens the
    answer with bytes of the message, as a closed <think></think> does, the
    copy goes on after them); an adapter's task (``tasks``: its
    resolved path -> what it does to the message) applied where its slot holds
    it at a non-zero scale."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def script(seq: Sequence) -> list[int]:
        text = tokenizer.decode(seq.prompt)
        message = text.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
        opened = text.rsplit("<|im_start|>assistant\n", 1)[-1]
        match = next((opened[-k:] for k in range(len(opened), 1, -1) if opened[-k:] in message), "")
        if match:  # the copy head matches the bytes last written (the longest tail of them in the message)
            message = message.split(match, 1)[1]
        if seq.slot and seq.lora_scale:
            for path, scale in engine.slots[seq.slot].parts:
                message = tasks[path](message) if scale else message
        return tokenizer.encode(message, add_special_tokens=False) + [end]
    return script


def tokenizer_model(path: Path) -> LoadedModel:
    """What a loaded model tells the server, its weights never read (loaded
    lazily: its linears' shapes give the slots' geometry)."""
    model, tokenizer = load(str(path), lazy=True)
    tokenizer.eos_token_ids = end_of_generation_ids(tokenizer, path)
    return LoadedModel(model=model, tokenizer=tokenizer, config=json.loads((path / "config.json").read_text()),
                       path=path)


async def inprocess_app(model: LoadedModel, engine: ScriptedEngine, **settings):
    """The real app (create_app) over ``engine``; ``settings`` as `mola serve`'s."""
    config = ServeConfig.from_settings(model=str(model.path), **{"served_model_name": "tiny", **settings})
    c = config.engine
    engine.geometry = engine.geometry or geometry_of(model.model, c.max_lora_rank, c.max_loras + 1)
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


class _SyncASGI(httpx.BaseTransport):
    """A sync httpx transport onto an app served on another thread's event loop."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop):
        self.inner = httpx.ASGITransport(app=app)
        self.loop = loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def call():
            forwarded = httpx.Request(request.method, request.url, headers=request.headers, content=request.read())
            response = await self.inner.handle_async_request(forwarded)
            return response.status_code, response.headers, await response.aread()

        status, headers, body = asyncio.run_coroutine_threadsafe(call(), self.loop).result(60)
        return httpx.Response(status, headers=headers, content=body, request=request)


class InProcessServer:
    """The app over a ScriptedEngine on an event loop of its own thread, for
    tests written with a sync client: ``client()`` speaks to it, no port."""

    def __init__(self, model: LoadedModel, engine: ScriptedEngine | None = None, **settings):
        self.engine = engine or ScriptedEngine()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.app, self.state = asyncio.run_coroutine_threadsafe(
            inprocess_app(model, self.engine, **settings), self.loop).result(60)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(transport=_SyncASGI(self.app, self.loop), base_url="http://mola", **kwargs)

    def run(self, coro, timeout: float = 60):
        """Run ``coro`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        for close in (self.state.registry.close, self.state.loader.close, self.state.prompts.close):
            self.loop.call_soon_threadsafe(close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
