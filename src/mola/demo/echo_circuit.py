"""The echo demo's base model, layer by layer: a 4-layer llama that echoes
the last user message, byte for byte, built weight by weight rather than
learned (each step of STEPS writes one sub-layer; mola.demo.echo_base runs them).

Learning exact copying from scratch takes a small transformer far more than
the few CPU minutes the demo may cost, so the copy circuit is written down
instead (``build_echo_model``), in the standard llama architecture that
mlx-lm loads and mola serves, with a byte-level tokenizer (one token per byte)
and the ChatML template of :mod:`mola.demo.tokenizer`. The adapters that ride
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

import numpy as np

from .echo_layout import (AS, AT_LEAST, CODE, CONST, CONTENT_DIMS, EX_AS, EX_MS, FLAG_AT, HEAD_DIM, HEADS, HIDDEN,
                          INTERMEDIATE, INV_WORDS, IS_LOWER, IS_SPACE, IS_UPPER, MAX_COUNT, MS, NEAR, OUT, PARTNER,
                          PCODE, RECENCY_PAIR, TOK, WINDOW, WeightBuilder, byte_code, prev)

SCALE = np.sqrt(HEAD_DIM)  # undoes sdpa's 1/sqrt(head_dim)
# Layer 2's key dimensions: the bytes before each position, an MS flag 1..6
# back, then "in the last user message", "a word start", 1, "the message's end".
WINDOW_DIMS = CONTENT_DIMS[0:8 * WINDOW]
ALIGN_DIMS = CONTENT_DIMS[8 * WINDOW:8 * WINDOW + NEAR]
REGION_DIM, WORDS_DIM, CONST_DIM, END_DIM = CONTENT_DIMS[8 * WINDOW + NEAR:8 * WINDOW + NEAR + 4]


# ---- layer 0: the bytes 1..6 back; where the message and answer start ----

def _layer0_attention(b: WeightBuilder, nu: float) -> None:
    """Head j - 1 copies the code of the byte j back (j = 1..6)."""
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


def _layer0_mlp(b: WeightBuilder, nu: float) -> None:
    """Flag the newlines that start the user message (MS) and the answer (AS)."""
    special = np.array([np.sqrt(8.0)])
    # "<|im_start|>user\n": this newline, "resu" before it, a special token 5 back
    b.detector(0, 0, [(TOK, byte_code("\n"))] + [(prev(j), byte_code(c)) for j, c in enumerate("resu", 1)]
               + [(prev(5) + 8, special)], nu, MS)
    # "<|im_start|>assistant\n": this newline, "tnatsi" before it
    b.detector(0, 2, [(TOK, byte_code("\n"))] + [(prev(j), byte_code(c)) for j, c in enumerate("tnatsi", 1)],
               nu, AS)


# ---- layer 1: flags and bytes 7..12 back; "seen" flags; spaces -----------

def _layer1_attention(b: WeightBuilder, nu: float) -> None:
    """Heads 0..5 copy the MS/AS flags and the byte code 1..6 back (so 7..12
    back in all); heads 6 and 7 tell whether an MS or AS flag lies before."""
    b.positional_key(1, nu)
    for j in range(1, NEAR + 1):
        b.offset_query(1, j - 1, j, nu, sharpness=40.0)
    k, q = b.m(1, "self_attn.k_proj"), b.m(1, "self_attn.q_proj")
    v, o = b.m(1, "self_attn.v_proj"), b.m(1, "self_attn.o_proj")
    k_ms, k_as = CONTENT_DIMS[0], CONTENT_DIMS[1]
    k[k_ms, MS] = 1.0 / nu
    k[k_as, AS] = 1.0 / nu
    seen = 30.0  # logits for a flagged position: it outweighs thousands of others
    q[6 * HEAD_DIM + k_ms, CONST] = seen * SCALE * b.const_in(nu)
    q[7 * HEAD_DIM + k_as, CONST] = seen * SCALE * b.const_in(nu)
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


def _layer1_mlp(b: WeightBuilder, nu: float) -> None:
    b.detector(1, 0, [(TOK, byte_code(" "))], nu, IS_SPACE)


# ---- layer 2: the copy head, the word-count head -------------------------

def _layer2_attention(b: WeightBuilder, nu: float) -> None:
    """Head 0 copies the byte that follows the answer's context in the
    message; head 1 averages over the message's start and spaces."""
    _copy_keys(b, nu)
    _copy_query(b, nu)
    q, v, o = b.m(2, "self_attn.q_proj"), b.m(2, "self_attn.v_proj"), b.m(2, "self_attn.o_proj")
    c_in = b.const_in(nu)
    # head 1: the message start and its spaces, each weighted alike
    words = 40.0
    h1 = HEAD_DIM
    q[h1 + WORDS_DIM, CONST] = words * SCALE * c_in
    q[h1 + REGION_DIM, CONST] = words * SCALE * c_in
    q[h1 + CONST_DIM, CONST] = -1.5 * words * SCALE * c_in
    for c in range(CODE):
        v[c, TOK + c] = 1.0 / nu
    v[CODE, MS] = 1.0 / nu
    for c in range(CODE):
        o[OUT + c, c] = 1.0
    o[INV_WORDS, h1 + CODE] = 1.0
    b.random_heads(2, range(2, HEADS), WINDOW_DIMS, nu)


