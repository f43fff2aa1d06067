"""Adapters that change the token embedding and the output head, and their
reference computed another way: plain mlx-lm with each part merged into the
weights (an untied copy of a tied model, so that the head can differ from
the embedding as PEFT's does)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from mola.adapters.formats import read_adapter
from mola.adapters.weights import LoRAWeights, ModuleLoRA
from mola.testing.adapter import make_random_adapter
from mola.testing.peft_vocab import save_peft_vocab_adapter

EMBED = "model.embed_tokens"
TOKEN_IDS = [3, 40, 41, 97, 200, 255]  # replaced rows: specials and common BPE pieces


def tied_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with tie_word_embeddings: true (mlx-lm then drops lm_head and uses embed_tokens.as_linear)."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return out


def _normal(shape, seed, std):
    return mx.array(np.random.default_rng(seed).normal(0, std, shape).astype(np.float32))


def make_vocab_adapters(root: Path, model_dir: Path, tied: bool) -> dict[str, Path]:
    """Adapters of each kind for the tiny model at ``model_dir`` (vocab V, hidden H)."""
    config = json.loads((model_dir / "config.json").read_text())
    V, H = config["vocab_size"], config["hidden_size"]
    out = {"lin": make_random_adapter(root / "lin", model_dir, rank=4, keys=("self_attn.q_proj", "self_attn.v_proj"),
                                      seed=11)}
    q = make_random_adapter(root / "q", model_dir, rank=4, keys=("self_attn.q_proj",), seed=12)
    emb = ModuleLoRA(a=_normal((V, 4), 1, 1.0), b=_normal((4, H), 2, 0.3), scale=2.0)
    out["emb"] = save_peft_vocab_adapter(root / "emb", read_adapter(q), embedding=emb)
    head = LoRAWeights("head", "peft", {"lm_head": ModuleLoRA(a=_normal((H, 8), 3, 0.5), b=_normal((8, V), 4, 0.5),
                                                               scale=0.5)})
    out["head"] = save_peft_vocab_adapter(root / "head", head)
    rows = _normal((len(TOKEN_IDS), H), 5, 1.0)
    out["tok"] = save_peft_vocab_adapter(root / "tok", tokens={EMBED: (TOKEN_IDS, rows)})
    if tied:  # an embedding LoRA tied to the head (PEFT's ensure_weight_tying)
        out["tie"] = save_peft_vocab_adapter(root / "tie", embedding=emb, ensure_weight_tying=True)
    return out


def merged_vocab_model(model_dir: Path, adapter_dir: Path | None, tied: bool, scale: float = 1.0):
    """Plain mlx-lm on ``model_dir``, untied (lm_head a copy of the embedding
    when tied), with the adapter merged: linears and the head W += scale *
    (a @ b).T, the embedding E += scale * a @ b, trainable tokens E[i] = v
    (and the tied head's rows too), an embedding LoRA tied by
    ensure_weight_tying also on the head. A quantized base is dequantized. ``scale`` multiplies every delta
    (a token's row becomes e + scale * (v - e), as mola's lora_scale does)."""
    from mlx_lm.utils import dequantize_model, load_model

    model, _ = load_model(Path(model_dir), model_config={"tie_word_embeddings": False}, strict=False)
    model = dequantize_model(model)  # a quantized base: merged into its float weights
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if adapter_dir is None:
        return model
    weights = read_adapter(adapter_dir)
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    modules = dict(model.named_modules())
    embed, head = model.model.embed_tokens, model.lm_head
    for path, m in weights.modules.items():
        delta = scale * m.scale * (m.a @ m.b)  # [in, out]
        if path == EMBED:
            embed.weight = embed.weight + delta  # [vocab, hidden]
            if tied and config.get("ensure_weight_tying"):
                head.weight = head.weight + delta
        else:
            modules[path].weight = modules[path].weight + delta.T
    tokens = weights.vocab.tokens if weights.vocab else ()
    for t in tokens:
        idx = mx.array(t.indices)
        new = embed.weight[idx] + scale * (t.values - embed.weight[idx])
        embed.weight[idx] = new
        if tied:
            head.weight[idx] = new
    mx.eval(model.parameters())
    return model
