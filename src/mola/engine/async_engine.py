"""The event loop's side of the engine: submit a sequence, iterate over its
outputs, abort it, run a function on the engine thread, write and clear
adapter slots (the loader's SlotPort). Never touches arrays.

The engine calls back once per step from its own thread; the outputs cross to
the event loop with a single ``call_soon_threadsafe`` per step.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from ..adapters.recipe import SlotRecipe
from ..lora.pack import PackStats, SlotGeometry, SlotRows
from .engine import Engine
from .outputs import EngineSnapshot, SeqOutput
from .sequence import Sequence


class AsyncEngine:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop | None = None):
        self.engine = engine
        self._loop = loop or asyncio.get_running_loop()
        self._queues: dict[int, asyncio.Queue] = {}
        engine.on_outputs = self._on_outputs

    @property
    def is_alive(self) -> bool:
        return self.engine.is_alive

    def _on_outputs(self, outputs: list[SeqOutput]) -> None:  # engine thread
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[SeqOutput]) -> None:  # event loop
        for out in outputs:
            queue = self._queues.get(out.seq_id)
            if queue is not None:
                queue.put_nowait(out)

    async def generate(self, seq: Sequence) -> AsyncIterator[SeqOutput]:
        """Run ``seq`` (the engine thread owns it from now on: read only the
        outputs); yields its outputs until one carries a finish reason.
        Leaving early (client gone, stop string found) aborts the row."""
        queue: asyncio.Queue = asyncio.Queue()
        # Outputs reach this loop only through _deliver, which cannot run
        # before the queue is in place: nothing is awaited in between.
        seq_id = self.engine.add(seq)
        self._queues[seq_id] = queue
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finish_reason is not None
                yield out
        finally:
            self._queues.pop(seq_id, None)
            if not finished:
                self.engine.abort(seq_id)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread between steps and await its result."""
        return await asyncio.wrap_future(self.engine.call(fn))

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's state as of its last step (immutable)."""
        return self.engine.snapshot

    @property
    def is_group(self) -> bool:
        """Whether the engine leads a tensor-parallel group (engine/distributed.py)."""
        return self.engine.group is not None

    @property
    def pack_stats(self) -> PackStats:
        """The slot packs' sizes as of their last resize (immutable)."""
        return self.engine.pack_stats

    # ---- the slot port (mola.adapters.loader.SlotPort) -----------------------

    @property
    def geometry(self) -> SlotGeometry:
        return self.engine.geometry

    def write_slot(self, slot: int, rows: SlotRows, recipe: SlotRecipe) -> asyncio.Future:
        """Queued behind the engine's commands at once (so that every sequence
        added later sees it); raises EngineUnavailable now if the engine is
        down, or PacksDoNotFit if the packs would grow past the memory free.
        The future ends when the engine thread has written it."""
        if self.engine.is_alive:  # (a stopped engine: call() says so)
            self.engine.check_growth(slot, rows)
        return asyncio.wrap_future(self.engine.call(lambda: self.engine.write_slot(slot, rows, recipe)))

    async def clear_slot(self, slot: int) -> None:
        await self.call(lambda: self.engine.clear_slot(slot))

    async def forget_prompts(self, adapter_keys: list[tuple]) -> int:
        """Drop the prompt cache's entries of unloaded adapters."""
        return await self.call(lambda: self.engine.forget_prompts(adapter_keys))
