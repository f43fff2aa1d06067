"""What the routes share: handed to the app at construction, no globals."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import ServeConfig
from ..engine.client import AsyncEngine
from ..lora.loader import AdapterLoader
from ..lora.registry import AdapterRegistry
from .metrics import Metrics


@dataclass
class ServerState:
    config: ServeConfig
    engine: AsyncEngine
    registry: AdapterRegistry
    loader: AdapterLoader
    tokenizer: Any  # mlx-lm TokenizerWrapper
    base_id: str  # the id clients use for the base model
    base_root: str  # where the base model came from
    max_model_len: int | None  # context limit, when known
    vocab_size: int  # rows of the model's output layer
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    active_sequences: int = 0  # generations admitted and not finished (each choice counts)
    draining: bool = False  # shutting down: no new generations
    # Templating and tokenizing run off the event loop, one at a time: a
    # Hugging Face fast tokenizer must not be used by two threads at once.
    tokenizer_thread: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mola-tokenizer"))

    async def tokenize(self, fn, *args):
        """Run ``fn(*args)`` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    def queued(self) -> int:
        """Sequences waiting beyond what the decode batch holds."""
        return max(0, self.active_sequences - self.config.max_num_seqs)
