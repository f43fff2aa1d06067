"""References computed another way: plain mlx-lm on merged weights, greedy and penalised decodes, grammar walks."""

from __future__ import annotations

import mlx.core as mx
from mola.adapters.formats import read_adapter


def merged_model(model_dir, adapter_dirs=(), scales=None, dequantize=False):
    """Plain mlx-lm model with each adapter merged into the base weights:
    W' = W + scale * (A @ B)^T (for experts, per expert: W[e] += scale *
    (A[e] @ B[e])^T). With ``dequantize``, quantized layers are made float
    first (mlx-lm's own dequantize_model)."""
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    model, tokenizer = load(str(model_dir))
    if dequantize:
        model = dequantize_model(model)
    modules = dict(model.named_modules())
    for i, adapter in enumerate(adapter_dirs):
        weights = read_adapter(adapter)
        extra = 1.0 if scales is None else scales[i]
        for path, m in weights.modules.items():
            lin = modules[path]
            delta = (extra * m.scale) * (m.a @ m.b)  # [in, out], experts [E, in, out]
            lin.weight = lin.weight + delta.swapaxes(-1, -2).astype(lin.weight.dtype)
    mx.eval(model.parameters())
    return model, tokenizer


def merged_answer(tokenizer, model_dir, question: str, max_tokens: int, adapter_dirs=(), scales=None) -> str:
    """The greedy answer to one user message by plain mlx-lm on the base with
    the adapters merged into its weights, EOS ignored (as ``ignore_eos``)."""
    model, _ = merged_model(model_dir, list(adapter_dirs), scales)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    tokens, _ = reference_decode(model, prompt, max_tokens)
    return detokenize(tokenizer, tokens, stop_at_eos=False)


def greedy_tokens(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with mlx-lm's own generate_step (no mola code)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    out = []
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=make_sampler(0.0))
    for token, _ in steps:
        out.append(int(token))
    return out


def grammar_walks(compiled, tokenizer, rng, num=30, max_tokens=300) -> list[str]:
    """Texts of random walks through the grammar: each step draws a token
    the mask allows (EOS, when allowed, with probability 1/2)."""
    import numpy as np

    eos = set(tokenizer.eos_token_ids)
    texts = []
    for _ in range(num):
        m = compiled.matcher.deep_copy()
        tokens = []
        for _ in range(max_tokens):
            allowed = np.nonzero(np.frombuffer(m.compute_logit_bias(), dtype=np.uint8))[0]
            ends = [t for t in allowed if t in eos]
            others = [t for t in allowed if t not in eos]
            if ends and (not others or rng.random() < 0.5):
                break
            token = int(rng.choice(others))
            assert m.consume_token(token)
            tokens.append(token)
        else:
            continue  # ran out of budget: a prefix, nothing to check
        assert m.is_accepting()
        texts.append(tokenizer.decode(tokens))
    assert len(texts) >= num // 4
    return texts


def reference_decode(model, prompt: list[int], max_tokens: int, bias=None, frequency_penalty=0.0,
                     presence_penalty=0.0, top_k: int = 0):
    """Greedy decoding step by step with a plain mlx-lm model and KV cache,
    applying logit biases and OpenAI's penalties naively in numpy. Returns
    (tokens, [(logprob of token, [(id, logprob)] top_k)]) with raw-model
    log-probabilities."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    tokens, lps = [], []
    counts: dict[int, int] = {}
    for _ in range(max_tokens):
        raw = np.array(logits.astype(mx.float32))
        logp = raw - np.log(np.exp(raw - raw.max()).sum()) - raw.max()
        adjusted = raw.copy()
        for t, b in (bias or {}).items():
            adjusted[t] += b
        for t, c in counts.items():
            adjusted[t] -= frequency_penalty * c + presence_penalty
        token = int(np.argmax(adjusted))
        top = [(int(i), float(logp[i])) for i in np.argsort(-logp)[:top_k]]
        tokens.append(token)
        lps.append((float(logp[token]), top))
        counts[token] = counts.get(token, 0) + 1
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return tokens, lps


def detokenize(tokenizer, tokens, stop_at_eos=True) -> str:
    """Text of ``tokens`` as mlx-lm's streaming detokenizer makes it, EOS
    tokens left out (and, with stop_at_eos, everything after the first), and
    the other special tokens too (the server's skip_special_tokens)."""
    detok = tokenizer.detokenizer
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for t in tokens:
        if t in tokenizer.eos_token_ids:
            if stop_at_eos:
                break
            continue
        if t not in special:
            detok.add_token(t)
    detok.finalize()
    return detok.text
