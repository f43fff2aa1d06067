"""Build small mlx-lm models offline: random weights of a real mlx-lm
architecture (llama by default), with the byte-level BPE tokenizer and ChatML
template of mola.demo.tokenizer, written to a directory that ``mlx_lm.load``
accepts. Used by tests, benchmarks and devtools.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from ..demo.tokenizer import train_tokenizer
from .gguf_twins import TWINS

# mlx-lm mixture-of-experts architectures make_tiny_model makes.
MOE_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny random-weight model (llama by default). The defaults make a ~0.2M-parameter
    model that loads and decodes in milliseconds."""

    hidden_size: int = 64  # width of the residual stream
    num_hidden_layers: int = 2
    intermediate_size: int = 128  # MLP width
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention
    vocab_size: int = 512  # BPE vocabulary trained on the corpus
    max_position_embeddings: int = 2048  # the context mola will accept
    # Random linears are scaled by this: a plain initialisation makes a model
    # that repeats one token; larger weights make greedy output vary with the
    # prompt and with the adapter.
    weight_gain: float = 3.0
    seed: int = 0
    dtype: str = "float32"  # "float32", "bfloat16" or "float16"
    quantize_bits: int | None = None  # e.g. 4: an nn.QuantizedLinear base
    quantize_group_size: int = 32
    # Also "qwen2" (q/k/v biases) and "qwen3" (q/k norms), and the mixtures of
    # experts in MOE_TYPES.
    model_type: str = "llama"
    # Norm weights are 1 + this * N(0, 1), so that swapped norms change the output.
    norm_noise: float = 0.0
    # Mixtures of experts (model_type in MOE_TYPES): experts per MoE layer, how
    # many each token is routed to, and each expert's width (mixtral and
    # gpt_oss use intermediate_size for it).
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 48  # qwen2_moe's shared expert
    # More special tokens for the vocabulary, after mola.demo.tokenizer.SPECIAL_TOKENS (e.g. "<|eot_id|>").
    extra_special_tokens: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_TYPES

    def config(self) -> dict:
        extra = {}
        head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type in ("qwen3", "qwen3_moe", "gpt_oss"):
            extra["head_dim"] = head_dim
        if self.model_type in ("qwen3_moe", "qwen2_moe"):
            extra.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                         moe_intermediate_size=self.moe_intermediate_size)
        if self.model_type == "qwen3_moe":
            extra.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        if self.model_type == "qwen2_moe":
            extra["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if self.model_type in ("mixtral", "gpt_oss"):
            extra.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok)
        if self.model_type == "gpt_oss":  # alternating sliding-window and full attention
            extra.update(sliding_window=128, layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)])
        twin = TWINS.get(self.model_type)
        if twin is not None and twin.tiny_config is not None:  # the GGUF families' own keys
            extra.update(twin.tiny_config(self))
        return {
            **extra,
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
        }


def random_model(spec: TinyModelSpec) -> nn.Module:
    import importlib

    arch = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    mx.random.seed(spec.seed)
    model = arch.Model(arch.ModelArgs.from_dict(spec.config()))
    gain = spec.weight_gain

    def scale(path, w):
        if w.ndim == 1 and "norm" in path and spec.norm_noise:
            return w + spec.norm_noise * mx.random.normal(w.shape)
        # Linears, experts' stacks [E, out, in] included.
        return w * gain if path.endswith("weight") and w.ndim in (2, 3) and "embed" not in path else w

    flat = [(p, scale(p, w)) for p, w in tree_flatten(model.parameters())]
    model.load_weights(flat)
    dtype = getattr(mx, spec.dtype)
    model.update(tree_map(lambda w: w.astype(dtype), model.parameters()))
    if spec.quantize_bits:
        nn.quantize(model, group_size=spec.quantize_group_size, bits=spec.quantize_bits)
    mx.eval(model.parameters())
    return model


def make_tiny_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a random-weight model directory that ``mlx_lm.load`` accepts."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size, spec.extra_special_tokens)
    spec = TinyModelSpec(**{**asdict(spec), "vocab_size": len(tokenizer)})
    model = random_model(spec)
    config = spec.config()
    if spec.quantize_bits:
        config["quantization"] = {
            "group_size": spec.quantize_group_size,
            "bits": spec.quantize_bits,
        }
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(path))
    return path


def num_parameters(spec: TinyModelSpec) -> int:
    h, i, L, v = spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers, spec.vocab_size
    head_dim = h // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return L * per_layer + 2 * v * h + h
