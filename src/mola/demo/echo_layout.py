"""The echo base's layout (mola.demo.echo_base builds it): its shape, where
each feature lives in the residual stream, each token's code, and the
primitives that write its weights (a head that looks a fixed offset back, an
MLP detector, random features for adapters)."""

from __future__ import annotations

import numpy as np

# Shape. n_kv_heads = 1: all heads of a layer share one key and one value,
# and each head reads the parts it needs.
HIDDEN = 168
LAYERS = 4
INTERMEDIATE = 128
HEADS = 8
HEAD_DIM = 128
ROPE_THETA = 1e38  # pair m turns by 10**(-0.59 m) per position: 1, 0.25, ... then ~0
CONTEXT = 4096
NEAR = 6  # layer 0 reads the bytes 1..6 back, layer 1 those 7..12 back
WINDOW = 11  # bytes of context the copy head matches
MAX_COUNT = 9  # the word-count features cover 1..9 words

# Residual stream layout.
CONST = 0
TOK = 1  # 8 sign bits, then im_start, im_end, endoftext flags
CODE = 11
PREV = 12  # PREV + 9*(j-1), j = 1..12: the byte j back (8 bits + "special")
PCODE = 9
MS, AS = 120, 121  # the newline ending "<|im_start|>user" / "<|im_start|>assistant"
FLAG_AT = 122  # FLAG_AT + j - 1: an MS or AS flag j back (j = 1..6)
EX_MS, EX_AS = 128, 129  # an MS / AS flag lies at or before this position
IS_SPACE = 130
# Each 0/1 flag f has a partner dimension holding 1 - f (the embedding sets it
# to 1, whoever writes f subtracts f), so f^2 + (1 - f)^2 = 1 and all
# positions of the message have the same norm: RMSNorm scales their keys
# alike, and scores compare bytes, not norms.
PARTNER = {MS: 131, AS: 132, **{FLAG_AT + j: 133 + j for j in range(NEAR)}, IS_SPACE: 139}
INV_WORDS = 140  # 1 / number of words of the message (read at the answer start)
OUT = 141  # ..151: the code of the byte to emit (8 bits + 3 special flags)
AT_LEAST = 152  # AT_LEAST + n - 2, n = 2..9: ~1 when the message has >= n words
IS_LOWER, IS_UPPER = 160, 161  # the byte to emit is a lower / upper case ASCII letter

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
POS_PAIRS = range(0, 6)  # RoPE pairs used for positions
POS_WEIGHTS = np.array([2.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # one offset beats all others by ~0.95
RECENCY_PAIR = 6
CONTENT_DIMS = [m for m in range(13, HEAD_DIM // 2)] + [m + HEAD_DIM // 2 for m in range(13, HEAD_DIM // 2)]


def token_codes(tokenizer) -> np.ndarray:
    """[vocab, 11]: each token's code (byte sign bits, or a special flag)."""
    vocab = len(tokenizer)
    codes = np.zeros((vocab, CODE))
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's ByteLevel alphabet

    char_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    for tid in range(vocab):
        tok = tokenizer.convert_ids_to_tokens(tid)
        if tok in SPECIALS:
            codes[tid, 8 + SPECIALS.index(tok)] = np.sqrt(8.0)
        else:
            b = char_to_byte[tok]
            codes[tid, :8] = [1.0 if (b >> (7 - k)) & 1 else -1.0 for k in range(8)]
    return codes


def byte_code(ch: str) -> np.ndarray:
    b = ord(ch)
    return np.array([1.0 if (b >> (7 - k)) & 1 else -1.0 for k in range(8)])


def rope_thetas() -> np.ndarray:
    half = HEAD_DIM // 2
    return ROPE_THETA ** (-np.arange(half) / half)


def config() -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "vocab_size": 259,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def prev(j: int) -> int:
    """First residual dimension of the byte ``j`` positions back."""
    return PREV + PCODE * (j - 1)


class WeightBuilder:
    """Weights as numpy arrays in mlx layout (a Linear's weight is [out, in]).

    Scales are set in logits: sdpa multiplies q.k by HEAD_DIM**-0.5, RMSNorm
    multiplies the residual by ``nu`` (measured per layer on a probe prompt;
    every position has the same norm by construction)."""

    def __init__(self, codes: np.ndarray, seed: int):
        self.codes = codes
        self.rng = np.random.default_rng(seed)
        self.w: dict[str, np.ndarray] = {}
        V = codes.shape[0]
        emb = np.zeros((V, HIDDEN))
        emb[:, CONST] = np.sqrt(8.0)
        emb[:, TOK:TOK + CODE] = codes
        for partner in PARTNER.values():
            emb[:, partner] = 1.0
        self.w["model.embed_tokens.weight"] = emb
        for layer in range(LAYERS):
            p = f"model.layers.{layer}."
            self.w[p + "input_layernorm.weight"] = np.ones(HIDDEN)
            self.w[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN)
            self.w[p + "self_attn.q_proj.weight"] = np.zeros((HEADS * HEAD_DIM, HIDDEN))
            self.w[p + "self_attn.k_proj.weight"] = np.zeros((HEAD_DIM, HIDDEN))
            self.w[p + "self_attn.v_proj.weight"] = np.zeros((HEAD_DIM, HIDDEN))
            self.w[p + "self_attn.o_proj.weight"] = np.zeros((HIDDEN, HEADS * HEAD_DIM))
            self.w[p + "mlp.gate_proj.weight"] = np.zeros((INTERMEDIATE, HIDDEN))
            self.w[p + "mlp.up_proj.weight"] = np.zeros((INTERMEDIATE, HIDDEN))
            self.w[p + "mlp.down_proj.weight"] = np.zeros((HIDDEN, INTERMEDIATE))
        self.w["model.norm.weight"] = np.ones(HIDDEN)
        self.w["lm_head.weight"] = np.zeros((V, HIDDEN))

    def m(self, layer: int, name: str) -> np.ndarray:
        return self.w[f"model.layers.{layer}.{name}.weight"]

    @staticmethod
    def const_in(nu: float) -> float:
        """Weight that turns the normalized CONST component into 1."""
        return 1.0 / (np.sqrt(8.0) * nu)

    def positional_key(self, layer: int, nu: float) -> None:
        k = self.m(layer, "self_attn.k_proj")
        for pair in POS_PAIRS:
            k[pair, CONST] = self.const_in(nu)

    def offset_query(self, layer: int, head: int, offset: int, nu: float, sharpness: float) -> None:
        """Head ``head`` attends exactly ``offset`` positions back."""
        q = self.m(layer, "self_attn.q_proj")
        th = rope_thetas()
        base = head * HEAD_DIM
        for idx, pair in enumerate(POS_PAIRS):
            r = sharpness * POS_WEIGHTS[idx] * np.sqrt(HEAD_DIM) * self.const_in(nu)
            q[base + pair, CONST] = r * np.cos(offset * th[pair])
            q[base + pair + HEAD_DIM // 2, CONST] = -r * np.sin(offset * th[pair])

    def detector(self, layer: int, unit: int, parts: list[tuple[int, np.ndarray]], nu: float,
                 out_dim: int, gain: float = 12.0) -> None:
        """MLP units ``unit`` and ``unit + 1`` that output 1 when every
        (dimension, expected code) part matches exactly and 0 otherwise: a
        matching part scores 8, any other at most 6, so a = gain * (score -
        total + 1) is >= gain or <= -gain, and silu(a) - silu(a - 1) is 1 or 0
        to within 1e-4 however the weights round (float16 storage)."""
        g = self.m(layer, "mlp.gate_proj")
        u = self.m(layer, "mlp.up_proj")
        d = self.m(layer, "mlp.down_proj")
        total = 8.0 * len(parts)
        for k, shift in enumerate((0.0, 1.0)):
            for start, expected in parts:
                g[unit + k, start:start + len(expected)] += gain * expected / nu
            g[unit + k, CONST] += (-gain * (total - 1.0) - shift) * self.const_in(nu)
            u[unit + k, CONST] = self.const_in(nu)
            sign = 1.0 if k == 0 else -1.0
            d[out_dim, unit + k] = sign
            d[PARTNER[out_dim], unit + k] = -sign

    def random_mlp_units(self, layer: int, units: range, nu: float, inputs: list[int] | None = None) -> None:
        """Random features (of ``inputs``, default all dimensions) for
        adapters to use; they write nothing (down_proj stays 0)."""
        g = self.m(layer, "mlp.gate_proj")
        u = self.m(layer, "mlp.up_proj")
        dims = list(range(HIDDEN)) if inputs is None else inputs
        n, k = len(units), len(dims)
        for w in (g, u):
            w[units.start:units.stop, dims] = self.rng.normal(0, 2.0 / np.sqrt(k), (n, k)) / nu

    def random_heads(self, layer: int, heads: range, key_dims: list[int], nu: float) -> None:
        """Random attention patterns for adapters to use (o_proj stays 0)."""
        q = self.m(layer, "self_attn.q_proj")
        for h in heads:
            for d in key_dims:
                q[h * HEAD_DIM + d] = self.rng.normal(0, 4.0 / np.sqrt(HIDDEN), HIDDEN) / nu


def norm_gain(x) -> float:
    """sqrt(HIDDEN) / median |x| over positions: what RMSNorm multiplies by."""
    import mlx.core as mx

    norms = np.linalg.norm(np.array(x.astype(mx.float32))[0], axis=-1)
    return float(np.sqrt(HIDDEN) / np.median(norms[NEAR + 6:]))
