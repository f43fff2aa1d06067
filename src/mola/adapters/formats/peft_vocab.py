"""PEFT's LoRA on the token embedding and its trainable tokens, as
``PeftModel.save_pretrained`` writes them (peft/utils/save_and_load.py drops
the adapter name from every key):

    base_model.model.model.embed_tokens.lora_embedding_A    [r, vocab]    (peft/tuners/lora/layer.py, Embedding)
    base_model.model.model.embed_tokens.lora_embedding_B    [hidden, r]
    base_model.model.<layer>.token_adapter.trainable_tokens_delta   [k, hidden]   (TrainableTokensLayer)
    base_model.model.model.embed_tokens.base_layer.weight,
    base_model.model.lm_head.weight                          copies of the base's (save_embedding_layers)

with adapter_config.json's ``trainable_token_indices`` (a list of token ids on
the input embedding, or {layer name: ids}) and ``ensure_weight_tying``. A LoRA
on ``lm_head`` is a linear's (peft.py reads it). The copies of the base's
embedding and head are not read: PEFT saves them by default when the
embedding is targeted, and they equal the base unless the vocabulary was
resized, which a copy of another row count shows and is refused.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import mlx.core as mx

from ...errors import InvalidAdapter
from ...lora.tokens import TrainableTokens
from ..vocab import VocabParts
from ..weights import ModuleLoRA
from .peft_config import module_scale, targets_module

log = logging.getLogger("mola.adapters")

PREFIX = "base_model.model."
EMBED_FACTOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<factor>lora_embedding_[AB])(?:\.[^.]+)?$")
TOKENS_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.token_adapter\."
                        r"(?P<what>trainable_tokens_delta|trainable_tokens_original)(?:\.[^.]+)?$")
BASE_COPY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:.+\.)?(?:embed_tokens|lm_head))(?:\.base_layer)?"
                       r"\.weight$")


def read_vocab_parts(config: dict, tensors: dict[str, mx.array], path: Path, weights_file: Path,
                     model_config: dict | None) -> tuple[dict, dict[str, ModuleLoRA], VocabParts | None]:
    """(the tensors left for the linears' LoRA, embedding LoRA modules by
    module path, the trainable tokens and tying to resolve against the base)."""
    vocab_size = (model_config or {}).get("vocab_size")
    rest, embeds, deltas = {}, {}, {}
    for key, t in tensors.items():
        if m := EMBED_FACTOR.match(key):
            embeds.setdefault(m["module"], {})[m["factor"]] = t
        elif m := TOKENS_KEY.match(key):
            if m["what"] == "trainable_tokens_delta":
                deltas[m["module"]] = t
        elif m := BASE_COPY.match(key):
            _check_copy(key, t, vocab_size, path)
        else:
            rest[key] = t
    modules = {module: _embedding_lora(module, f, config, path, weights_file) for module, f in sorted(embeds.items())
               if targets_module(config, module)}
    tokens = _trainable_tokens(config, deltas, path)
    _check_added_tokens(path, vocab_size)
    tie = bool(config.get("ensure_weight_tying"))
    if not tokens and not (tie and modules):
        return rest, modules, None
    return rest, modules, VocabParts(tokens=tokens, tie_embedding_lora=tie)


def _embedding_lora(module: str, factors: dict, config: dict, path: Path, weights_file: Path) -> ModuleLoRA:
    """PEFT's Embedding LoRA: a = lora_embedding_A.T [vocab, r], b = lora_embedding_B.T [r, hidden]."""
    a, b = factors.get("lora_embedding_A"), factors.get("lora_embedding_B")
    if a is None or b is None:
        missing = "lora_embedding_A" if a is None else "lora_embedding_B"
        raise InvalidAdapter(f"{weights_file}: {module} has no {missing}.")
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise InvalidAdapter(f"{weights_file}: {module} has lora_embedding_A {tuple(a.shape)} and lora_embedding_B "
                             f"{tuple(b.shape)}; expected [r, vocab] and [hidden, r].")
    r, scale = module_scale(config, module)
    if r != a.shape[0]:
        raise InvalidAdapter(f"Adapter at {path}: rank mismatch in {module}: its factors have rank {a.shape[0]} "
                             f"but adapter_config.json gives r={r} (after rank_pattern).")
    return ModuleLoRA(a=a.T, b=b.T, scale=scale)


