"""Moves adapters between disk and slots.

Files are read, checked and turned into slot rows on a reader thread of its
own (with its own MLX stream), so a hot load costs the decode loop only the
slot write itself, which the engine runs between two steps. The engine is
reached through a narrow :class:`SlotPort` (write a slot, clear a slot, the
slot geometry); the wiring of the two lives above both, in the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Protocol

import mlx.core as mx

from .pack import SlotGeometry, SlotRows, prepare_rows
from .recipe import Recipe, read_checked, read_recipe
from .weights import LoRAWeights


class SlotPort(Protocol):
    """What the loader needs of the engine (mola.engine.client.AsyncEngine
    provides it)."""

    @property
    def geometry(self) -> SlotGeometry: ...

    async def write_slot(self, slot: int, rows: SlotRows, recipe: Recipe) -> None:
        """Write ``rows`` into ``slot`` between two steps; ``recipe`` says how
        they were made, for the other ranks of a tensor-parallel group."""

    async def clear_slot(self, slot: int) -> None:
        """Zero ``slot`` between two steps."""


def _reader_init() -> None:
    mx.set_default_stream(mx.new_stream(mx.default_device()))


class AdapterLoader:
    def __init__(self, port: SlotPort, model_config: dict | None = None):
        self.port = port
        self.model_config = model_config or {}
        self._reader = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mola-adapter-reader", initializer=_reader_init
        )

    @property
    def geometry(self) -> SlotGeometry:
        return self.port.geometry

    @property
    def max_rank(self) -> int:
        return self.geometry.max_rank

    async def _off_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._reader, fn, *args)

    async def read(self, path: str) -> LoRAWeights:
        """Read and check the adapter at ``path``; raises InvalidAdapter or
        AdapterPathNotFound with a message that names the problem."""
        return await self._off_thread(read_checked, str(path), self.geometry, self.model_config)

    async def build(self, recipe: Recipe) -> LoRAWeights:
        """The weights of ``recipe``: one adapter, or several stacked into one
        LoRA (see weights.compose)."""
        return await self._off_thread(read_recipe, recipe, self.geometry, self.model_config)

    async def place(self, slot: int, weights: LoRAWeights, recipe: Recipe) -> None:
        """Put ``weights`` (made from ``recipe``) into ``slot``: padded and cast
        on the reader thread; only the copy runs on the engine thread."""
        rows = await self._off_thread(prepare_rows, weights, self.geometry, recipe.scale)
        await self.port.write_slot(slot, rows, recipe)

    async def remove(self, slot: int) -> None:
        """Empty ``slot``."""
        await self.port.clear_slot(slot)

    def close(self) -> None:
        # MLX wants a thread's streams cleared before the thread ends.
        try:
            self._reader.submit(mx.clear_streams).result(timeout=10)
        except Exception:
            pass
        self._reader.shutdown(wait=True)
