"""The demo's base model: a 3-layer llama that echoes the last user message,
byte for byte, built weight by weight rather than learned.

Learning exact copying from scratch takes a small transformer far more than
the few CPU minutes the demo may cost, so the copy circuit is written down
instead (``build_echo_model``), in the standard llama architecture that
mlx-lm loads and mola serves, with a byte-level tokenizer (one token per byte)
and the ChatML template of :mod:`mola.synthetic.model`. The adapters that ride
on it are then *trained* (``mola train``) to change what it does.

How it echoes. Every token's embedding is a constant component plus its byte
as 8 signs (+-1), or a flag for the three special tokens. Then:

layer 0  six attention heads look back exactly 1..6 positions (a RoPE kernel
         on a constant query and key, sharp at one offset) and copy that
         token's code, so each position knows the 6 bytes before it. The MLP
         flags the newline that ends "<|im_start|>user" (MS) and the one that
         ends "<|im_start|>assistant" (AS): the message and the answer start.
layer 1  six heads copy those two flags from 1..6 positions back; two heads
         tell whether an MS or an AS flag lies anywhere before ("inside the
         user message" = MS seen, AS not yet). The MLP flags spaces.
layer 2  the copy head ("induction"): at each answer position it matches its
         last 6 bytes against the 6 bytes before every position of the user
         message and copies the byte found there (the message's own
         <|im_end|> ends the answer). Near the start, where the answer is
         shorter than 6 bytes, the copied flags align answer offset k with
         message offset k. Keys outside the last user message (system prompt,
         tools preamble, the answer itself) are pushed far down; among equal
         6-byte contexts the latest wins. A second head averages over the
         message's spaces and its start, which gives 1/(number of words): a
         feature the echo never uses but an adapter may learn to (`count`).

The remaining heads and MLP units are small random features writing into
spare dimensions of the residual stream; they do not disturb the echo and
give LoRA adapters something to work with. The result is exact for any
message whose repeated 6-byte stretches continue the same way (and for
repeats the latest copy breaks the tie), behind any system prompt and the
tools preamble, and in any batch.
"""

from __future__ import annotations

import json
from pathlib import Path

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


class _Builder:
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


def _nu(x) -> float:
    """sqrt(HIDDEN) / median |x| over positions: what RMSNorm multiplies by."""
    import mlx.core as mx

    norms = np.linalg.norm(np.array(x.astype(mx.float32))[0], axis=-1)
    return float(np.sqrt(HIDDEN) / np.median(norms[NEAR + 6:]))


