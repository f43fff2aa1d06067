"""cohere (llama.cpp command-r) and cohere2 as convert_hf_to_gguf.py's CommandR2Model
and Cohere2Model (conversion/command_r.py) write them: TextModel's keys (its
layer_norm_eps -> attention.layer_norm_epsilon), logit_scale, rope scaling type
none; cohere2 also sliding_window, vocab_size and rope.dimension_count =
int(rotary_pct * head_dim). Tensors go as they are (gguf-py's TensorNameMap names
them; Cohere2Model only drops all-zero biases, which mlx-lm's models here have none of).

The tiny models: a non-default logit scale and epsilon; cohere2 with a sliding
window shorter than the test prompt and a period of 2 (a global layer 1). llama.cpp's
cohere2 reads the period from attention.sliding_window_pattern with a default of 4
(Command R7B's), and Cohere2Model writes none; the twin writes the pattern, as
Cohere2MoeModel writes it (one flag per layer), only where it is not 4, because
mlx-lm's cohere2 cannot run fewer layers than its period (the 2-layer tiny model)."""

from __future__ import annotations

from .twin import Twin


def _cohere_config(spec) -> dict:
    return {"layer_norm_eps": 2e-5, "logit_scale": 0.375, "use_qk_norm": False}


def _cohere2_config(spec) -> dict:
    return {"layer_norm_eps": 2e-5, "logit_scale": 0.3125, "sliding_window": 5, "sliding_window_pattern": 2,
            "head_dim": spec.hidden_size // spec.num_attention_heads, "rotary_pct": 1.0}


def _text_model(writer, config: dict) -> None:
    """What TextModel.set_gguf_parameters writes beyond gguf_model._hyperparameters
    (find_hparam(["layer_norm_eps", ...], optional=True): nothing without it)."""
    if config.get("layer_norm_eps") is not None:
        writer.add_layer_norm_eps(config["layer_norm_eps"])


def _cohere_hparams(writer, config: dict) -> None:
    """CommandR2Model.set_gguf_parameters."""
    from gguf import RopeScalingType

    _text_model(writer, config)
    writer.add_logit_scale(config["logit_scale"])
    writer.add_rope_scaling_type(RopeScalingType.NONE)


def _cohere2_hparams(writer, config: dict) -> None:
    """Cohere2Model.set_gguf_parameters (and the pattern, see the module's note)."""
    from gguf import RopeScalingType

    _text_model(writer, config)
    writer.add_logit_scale(config["logit_scale"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(int(config["rotary_pct"] * head_dim))
    writer.add_rope_scaling_type(RopeScalingType.NONE)
    period = config.get("sliding_window_pattern", 4)
    if period != 4:
        writer.add_sliding_window_pattern(
            [i % period != period - 1 for i in range(config["num_hidden_layers"])])


TWINS = {
    "cohere": Twin(tiny_config=_cohere_config, hparams=_cohere_hparams),
    "cohere2": Twin(tiny_config=_cohere2_config, hparams=_cohere2_hparams),
}
