"""LoRA on the token embedding and on the output head, per row of the mixed batch.

PEFT's Embedding LoRA (peft/tuners/lora/layer.py, class ``Embedding``) holds
``lora_embedding_A`` [r, vocab] and ``lora_embedding_B`` [hidden, r] and adds

    scaling * F.embedding(ids, A.T) @ B.T          (scaling = alpha / r, or / sqrt(r))

to the base's rows: the LoRA of a linear fed each token's one-hot. So mola
keeps it as any module's factors, a = A.T [vocab, r] and b = B.T [r, hidden],
in the same slot packs as a MultiLoRALinear (A^T [S, r, vocab], scale * B
[S, r, hidden]); only the forward differs: each token's row of A is gathered
(``a[ids]``) instead of multiplied. A LoRA on ``lm_head`` is a plain linear
LoRA whose output is the vocabulary.

A tied model (mlx-lm computes its logits with ``embed_tokens.as_linear``, and
has no ``lm_head``) gets its head LoRA through :class:`TiedHead`: PEFT puts a
LoRA on ``lm_head`` as on a module of its own, whose weight is the
embedding's, so a LoRA there changes the logits only, and an embedding LoRA
changes the input rows only (unless its config sets ``ensure_weight_tying``,
which mola.adapters.vocab mirrors onto the head, as PEFT ties them).

Packs are sized to what is loaded, like every other layer's: none until an
adapter that targets the embedding or the head is written, then
slots x rank x (vocab + hidden) values (SmolLM2-135M at rank 16: 3.2 MB a
slot and part in float32, as the demo serves it; docs/adapters.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .geometry import WRAPPABLE, TargetGeometry, compute_dtype, full_dims
from .layer import MultiLoRALinear
from .routing import LoRARouting

EMBED_NAME = "embed_tokens"  # mlx-lm's (and Hugging Face's) name of the token embedding
HEAD_PATH = "lm_head"  # mlx-lm's path of an untied output head, and mola's of a tied one


@dataclass(frozen=True)
class VocabGeometry:
    """Where a base model's token embedding and output head are, for adapters
    that change them (any thread may read it)."""

    embed_path: str | None  # e.g. "model.embed_tokens"; None: no embedding mola can wrap
    head_path: str | None  # "lm_head" (a linear, or the tied embedding's as_linear); None: none
    tied: bool  # the head is the embedding's as_linear
    vocab_size: int
    hidden_size: int
    # (path, token ids) -> those rows of that layer's weight, float32 [k, hidden]
    # (dequantized); None where the weights are not at hand (a model read offline).
    rows: Callable[[str, list[int]], mx.array] | None = field(default=None, compare=False, repr=False)


def embedding_dims(embedding: nn.Module) -> tuple[int, int]:
    """(vocab, hidden) of an nn.Embedding or nn.QuantizedEmbedding."""
    vocab, packed = embedding.weight.shape
    return vocab, packed * 32 // embedding.bits if hasattr(embedding, "bits") else packed


class TiedHead(nn.Module):
    """The output head of a tied model as a linear: its embedding's
    ``as_linear``. Holds the embedding outside the module tree (its weights
    are counted once) and has no parameters of its own."""

    def __init__(self, embedding: nn.Module):
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)  # not a child: no second copy in parameters()

    @property
    def weight(self) -> mx.array:  # [vocab, hidden] (packed when quantized): what linear_dims reads
        return self._embedding.weight

    @property
    def scales(self) -> mx.array:
        return self._embedding.scales

    def __getattr__(self, key):
        if key in ("bits", "group_size", "mode"):
            return getattr(self._embedding, key)
        return super().__getattr__(key)

    def __call__(self, x: mx.array) -> mx.array:
        return self._embedding.as_linear(x)  # [B, L, vocab]


class MultiLoRAEmbedding(MultiLoRALinear):
    """A token embedding plus slot-indexed LoRA packs, routed per row; for a
    tied model also the head's packs (``head``), which ``as_linear`` adds."""

    @staticmethod
    def from_base(embedding: nn.Module, routing: LoRARouting, num_slots: int, max_rank: int,
                  tied: bool = False) -> "MultiLoRAEmbedding":
        vocab, hidden = embedding_dims(embedding)
        dtype = compute_dtype(embedding)
        layer = MultiLoRAEmbedding(embedding, routing, vocab, hidden, num_slots, max_rank, dtype)
        layer.head = (MultiLoRALinear(TiedHead(embedding), routing, hidden, vocab, num_slots, max_rank, dtype)
                      if tied else None)
        return layer

    @property
    def full_dims(self) -> tuple[int, int]:
        return self.input_dims, self.output_dims  # (vocab, hidden): a = A.T [vocab, r]

    @property
    def weight(self) -> mx.array:  # for models that read embed_tokens.weight
        return self.base.weight

    def __call__(self, ids: mx.array) -> mx.array:
        y = self.base(ids)  # [B, L, hidden]
        route = self._routing
        if route.single_slot is not None:
            if route.single_slot not in self._ranks:
                return y  # the base, or an adapter that leaves the embedding alone
            a, b = self._slot_view(route.single_slot)  # [vocab, r], [r, hidden]
            z = a[ids]  # [B, L, r]: each token's row of A
            if route.row_scale is not None:
                z = z * route.row_scale
            return y + _cast(z @ b, y.dtype)
        if self._ranks.keys().isdisjoint(route.slots):
            return y
        a, b = self._pack_view()  # [S, vocab, r], [S, r, hidden]
        z = a[route.idx[:, None], ids]  # [B, L, r]: row i's slot, each of its tokens
        if route.row_scale is not None:
            z = z * route.row_scale
        z = mx.gather_mm(z, b, rhs_indices=route.idx)  # [B, L, hidden]
        return y + _cast(z, y.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        """The tied head's logits [B, L, vocab], with its LoRA per row."""
        return self.head(x) if self.head is not None else self.base.as_linear(x)


def _cast(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


# ---- finding and wrapping them in an mlx-lm model -------------------------------------


def _embedding_path(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The token embedding outside the blocks (the shortest path named embed_tokens)."""
    found = [(p, m) for p, m in model.named_modules()
             if p.rpartition(".")[2] == EMBED_NAME and hasattr(m, "as_linear") and hasattr(m, "weight")]
    return min(found, key=lambda pm: len(pm[0])) if found else None


def _uses_as_linear(model: nn.Module) -> bool:
    """Whether the model computes its logits with ``embed_tokens.as_linear``
    (mlx-lm's tied heads; read from its source, since a model that reads the
    embedding's weight instead would bypass the head's packs)."""
    try:
        return "embed_tokens.as_linear" in inspect.getsource(type(model).__call__)
    except (OSError, TypeError):
        return False


def vocab_modules(model: nn.Module) -> tuple[tuple[str, nn.Module] | None, nn.Module | None, bool]:
    """((embed path, embedding) or None, the untied head linear or None, tied)."""
    embed = _embedding_path(model)
    head = model.get(HEAD_PATH) if isinstance(model, dict) else None
    if head is not None and not isinstance(head, WRAPPABLE):
        head = None
    tied = embed is not None and head is None and _uses_as_linear(model)
    return embed, head, tied


def vocab_targets(model: nn.Module) -> dict[str, TargetGeometry]:
    """Module path -> geometry of the embedding (in = vocab) and the head (out = vocab)."""
    embed, head, tied = vocab_modules(model)
    targets = {}
    if embed is not None:
        vocab, hidden = embedding_dims(embed[1])
        targets[embed[0]] = TargetGeometry(vocab, hidden)
        if tied:
            targets[HEAD_PATH] = TargetGeometry(hidden, vocab)
    if head is not None:
        targets[HEAD_PATH] = TargetGeometry(*full_dims(head))
    return targets


def vocab_geometry(model: nn.Module, with_rows: bool = True) -> VocabGeometry | None:
    embed, head, tied = vocab_modules(model)
    if embed is None and head is None:
        return None
    vocab, hidden = embedding_dims(embed[1]) if embed is not None else full_dims(head)[::-1]
    layers = {HEAD_PATH: embed[1] if tied else head}
    if embed is not None:
        layers[embed[0]] = embed[1]
    rows = (lambda path, ids: base_rows(layers[path], ids)) if with_rows else None
    return VocabGeometry(embed[0] if embed else None, HEAD_PATH if head is not None or tied else None,
                         tied, vocab, hidden, rows)


def base_rows(layer: nn.Module, ids: list[int]) -> mx.array:
    """Rows ``ids`` of an embedding's or a head linear's weight [k, hidden], float32."""
    idx = mx.array(ids, dtype=mx.int32)
    if hasattr(layer, "as_linear"):
        rows = layer(idx)  # an embedding (quantized ones dequantize their rows)
    elif hasattr(layer, "dequantized"):
        rows = layer.dequantized()[idx]
    elif hasattr(layer, "bits"):
        rows = mx.dequantize(layer.weight[idx], layer.scales[idx], layer.get("biases")[idx]
                             if layer.get("biases") is not None else None, group_size=layer.group_size,
                             bits=layer.bits, mode=getattr(layer, "mode", "affine"))
    else:
        rows = layer.weight[idx]
    rows = rows.astype(mx.float32)
    mx.eval(rows)
    return rows


def wrap_vocab(model: nn.Module, routing: LoRARouting, num_slots: int,
               max_rank: int) -> tuple[list[tuple[str, nn.Module]], dict[str, MultiLoRALinear]]:
    """Wrap the embedding and the head of ``model``: (what to put into the
    module tree, module path -> the layer whose packs an adapter fills)."""
    embed, head, tied = vocab_modules(model)
    tree, layers = [], {}
    if embed is not None:
        layer = MultiLoRAEmbedding.from_base(embed[1], routing, num_slots, max_rank, tied)
        tree.append((embed[0], layer))
        layers[embed[0]] = layer
        if tied:
            layers[HEAD_PATH] = layer.head
    if head is not None:
        layers[HEAD_PATH] = MultiLoRALinear.from_base(head, routing, num_slots, max_rank)
        tree.append((HEAD_PATH, layers[HEAD_PATH]))
    return tree, layers
