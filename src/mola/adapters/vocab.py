"""What an adapter changes of the token embedding and the output head, made
into plain factors against the base it is loaded on.

A format reader (PEFT's: formats/peft_vocab.py) gives LoRA on the embedding
and the head as ordinary modules (mola.lora.embedding says how the packs
apply them) and leaves in :class:`VocabParts` what needs the base:

- trainable tokens, rows that replace the base's (mola.lora.tokens turns
  them into factors with the base's own rows, so the base must be at hand:
  :func:`resolve_vocab` runs where an adapter is checked against the slots'
  geometry);
- whether an embedding LoRA is tied to the head (PEFT's
  ``ensure_weight_tying``, which on a tied model gives ``lm_head`` the LoRA
  ``lora_A = lora_embedding_B.T``, ``lora_B = lora_embedding_A.T``: the same
  delta of the one shared matrix, seen from the head).

Which base is tied is the base's business (mola.lora.embedding.VocabGeometry).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..errors import InvalidAdapter
from ..lora.slot_rows import SlotGeometry
from ..lora.tokens import TrainableTokens, embedding_factors, head_factors
from .vocab_parts import VocabParts
from .weights import LoRAWeights, ModuleLoRA

__all__ = ["VocabParts", "file_parts", "resolve_vocab"]


def resolve_vocab(weights: LoRAWeights, geometry: SlotGeometry) -> LoRAWeights:
    """``weights`` with its trainable tokens made into factors on the
    embedding and the head, its embedding LoRA mirrored onto a tied head when
    tied, and a summary of those parts (None when it has none); InvalidAdapter
    naming what cannot be applied exactly."""
    g, parts = geometry.vocab, weights.vocab or VocabParts()
    where = weights.source
    if g is None:
        if parts.tokens:
            raise InvalidAdapter(f"Adapter at {where} trains token embeddings (trainable_token_indices), but the "
                                 "base model has no token embedding mola can adapt.")
        return weights
    embed, head = g.embed_path, g.head_path
    modules = dict(weights.modules)
    summary = dict(embedding_rank=_rank(modules.get(embed)), head_rank=_rank(modules.get(head)))
    if parts.tie_embedding_lora and g.tied and embed in modules:
        m = modules[embed]  # a [vocab, r], b [r, hidden]: the head's is b.T [hidden, r], a.T [r, vocab]
        modules[head] = ModuleLoRA(a=m.b.T, b=m.a.T, scale=m.scale)
        summary["head_rank"] = m.rank
    for t in parts.tokens:
        _check_tokens(t, g, where, geometry.max_rank)
        onto = [t.path] + ([head] if t.path == embed and t.tied and g.tied else [])
        clash = [p for p in onto if p in modules]
        if clash:
            raise InvalidAdapter(
                f"Adapter at {where} has both LoRA and trainable tokens on {clash[0]}; mola applies one of "
                "them to a layer, not both (PEFT's trainable tokens replace rows of the base weight).")
        rows = g.rows(t.path, list(t.indices)) if g.rows is not None else mx.zeros(t.values.shape)  # offline: shapes
        delta = t.values.astype(mx.float32) - rows  # [k, hidden]
        for path in onto:
            make = embedding_factors if path == embed else head_factors
            a, b = make(t.indices, delta, g.vocab_size)
            modules[path] = ModuleLoRA(a=a, b=b, scale=1.0)
            summary["embedding_tokens" if path == embed else "head_tokens"] = t.count
    if weights.invocation_tokens is not None and (embed in modules or head in modules):
        raise InvalidAdapter(f"Adapter at {where} is an activated LoRA that changes the token embedding or the "
                             "output head; mola applies activated LoRA on the blocks' linears only.")
    mx.eval([(m.a, m.b) for m in modules.values()])
    vocab = VocabParts(**summary) if any(summary.values()) else None
    return dataclasses.replace(weights, modules=modules, vocab=vocab)


def file_parts(weights: LoRAWeights) -> dict | None:
    """What an adapter's files hold for the embedding and the head, before any
    base is known (mola validate without --model): None when nothing."""
    embed = next((m for p, m in weights.modules.items() if p.rpartition(".")[2] == "embed_tokens"), None)
    parts = weights.vocab or VocabParts()
    tokens = {t.path: t.count for t in parts.tokens}
    summary = VocabParts(embedding_rank=_rank(embed), head_rank=_rank(weights.modules.get("lm_head")),
                         embedding_tokens=sum(n for p, n in tokens.items() if p.endswith("embed_tokens")),
                         head_tokens=tokens.get("lm_head", 0)).describe()
    if not any(summary.values()):
        return None
    return {**summary, "tied": bool(parts.tie_embedding_lora or any(t.tied for t in parts.tokens))}


def _rank(m: ModuleLoRA | None) -> int:
    return 0 if m is None else m.rank


def _check_tokens(t: TrainableTokens, g, where: str, max_rank: int) -> None:
    if t.path not in (g.embed_path, g.head_path):
        raise InvalidAdapter(f"Adapter at {where} trains tokens of {t.path}, which the base model does not have "
                             f"(its embedding is {g.embed_path}, its head {g.head_path}).")
    beyond = sorted(i for i in t.indices if i >= g.vocab_size)
    if beyond:
        raise InvalidAdapter(
            f"Adapter at {where} trains tokens {beyond} (trainable_token_indices), beyond the base model's "
            f"vocabulary of {g.vocab_size}: it extends the tokenizer with new tokens, which mola does not serve.")
    if t.count > max_rank:
        raise InvalidAdapter(
            f"Adapter at {where} trains {t.count} token rows of {t.path}; mola holds them as a LoRA of rank "
            f"{t.count} there, above the server's --max-lora-rank {max_rank}.")
    if tuple(t.values.shape) != (t.count, g.hidden_size):
        raise InvalidAdapter(
            f"Adapter at {where}: the trainable tokens of {t.path} have values of shape {tuple(t.values.shape)}, "
            f"expected ({t.count}, {g.hidden_size}) for {t.count} tokens of the base's hidden size.")
