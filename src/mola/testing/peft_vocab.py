"""Write PEFT adapters that change the token embedding and the output head, as
``PeftModel.save_pretrained`` writes them (mola/adapters/formats/peft_vocab.py
names the keys and their sources): an Embedding LoRA, a LoRA on ``lm_head``
(a linear's, through save_peft_adapter), trainable tokens, and optionally
PEFT's copies of the base's embedding and head. For tests and devtools.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx

from ..adapters.formats.peft import CONFIG_FILE, PREFIX, WEIGHTS_FILE
from ..adapters.weights import LoRAWeights, ModuleLoRA
from .peft import save_peft_adapter

EMBED = "model.embed_tokens"


def save_peft_vocab_adapter(
    path: str | Path,
    linears: LoRAWeights | None = None,
    *,
    embedding: ModuleLoRA | None = None,
    tokens: dict[str, tuple[list[int], mx.array]] | None = None,
    tokens_as_list: bool = True,
    ensure_weight_tying: bool = False,
    base_copies: dict[str, mx.array] | None = None,
    config_extra: dict | None = None,
) -> Path:
    """Write a PEFT adapter directory: ``linears`` (an lm_head LoRA among them,
    or none), an Embedding LoRA on model.embed_tokens (``embedding``: a = A.T
    [vocab, r], b = B.T [r, hidden]), trainable tokens (``tokens``: PEFT
    module name -> (token ids, their new rows [k, hidden]); with
    ``tokens_as_list`` and only the embedding's, trainable_token_indices is
    PEFT's list form) and ``base_copies`` (key -> tensor, as saved)."""
    path = Path(path)
    if linears is not None and linears.modules:
        save_peft_adapter(path, linears)
        config = json.loads((path / CONFIG_FILE).read_text())
        tensors = dict(mx.load(str(path / WEIGHTS_FILE)))
    else:
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": 8,
                  "lora_alpha": 8, "lora_dropout": 0.0, "use_rslora": False, "use_dora": False, "bias": "none",
                  "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
                  "target_modules": [], "rank_pattern": {}, "alpha_pattern": {}}
        tensors = {}
    if embedding is not None:
        config["target_modules"] = sorted({*config["target_modules"], "embed_tokens"})
        config["rank_pattern"][EMBED] = embedding.rank
        r = embedding.rank  # the lora_alpha that gives its scale at rank r
        config["alpha_pattern"][EMBED] = embedding.scale * (math.sqrt(r) if config["use_rslora"] else r)
        tensors[f"{PREFIX}{EMBED}.lora_embedding_A"] = mx.contiguous(embedding.a.T)  # [r, vocab]
        tensors[f"{PREFIX}{EMBED}.lora_embedding_B"] = mx.contiguous(embedding.b.T)  # [hidden, r]
    if tokens:
        names = list(tokens)
        if tokens_as_list and names == [EMBED]:
            config["trainable_token_indices"] = list(tokens[EMBED][0])
        else:
            config["trainable_token_indices"] = {n.rpartition(".")[2]: list(ids) for n, (ids, _) in tokens.items()}
        for name, (_, values) in tokens.items():
            tensors[f"{PREFIX}{name}.token_adapter.trainable_tokens_delta"] = mx.contiguous(values)
    if ensure_weight_tying:
        config["ensure_weight_tying"] = True
    config.update(config_extra or {})
    tensors.update(base_copies or {})
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / WEIGHTS_FILE), tensors, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return path
