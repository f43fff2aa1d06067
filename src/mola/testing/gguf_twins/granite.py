"""granite as convert_hf_to_gguf.py writes it (conversion/granite.py GraniteModel, a
LlamaModel: q/k rows permuted by gguf_model.py, head_dim popped from the config): its
set_gguf_parameters adds each Hugging Face multiplier that is set (truthy) as llama.cpp's
scale: attention_multiplier -> attention.scale, embedding_multiplier -> embedding_scale,
residual_multiplier -> residual_scale, logits_scaling -> logit_scale."""

from __future__ import annotations

from .twin import Twin


def _tiny_config(spec) -> dict:
    """Scales far from 1 (and an attention scale other than 1 / sqrt(head size)), so that
    a multiplier mapped wrongly or not at all changes the logits."""
    return {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
            "logits_scaling": 8.0, "attention_bias": False, "mlp_bias": False}


def _hparams(writer, config: dict) -> None:
    for key, add in (("attention_multiplier", writer.add_attention_scale),
                     ("embedding_multiplier", writer.add_embedding_scale),
                     ("residual_multiplier", writer.add_residual_scale),
                     ("logits_scaling", writer.add_logit_scale)):
        if config.get(key):
            add(config[key])


TWINS = {"granite": Twin(tiny_config=_tiny_config, hparams=_hparams)}
