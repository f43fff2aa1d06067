"""What one base serves requests with (its AsyncEngine, registry, tokenizer,
prompt lanes): built by server/startup.py, handed to the pipeline, no globals."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..config import ServeConfig
from ..engine.async_engine import AsyncEngine
from ..engine.kv_budget import KVBudget
from ..adapters.loader import AdapterLoader
from ..registry.registry import AdapterRegistry
from ..models.eog import special_token_ids
from ..structured import StructuredOutputs
from .prompts import PromptLanes
from .reasoning import ReasoningFormat


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
    structured: StructuredOutputs  # response_format / tool_choice -> grammars
    reasoning: ReasoningFormat | None = None  # how the model's thinking is split off (--reasoning-parser)
    kv_budget: KVBudget | None = None  # what the batches' KV caches may hold (None: no budget)
    metrics: Any = None  # server/metrics.py's Metrics (shared by every base's state)
    created: int = field(default_factory=lambda: int(time.time()))
    active_sequences: int = 0  # generations accepted and not finished (each choice counts)
    draining: bool = False  # shutting down: no new generations
    weight_bytes: int = 0  # the model's weights in memory, its slot packs not counted (0: not known)
    takes_images: bool = False  # chat messages may carry images (a vision-language base; LoadedModel's)
    vision: Any = None  # a vision base's prompts with images (frontend.vision_prompt.VisionPrompter)
    # Templating and tokenizing, off the event loop, on two lanes (short and
    # long prompts), each with its own tokenizer.
    prompts: PromptLanes = field(init=False)
    # What skip_special_tokens leaves out of the text (models/eog.py).
    special_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self):
        self.prompts = PromptLanes(self.tokenizer, self.vocab_size, self.max_model_len)
        self.special_token_ids = special_token_ids(self.tokenizer)

    def queued(self) -> int:
        """Sequences waiting beyond what the decode batch holds."""
        return max(0, self.active_sequences - self.config.engine.max_num_seqs)
