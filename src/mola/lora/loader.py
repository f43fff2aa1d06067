"""Moves adapters between disk and slots.

Files are read and checked on a reader thread of their own (with its own MLX
stream), so a hot load costs the decode loop only the slot write itself, which
runs on the engine thread between two steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

import mlx.core as mx

from ..engine.client import AsyncEngine
from .formats import read_adapter
from .weights import LoRAWeights, compose, validate


def _reader_init() -> None:
    mx.set_default_stream(mx.new_stream(mx.default_device()))


class AdapterLoader:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self._reader = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mola-adapter-reader", initializer=_reader_init
        )

    @property
    def max_rank(self) -> int:
        return self.engine.engine.config.max_lora_rank

    def _read(self, path: Path) -> LoRAWeights:  # reader thread
        eng = self.engine.engine
        config = eng.loaded.config if eng.loaded else None
        weights = read_adapter(path, dtype=eng.dtype, model_type=(config or {}).get("model_type"),
                               model_config=config)
        validate(weights, eng.targets, self.max_rank)
        return weights

    async def read(self, path: str | Path) -> LoRAWeights:
        """Read and validate the adapter at ``path``; raises InvalidAdapter or
        AdapterPathNotFound with a message that names the problem."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._reader, self._read, Path(path))

    def _compose(self, parts: list[tuple[str, float]]) -> LoRAWeights:  # reader thread
        weights = [(self._read(Path(path)), scale) for path, scale in parts]
        return compose(weights, self.max_rank)

    async def compose(self, parts: list[tuple[str, float]]) -> LoRAWeights:
        """Read the parts and stack them into one LoRA (see weights.compose)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._reader, self._compose, parts)

    async def write(self, slot: int, weights: LoRAWeights, scale: float = 1.0,
                    recipe: list[tuple[str, float]] | None = None) -> None:
        """Pad and cast on the reader thread; only the slot writes themselves
        run on the engine thread, between two steps. ``recipe`` says how the
        weights were made ((path, scale) of each part), for the other ranks
        of a tensor-parallel group."""
        eng = self.engine.engine
        loop = asyncio.get_running_loop()
        rows = await loop.run_in_executor(self._reader, eng.packs.prepare, weights, scale)
        await self.engine.call(lambda: eng.store_slot(slot, rows, recipe or [], scale))

    async def clear(self, slot: int) -> None:
        eng = self.engine.engine
        await self.engine.call(lambda: eng.clear_slot(slot))

    def close(self) -> None:
        # MLX wants a thread's streams cleared before the thread ends.
        try:
            self._reader.submit(mx.clear_streams).result(timeout=10)
        except Exception:
            pass
        self._reader.shutdown(wait=True)


def read_recipe(recipe: list[tuple[str, float]], packs, loaded) -> LoRAWeights:
    """The weights a (path, scale) recipe describes, read and checked the way
    rank 0 did (used by the other ranks of a tensor-parallel group)."""
    config = loaded.config
    max_rank = packs.max_rank

    def read(path: str) -> LoRAWeights:
        weights = read_adapter(path, dtype=next(iter(packs.layers.values())).dtype,
                               model_type=config.get("model_type"), model_config=config)
        validate(weights, packs.targets(), max_rank)
        return weights

    if len(recipe) == 1 and recipe[0][1] == 1.0:
        return read(recipe[0][0])
    return compose([(read(path), scale) for path, scale in recipe], max_rank)