def _token_layers(config: dict, path: Path) -> dict[str, list[int]]:
    """trainable_token_indices as {layer name: token ids}; a list is on the input embedding."""
    value = config.get("trainable_token_indices")
    if not value:
        return {}
    layers = value if isinstance(value, dict) else {"embed_tokens": value}
    for name, ids in layers.items():
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                            for i in ids):
            raise InvalidAdapter(f"Adapter at {path}: trainable_token_indices of {name!r} must be a non-empty list "
                                 f"of token ids, got {ids!r}.")
        if len(set(ids)) != len(ids):
            raise InvalidAdapter(f"Adapter at {path}: trainable_token_indices of {name!r} repeats a token: {ids}.")
    return layers


def _trainable_tokens(config: dict, deltas: dict[str, mx.array], path: Path) -> tuple[TrainableTokens, ...]:
    """The saved rows of each layer with trainable tokens, matched to its ids."""
    layers = _token_layers(config, path)
    if deltas and not layers:
        raise InvalidAdapter(f"Adapter at {path} holds trainable token rows ({', '.join(sorted(deltas))}) but its "
                             "adapter_config.json has no trainable_token_indices.")
    embed_ids = next((ids for n, ids in layers.items() if n.rpartition(".")[2] == "embed_tokens"), None)
    head_ids = next((ids for n, ids in layers.items() if n.rpartition(".")[2] == "lm_head"), None)
    separate = head_ids is not None and embed_ids is not None and head_ids != embed_ids
    if separate and config.get("ensure_weight_tying"):
        raise InvalidAdapter(f"Adapter at {path} ties its trainable tokens (ensure_weight_tying) but gives the "
                             f"embedding {embed_ids} and the head {head_ids}; PEFT refuses this too.")
    out = []
    for module, values in sorted(deltas.items()):
        name = next((n for n in layers if module == n or module.endswith(f".{n}")), None)
        if name is None:
            raise InvalidAdapter(f"Adapter at {path} holds trainable token rows for {module}, which its "
                                 f"trainable_token_indices ({sorted(layers)}) does not name.")
        ids = layers[name]
        if values.ndim != 2 or values.shape[0] != len(ids):
            raise InvalidAdapter(f"Adapter at {path}: {module}'s trainable_tokens_delta has shape "
                                 f"{tuple(values.shape)}, expected ({len(ids)}, hidden) for tokens {ids}.")
        is_embed = name.rpartition(".")[2] == "embed_tokens"
        out.append(TrainableTokens(module, tuple(ids), values, tied=is_embed and not separate))
    named = {n for n in layers if any(t.path == n or t.path.endswith(f".{n}") for t in out)}
    unsaved = sorted(n for n in set(layers) - named 
                     if not (n.rpartition(".")[2] == "lm_head" and embed_ids is not None and not separate))
    if unsaved:
        raise InvalidAdapter(f"Adapter at {path}: trainable_token_indices names {unsaved}, but the weights hold no "
                             "trainable_tokens_delta for it.")
    return tuple(out)


def _check_copy(key: str, t: mx.array, vocab_size: int | None, path: Path) -> None:
    if vocab_size is not None and t.ndim == 2 and t.shape[0] != vocab_size:
        raise InvalidAdapter(
            f"Adapter at {path} holds {key} with {t.shape[0]} token rows, but the base model's vocabulary has "
            f"{vocab_size}: the vocabulary was resized (new tokens), which mola does not serve.")
    log.info("Adapter at %s: %s is PEFT's copy of the base's layer; not read.", path, key)


def _check_added_tokens(path: Path, vocab_size: int | None) -> None:
    """Refuse tokens that an adapter's own tokenizer files add beyond the base's vocabulary."""
    added = Path(path) / "added_tokens.json"
    if vocab_size is None or not added.is_file():
        return
    try:
        tokens = json.loads(added.read_text())
    except (OSError, ValueError):
        return
    new = sorted((i, t) for t, i in tokens.items() if isinstance(i, int) and i >= vocab_size) \
        if isinstance(tokens, dict) else []
    if new:
        shown = ", ".join(f"{t!r} ({i})" for i, t in new[:8]) + (" ..." if len(new) > 8 else "")
        raise InvalidAdapter(f"Adapter at {path} adds tokens beyond the base model's vocabulary of {vocab_size}: "
                             f"{shown}; a tokenizer extended with new tokens is not served.")
