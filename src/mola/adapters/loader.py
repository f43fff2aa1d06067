"""Reads adapters for slots.

Files are read, checked and turned into slot rows on a reader thread of its
own (with its own MLX stream), in one hop per adapter, so a load costs the
decode loop only the slot write itself. The engine's slots are reached
through one narrow :class:`SlotPort` (their geometry, which the reads check
against; writing and clearing a slot, which the registry does); the wiring
lives above both, in the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Awaitable, Protocol

import mlx.core as mx

from ..lora.pack import SlotGeometry, SlotRows, prepare_rows
from .pushed import PushedAdapters, cast
from .recipe import SlotRecipe, fitted, read_recipe
from .weights import LoRAWeights


class SlotPort(Protocol):
    """The engine's adapter slots, as the loader (their geometry) and the
    registry (writes and clears) reach them; mola.engine.async_engine.AsyncEngine
    provides it."""

    @property
    def geometry(self) -> SlotGeometry: ...

    def write_slot(self, slot: int, rows: SlotRows, recipe: SlotRecipe) -> Awaitable[None]:
        """Queue a write of ``rows`` into ``slot`` (``recipe`` says how they
        were made, for the other ranks of a tensor-parallel group): every
        command given to the engine after this call sees the slot written.
        Raises EngineUnavailable at once if the engine is not running; the
        awaitable ends when the write is done."""

    async def clear_slot(self, slot: int) -> None:
        """Zero ``slot`` between two steps."""


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read, checked and made into slot rows: what a slot write
    needs, and what the host tier keeps."""

    rows: SlotRows
    rank: int
    file_scale: float | None  # the scale its file gives (alpha / r), when its modules share one
    format: str
    nbytes: int  # of its factors as read
    expert_nbytes: int = 0  # of those, its expert modules' (mixtures of experts)
    targets: tuple[str, ...] = ()  # the kinds of module it adapts (LoRAWeights.targets)
    invocation_tokens: tuple[int, ...] | None = None  # an activated LoRA's (LoRAWeights.invocation_tokens)
    kind: str = "lora"  # "lora", "alora" or "dora" (LoRAWeights.kind)
    vocab: dict | None = None  # its embedding/head parts (mola.adapters.vocab.VocabParts.describe); None: none

    @property
    def host_bytes(self) -> int:
        return self.rows.nbytes


def prepare(recipe: SlotRecipe, geometry: SlotGeometry, model_config: dict | None,
            pushed: PushedAdapters | None = None) -> PreparedAdapter:
    """Read, check and prepare ``recipe`` (any thread; the reader thread runs
    it); pushed adapters are read from ``pushed``."""
    return _prepared(read_recipe(recipe, geometry, model_config, pushed), geometry, recipe.slot_scale)


def prepare_pushed(weights: LoRAWeights, geometry: SlotGeometry, slot_scale: float) -> PreparedAdapter:
    """Check and prepare the factors of a push, as sent (any thread)."""
    weights = fitted(cast(weights, geometry.dtype), geometry)
    return _prepared(weights, geometry, slot_scale)


def _prepared(weights: LoRAWeights, geometry: SlotGeometry, slot_scale: float) -> PreparedAdapter:
    rows = prepare_rows(weights, geometry, slot_scale)
    return PreparedAdapter(rows, weights.rank, weights.scale, weights.format, weights.nbytes,
                           weights.expert_nbytes, weights.targets, weights.invocation_tokens, weights.kind,
                           weights.vocab.describe() if weights.vocab is not None else None)


def _reader_init() -> None:
    mx.set_default_stream(mx.new_stream(mx.default_device()))


class AdapterLoader:
    def __init__(self, port: SlotPort, model_config: dict | None = None):
        self.port = port  # the engine's slots: their geometry here; the registry writes and clears them
        self.model_config = model_config or {}
        self.pushed = PushedAdapters()  # this base's pushed factors, read like files (the registry keeps them)
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

    async def on_reader(self, fn, *args):
        """``fn(*args)`` on the reader thread (a push parses its body and
        prepares its rows there in one hop)."""
        return await self._off_thread(fn, *args)

    async def prepare(self, recipe: SlotRecipe) -> PreparedAdapter:
        """Read and check the adapter(s) of ``recipe`` (several are stacked
        into one LoRA, see weights.stack_weights) and make its slot rows, on the
        reader thread; raises InvalidAdapter or AdapterPathNotFound with a
        message that names the problem."""
        return await self._off_thread(prepare, recipe, self.geometry, self.model_config, self.pushed)

    def close(self) -> None:
        self.pushed.clear()  # the base's pushed factors go with it
        # MLX wants a thread's streams cleared before the thread ends.
        try:
            self._reader.submit(mx.clear_streams).result(timeout=10)
        except Exception:
            pass
        self._reader.shutdown(wait=True)