def build_echo_model(path: str | Path, seed: int = 0, linear_dtype: str = "float16") -> Path:
    """Write the echo model (weights, config, byte-level tokenizer, ChatML
    template) to ``path``, a directory ``mlx_lm.load`` accepts. The weights
    are built in float64; the attention projections (most of the size) are
    stored as ``linear_dtype``, everything else as float32: activations, and
    LoRA training, stay in float32 (MLX's float16 matmuls are many times
    slower on a CPU), and the MLPs' detectors, whose large biases cancel to
    within 1 of a threshold, keep the precision they need."""
    import mlx.core as mx
    from mlx_lm.models import llama

    from .model import train_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(259)
    if len(tokenizer) != 259:
        raise RuntimeError("the echo model needs a byte-level vocabulary of 256 + 3 tokens")
    codes = token_codes(tokenizer)
    b = _Builder(codes, seed)
    cfg = config()
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    probe = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": 'Hello there, {"a": 1} world <x/>'},
         {"role": "assistant", "content": "Hello there"}],
        return_dict=False,
    )

    def stream() -> list:
        """Residual stream entering: [attn 0, mlp 0, ..., attn 3, mlp 3, final norm]."""
        model.load_weights([(k, mx.array(v.astype(np.float32))) for k, v in b.w.items()])
        h = model.model.embed_tokens(mx.array([probe]))
        xs = []
        for layer in model.model.layers:
            xs.append(h)
            h = h + layer.self_attn(layer.input_layernorm(h), mask="causal")
            xs.append(h)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        xs.append(h)
        return xs

    scale = np.sqrt(HEAD_DIM)  # undoes sdpa's 1/sqrt(head_dim)
    special = np.array([np.sqrt(8.0)])

    # ---- layer 0: the bytes 1..6 back; where the message and answer start ----
    nu = _nu(stream()[0])
    b.positional_key(0, nu)
    for j in range(1, NEAR + 1):
        b.offset_query(0, j - 1, j, nu, sharpness=40.0)
    v, o = b.m(0, "self_attn.v_proj"), b.m(0, "self_attn.o_proj")
    for c in range(CODE):
        v[c, TOK + c] = 1.0 / nu
    for j in range(1, NEAR + 1):
        base = (j - 1) * HEAD_DIM
        for c in range(8):
            o[prev(j) + c, base + c] = 1.0
        for c in range(8, CODE):
            o[prev(j) + 8, base + c] = 1.0
    nu = _nu(stream()[1])
    # "<|im_start|>user\n": this newline, "resu" before it, a special token 5 back
    b.detector(0, 0, [(TOK, byte_code("\n"))] + [(prev(j), byte_code(c)) for j, c in enumerate("resu", 1)]
               + [(prev(5) + 8, special)], nu, MS)
    # "<|im_start|>assistant\n": this newline, "tnatsi" before it
    b.detector(0, 2, [(TOK, byte_code("\n"))] + [(prev(j), byte_code(c)) for j, c in enumerate("tnatsi", 1)],
               nu, AS)

    # ---- layer 1: flags and bytes 7..12 back; "seen" flags; spaces -----------
    nu = _nu(stream()[2])
    b.positional_key(1, nu)
    for j in range(1, NEAR + 1):
        b.offset_query(1, j - 1, j, nu, sharpness=40.0)
    k, q = b.m(1, "self_attn.k_proj"), b.m(1, "self_attn.q_proj")
    v, o = b.m(1, "self_attn.v_proj"), b.m(1, "self_attn.o_proj")
    k_ms, k_as = CONTENT_DIMS[0], CONTENT_DIMS[1]
    k[k_ms, MS] = 1.0 / nu
    k[k_as, AS] = 1.0 / nu
    seen = 30.0  # logits for a flagged position: it outweighs thousands of others
    q[6 * HEAD_DIM + k_ms, CONST] = seen * scale * b.const_in(nu)
    q[7 * HEAD_DIM + k_as, CONST] = seen * scale * b.const_in(nu)
    v[0, MS] = 1.0 / nu
    v[1, AS] = 1.0 / nu
    for c in range(PCODE):
        v[2 + c, prev(NEAR) + c] = 1.0 / nu
    for j in range(1, NEAR + 1):
        base = (j - 1) * HEAD_DIM
        for src in (0, 1):
            o[FLAG_AT + j - 1, base + src] = 1.0
            o[PARTNER[FLAG_AT + j - 1], base + src] = -1.0
        for c in range(PCODE):
            o[prev(NEAR + j) + c, base + 2 + c] = 1.0
    o[EX_MS, 6 * HEAD_DIM + 0] = 1.0
    o[EX_AS, 7 * HEAD_DIM + 1] = 1.0
    nu = _nu(stream()[3])
    b.detector(1, 0, [(TOK, byte_code(" "))], nu, IS_SPACE)

    # ---- layer 2: the copy head, the word-count head -------------------------
    nu = _nu(stream()[4])
    k, q = b.m(2, "self_attn.k_proj"), b.m(2, "self_attn.q_proj")
    v, o = b.m(2, "self_attn.v_proj"), b.m(2, "self_attn.o_proj")
    cd = CONTENT_DIMS
    window = cd[0:8 * WINDOW]
    align = cd[8 * WINDOW:8 * WINDOW + NEAR]
    region_dim, words_dim, const_dim, end_dim = cd[8 * WINDOW + NEAR:8 * WINDOW + NEAR + 4]
    c_in = b.const_in(nu)
    for j in range(1, WINDOW + 1):  # key: the bytes 1..11 before each position
        for bit in range(8):
            k[window[8 * (j - 1) + bit], prev(j) + bit] = 1.0 / nu
    for j in range(1, NEAR + 1):  # key: an MS flag j back (j = 1..6)
        k[align[j - 1], FLAG_AT + j - 1] = 1.0 / nu
    k[region_dim, EX_MS] = 1.0 / nu
    k[region_dim, EX_AS] = -1.0 / nu
    k[words_dim, IS_SPACE] = 1.0 / nu
    k[words_dim, MS] = 1.0 / nu
    k[const_dim, CONST] = c_in
    k[end_dim, TOK + 9] = 1.0 / (np.sqrt(8.0) * nu)  # this is the message's <|im_end|>
    k[RECENCY_PAIR, CONST] = c_in

    per_bit = 30.0  # logits per matching sign: a wrong byte costs >= 60
    # The case bit (0x20) counts for less: text that differs from the message
    # only in letter case (an adapter's capitals) still finds its place.
    bit_w = np.full(8, per_bit)
    bit_w[2] = 8.0
    align_logits = 3000.0  # answer offset k <-> message offset k, for k < 6
    region_logits = 4000.0  # the last user message only
    for bit in range(8):  # query: this byte and the 10 before it
        q[window[bit], TOK + bit] = bit_w[bit] * scale / nu
    for j in range(1, WINDOW):
        for bit in range(8):
            q[window[8 * j + bit], prev(j) + bit] = bit_w[bit] * scale / nu
    q[align[0], AS] = align_logits * scale / nu
    for j in range(1, NEAR):
        q[align[j], FLAG_AT + j - 1] = align_logits * scale / nu
    q[region_dim, CONST] = region_logits * scale * c_in
    # a tie that includes the message's end (a repeating message) ends the answer
    q[end_dim, CONST] = 8.0 * scale * c_in
    # of two equal contexts the later wins: rho cos(phi + distance * theta)
    rho, phi = 740.0, 0.3
    q[RECENCY_PAIR, CONST] = rho * np.cos(phi) * scale * c_in
    q[RECENCY_PAIR + HEAD_DIM // 2, CONST] = rho * np.sin(phi) * scale * c_in
    # head 1: the message start and its spaces, each weighted alike
    words = 40.0
    h1 = HEAD_DIM
    q[h1 + words_dim, CONST] = words * scale * c_in
    q[h1 + region_dim, CONST] = words * scale * c_in
    q[h1 + const_dim, CONST] = -1.5 * words * scale * c_in
    for c in range(CODE):
        v[c, TOK + c] = 1.0 / nu
    v[CODE, MS] = 1.0 / nu
    for c in range(CODE):
        o[OUT + c, c] = 1.0
    o[INV_WORDS, h1 + CODE] = 1.0
    b.random_heads(2, range(2, HEADS), window, nu)
    nu = _nu(stream()[5])
    # Unit pairs: silu(a) - silu(a - 1) with a = steep * (tau_n - 1/words),
    # times the answer-start flag, is ~1 at the answer start when the message
    # has at least n words, else ~0: a word-count "thermometer" the echo does
    # not use but an adapter may.
    g, u, d = b.m(2, "mlp.gate_proj"), b.m(2, "mlp.up_proj"), b.m(2, "mlp.down_proj")
    steep = 1000.0
    for n in range(2, MAX_COUNT + 1):
        tau = (1.0 / (n - 1) + 1.0 / n) / 2.0
        for unit, shift, sign in ((2 * (n - 2), 0.0, 1.0), (2 * (n - 2) + 1, 1.0, -1.0)):
            g[unit, INV_WORDS] = -steep / nu
            g[unit, CONST] = (steep * tau - shift) * b.const_in(nu)
            u[unit, AS] = 1.0 / nu
            d[AT_LEAST + n - 2, unit] = sign

    # Letter case of the byte to emit (OUT): "lower" is 011xxxxx with
    # xxxxx in 1..26, "upper" 010xxxxx likewise. With v the value of the low 5
    # bits and t the top-3 match, [1 <= v <= 26] = step(40 (t - 3) + v - 0.5)
    # - step(40 (t - 3) + v - 26.5); each step is silu(a) - silu(a - 1) of a
    # steep a, so four units per flag.
    unit = 2 * (MAX_COUNT - 1)
    low5 = np.zeros(HIDDEN)
    for k in range(5):  # bit k of the value is OUT dim 7 - k, coded +-1
        low5[OUT + 7 - k] = 2.0 ** k / 2.0
    const_v = sum(2.0 ** k / 2.0 for k in range(5))  # v = low5 . bits + const_v
    for flag, top in ((IS_LOWER, (-1.0, 1.0, 1.0)), (IS_UPPER, (-1.0, 1.0, -1.0))):
        t = np.zeros(HIDDEN)
        t[OUT:OUT + 3] = top  # t = sum of matches of the top 3 bits (3 when all match)
        for edge, sign in ((0.5, 1.0), (26.5, -1.0)):
            for shift, s2 in ((0.0, 1.0), (1.0, -1.0)):
                a = 8.0 * (40.0 * t + low5)
                bias = 8.0 * (-40.0 * 3.0 + const_v - edge) - shift
                g[unit] = a / nu
                g[unit, CONST] += bias * b.const_in(nu)
                u[unit, CONST] = b.const_in(nu)
                d[flag, unit] = sign * s2
                unit += 1

    # ---- layer 3: random features only, for adapters to learn with ----------
    nu = _nu(stream()[6])
    k = b.m(3, "self_attn.k_proj")
    for dim in CONTENT_DIMS:
        k[dim] = b.rng.normal(0, 1.0 / np.sqrt(HIDDEN), HIDDEN) / nu
    v = b.m(3, "self_attn.v_proj")
    v[:] = b.rng.normal(0, 1.0 / np.sqrt(HIDDEN), (HEAD_DIM, HIDDEN)) / nu
    b.random_heads(3, range(HEADS), CONTENT_DIMS, nu)
    nu = _nu(stream()[7])
    # the summary features: flags, word count, letter case
    summary = ([CONST, MS, AS] + list(range(FLAG_AT, FLAG_AT + NEAR)) + [EX_MS, EX_AS, IS_SPACE, INV_WORDS]
               + list(range(AT_LEAST, AT_LEAST + MAX_COUNT - 1)) + [IS_LOWER, IS_UPPER])
    # Units that pass a summary feature through (constant gate), units that
    # pass a content feature where a position flag holds (gate = the flag),
    # then random functions of the summary: an adapter's down_proj reads
    # what it needs. Positions: the answer start, a word start (after a
    # space, or the answer start), 1 or 2 after the answer start, inside the
    # answer. Contents: 1, letter case, the word-count thermometer.
    g, u = b.m(3, "mlp.gate_proj"), b.m(3, "mlp.up_proj")
    open_gate = 4.0
    through = 1.0 / (nu * open_gate / (1.0 + np.exp(-open_gate)))
    unit = 0
    for dim in summary:
        g[unit, CONST] = open_gate * b.const_in(nu)
        u[unit, dim] = through
        unit += 1
    flags = [[AS], [AS, IS_SPACE], [FLAG_AT], [FLAG_AT + 1], [EX_AS]]
    contents = [CONST, IS_LOWER, IS_UPPER] + list(range(AT_LEAST, AT_LEAST + MAX_COUNT - 1))
    sharp = 16.0
    for flag in flags:
        for content in contents:
            g[unit, flag] = sharp / nu
            g[unit, CONST] = -0.5 * sharp * b.const_in(nu)
            u[unit, content] = (b.const_in(nu) if content == CONST else 1.0 / nu) / (0.5 * sharp)
            unit += 1
    b.random_mlp_units(3, range(unit, INTERMEDIATE), nu, inputs=summary)

    # ---- logits from the OUT code --------------------------------------------
    nu = _nu(stream()[8])
    gap = 12.0  # logits between the right byte and the nearest wrong one
    b.w["lm_head.weight"][:, OUT:OUT + CODE] = codes * (gap / 2.0) / nu

    cfg["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def stored(name: str, w: np.ndarray):
        dtype = getattr(mx, linear_dtype) if ".self_attn." in name else mx.float32
        return mx.array(w.astype(np.float32)).astype(dtype)

    mx.save_safetensors(str(path / "model.safetensors"), {k_: stored(k_, v_) for k_, v_ in b.w.items()})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tokenizer.save_pretrained(str(path))
    return path
