"""Server configuration: one frozen dataclass, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .engine.engine import EngineConfig


@dataclass(frozen=True)
class ServeConfig:
    # The base model: a local directory or a Hugging Face hub id. None serves
    # the embedded demo (a small model and demo adapters built offline).
    model: str | None = None
    # The id clients use for the base model (default: the directory's name).
    served_model_name: str | None = None
    # Adapters loaded at start: (name, path) pairs.
    adapters: tuple[tuple[str, str], ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    max_loras: int = 8  # adapter slots decoded together
    max_lora_rank: int = 64  # largest adapter rank a slot holds
    max_num_seqs: int = 32  # rows in one decode batch
    prefill_step_size: int = 512  # prompt tokens prefilled per engine step
    max_model_len: int | None = None  # context limit; None: the model's own
    # max_tokens when a request sets none and the model declares no context
    # limit (otherwise the default is whatever room the context has left).
    default_max_tokens: int = 2048
    log_level: str = "info"
    cache_dir: Path | None = None  # where the demo is built (default ~/.cache/mola)
    engine: EngineConfig = field(init=False)

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        names = [name for name, _ in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"adapter names given more than once: {', '.join(dupes)}")
        if self.served_model_name is not None and self.served_model_name in names:
            raise ValueError(
                f"adapter name '{self.served_model_name}' is also the base model's name"
            )
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"unknown log level {self.log_level!r}")
        # Raises on its own bad values (max_loras, ranks, batch sizes).
        object.__setattr__(
            self,
            "engine",
            EngineConfig(
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                max_num_seqs=self.max_num_seqs,
                prefill_step_size=self.prefill_step_size,
            ),
        )


def parse_adapter_arg(value: str) -> tuple[str, str]:
    """NAME=PATH -> (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"expected NAME=PATH, got {value!r}")
    return name.strip(), path.strip()