def _copy_keys(b: WeightBuilder, nu: float) -> None:
    """Layer 2's shared key: each position's context and flags."""
    k = b.m(2, "self_attn.k_proj")
    c_in = b.const_in(nu)
    for j in range(1, WINDOW + 1):  # key: the bytes 1..11 before each position
        for bit in range(8):
            k[WINDOW_DIMS[8 * (j - 1) + bit], prev(j) + bit] = 1.0 / nu
    for j in range(1, NEAR + 1):  # key: an MS flag j back (j = 1..6)
        k[ALIGN_DIMS[j - 1], FLAG_AT + j - 1] = 1.0 / nu
    k[REGION_DIM, EX_MS] = 1.0 / nu
    k[REGION_DIM, EX_AS] = -1.0 / nu
    k[WORDS_DIM, IS_SPACE] = 1.0 / nu
    k[WORDS_DIM, MS] = 1.0 / nu
    k[CONST_DIM, CONST] = c_in
    k[END_DIM, TOK + 9] = 1.0 / (np.sqrt(8.0) * nu)  # this is the message's <|im_end|>
    k[RECENCY_PAIR, CONST] = c_in


def _copy_query(b: WeightBuilder, nu: float) -> None:
    """The copy head's query: this byte and the 10 before it, the answer
    start's alignment, the last user message only, the latest copy first."""
    q = b.m(2, "self_attn.q_proj")
    c_in = b.const_in(nu)
    per_bit = 30.0  # logits per matching sign: a wrong byte costs >= 60
    # The case bit (0x20) counts for less: text that differs from the message
    # only in letter case (an adapter's capitals) still finds its place.
    bit_w = np.full(8, per_bit)
    bit_w[2] = 8.0
    align_logits = 3000.0  # answer offset k <-> message offset k, for k < 6
    region_logits = 4000.0  # the last user message only
    for bit in range(8):  # query: this byte and the 10 before it
        q[WINDOW_DIMS[bit], TOK + bit] = bit_w[bit] * SCALE / nu
    for j in range(1, WINDOW):
        for bit in range(8):
            q[WINDOW_DIMS[8 * j + bit], prev(j) + bit] = bit_w[bit] * SCALE / nu
    q[ALIGN_DIMS[0], AS] = align_logits * SCALE / nu
    for j in range(1, NEAR):
        q[ALIGN_DIMS[j], FLAG_AT + j - 1] = align_logits * SCALE / nu
    q[REGION_DIM, CONST] = region_logits * SCALE * c_in
    # a tie that includes the message's end (a repeating message) ends the answer
    q[END_DIM, CONST] = 8.0 * SCALE * c_in
    # of two equal contexts the later wins: rho cos(phi + distance * theta)
    rho, phi = 740.0, 0.3
    q[RECENCY_PAIR, CONST] = rho * np.cos(phi) * SCALE * c_in
    q[RECENCY_PAIR + HEAD_DIM // 2, CONST] = rho * np.sin(phi) * SCALE * c_in


def _layer2_mlp(b: WeightBuilder, nu: float) -> None:
    """Features the echo does not use but an adapter may: the word count, the
    letter case of the byte to emit."""
    _word_count_units(b, nu)
    _letter_case_units(b, nu)


def _word_count_units(b: WeightBuilder, nu: float) -> None:
    """Unit pairs: silu(a) - silu(a - 1) with a = steep * (tau_n - 1/words),
    times the answer-start flag, is ~1 at the answer start when the message
    has at least n words, else ~0: a word-count "thermometer"."""
    g, u, d = b.m(2, "mlp.gate_proj"), b.m(2, "mlp.up_proj"), b.m(2, "mlp.down_proj")
    steep = 1000.0
    for n in range(2, MAX_COUNT + 1):
        tau = (1.0 / (n - 1) + 1.0 / n) / 2.0
        for unit, shift, sign in ((2 * (n - 2), 0.0, 1.0), (2 * (n - 2) + 1, 1.0, -1.0)):
            g[unit, INV_WORDS] = -steep / nu
            g[unit, CONST] = (steep * tau - shift) * b.const_in(nu)
            u[unit, AS] = 1.0 / nu
            d[AT_LEAST + n - 2, unit] = sign


def _letter_case_units(b: WeightBuilder, nu: float) -> None:
    """Letter case of the byte to emit (OUT): "lower" is 011xxxxx with
    xxxxx in 1..26, "upper" 010xxxxx likewise. With v the value of the low 5
    bits and t the top-3 match, [1 <= v <= 26] = step(40 (t - 3) + v - 0.5)
    - step(40 (t - 3) + v - 26.5); each step is silu(a) - silu(a - 1) of a
    steep a, so four units per flag."""
    g, u, d = b.m(2, "mlp.gate_proj"), b.m(2, "mlp.up_proj"), b.m(2, "mlp.down_proj")
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

def _layer3_attention(b: WeightBuilder, nu: float) -> None:
    k = b.m(3, "self_attn.k_proj")
    for dim in CONTENT_DIMS:
        k[dim] = b.rng.normal(0, 1.0 / np.sqrt(HIDDEN), HIDDEN) / nu
    v = b.m(3, "self_attn.v_proj")
    v[:] = b.rng.normal(0, 1.0 / np.sqrt(HIDDEN), (HEAD_DIM, HIDDEN)) / nu
    b.random_heads(3, range(HEADS), CONTENT_DIMS, nu)


def _layer3_mlp(b: WeightBuilder, nu: float) -> None:
    """Units that pass a summary feature through (constant gate), units that
    pass a content feature where a position flag holds (gate = the flag),
    then random functions of the summary: an adapter's down_proj reads what
    it needs. Positions: the answer start, a word start (after a space, or
    the answer start), 1 or 2 after the answer start, inside the answer.
    Contents: 1, letter case, the word-count thermometer."""
    # the summary features: flags, word count, letter case
    summary = ([CONST, MS, AS] + list(range(FLAG_AT, FLAG_AT + NEAR)) + [EX_MS, EX_AS, IS_SPACE, INV_WORDS]
               + list(range(AT_LEAST, AT_LEAST + MAX_COUNT - 1)) + [IS_LOWER, IS_UPPER])
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

def _logits(b: WeightBuilder, nu: float) -> None:
    gap = 12.0  # logits between the right byte and the nearest wrong one
    b.w["lm_head.weight"][:, OUT:OUT + CODE] = b.codes * (gap / 2.0) / nu


# What build_echo_model writes, in order: step i reads the residual stream's
# norm entering sub-layer i (the final norm for the logits).
STEPS = (_layer0_attention, _layer0_mlp, _layer1_attention, _layer1_mlp, _layer2_attention, _layer2_mlp,
         _layer3_attention, _layer3_mlp, _logits)
