"""What an adapter changes of the token embedding and the output head beyond
plain factors, as a format reader leaves it for mola.adapters.vocab to
resolve against the base, and the summary of its parts once resolved."""

from __future__ import annotations

from dataclasses import dataclass

from ..lora.tokens import TrainableTokens


@dataclass(frozen=True)
class VocabParts:
    """An adapter's changes to the embedding and the head: what the reader
    found (``tokens``, ``tie_embedding_lora``) and, once resolved, a summary."""

    tokens: tuple[TrainableTokens, ...] = ()  # rows still to be made into factors
    tie_embedding_lora: bool = False  # PEFT's ensure_weight_tying
    embedding_rank: int = 0  # rank of its LoRA on the embedding (0: none)
    head_rank: int = 0  # rank of its LoRA on the head, a tied one included (0: none)
    embedding_tokens: int = 0  # embedding rows it replaces
    head_tokens: int = 0  # head rows it replaces (a tied head's, or the head's own)

    def describe(self) -> dict:
        """For /v1/models and mola validate."""
        return {"embedding_lora_rank": self.embedding_rank, "head_lora_rank": self.head_rank,
                "embedding_tokens": self.embedding_tokens, "head_tokens": self.head_tokens}
