"""GGUF base models (mola/models/gguf.py): the GGUF twin of a tiny mlx-lm model
computes exactly what mlx-lm computes on the directory (llama, qwen2, qwen3); what
cannot be mapped is refused by name; and on the real model (SmolLM2-135M-Instruct
Q4_1) mola's greedy tokens and logits equal llama.cpp's forward in numpy on gguf-py's
dequantization (tests/llama_cpp_reference.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFValueType

from helpers.mappings import HAS_SMAPS, mapped_rss_kib
from mola.errors import ModelLoadError
from mola.models.loader import load_base_model, resolve_model_path
from mola.server.startup import base_model_id
from mola.config import ServeConfig
from mola.testing.adapter import random_lora
from mola.adapters.formats.gguf_writer import save_gguf_adapter
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """model_type -> (mlx-lm directory, its GGUF twin)."""
    root = tmp_path_factory.mktemp("twins")
    out = {}
    for model_type in ("llama", "qwen2", "qwen3"):
        d = make_tiny_model(root / model_type, TinyModelSpec(model_type=model_type, norm_noise=0.3))
        out[model_type] = d, save_gguf_model(root / f"{model_type}.gguf", d)
    return out


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_the_gguf_twin_computes_exactly_what_mlx_lm_computes(model_type, twins):
    from mlx_lm import load

    model_dir, gguf = twins[model_type]
    ref, ref_tok = load(str(model_dir))
    got = load_base_model(str(gguf), dtype="float32")
    tokens = mx.array([[1, 17, 300, 45, 2, 99, 7, 256, 12]])
    np.testing.assert_array_equal(np.array(got.model(tokens)), np.array(ref(tokens)))
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size", "rope_theta"):
        assert got.config[key] == ref.args.__dict__[key], key
    if model_type == "llama":  # the same tokenizer, from the metadata
        text = "hello world, 123 + 4 = ü?"
        assert got.tokenizer.encode(text) == ref_tok.encode(text)
        assert got.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True) == \
            ref_tok.apply_chat_template(FRANCE, add_generation_prompt=True)
        # The same end-of-generation set as the directory's, by mola's one rule (models/eog.py).
        assert got.tokenizer.eos_token_ids == load_base_model(str(model_dir)).tokenizer.eos_token_ids


def test_a_directory_holding_one_gguf_and_the_served_id(twins, tmp_path):
    gguf = twins["llama"][1]
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "Tiny-Q8.gguf").write_bytes(gguf.read_bytes())
    assert resolve_model_path(str(tmp_path / "one")) == tmp_path / "one" / "Tiny-Q8.gguf"
    loaded = load_base_model(str(tmp_path / "one"))
    assert base_model_id(ServeConfig(model=str(tmp_path / "one")), loaded) == "Tiny-Q8"
    assert base_model_id(ServeConfig(model="x", served_model_name="mine"), loaded) == "mine"
    (tmp_path / "one" / "Other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files"):
        resolve_model_path(str(tmp_path / "one"))
    (tmp_path / "notes.gguf").write_text("not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF model"):
        resolve_model_path(str(tmp_path / "notes.gguf"))


def _refused(tmp_path, model_dir, match, **kwargs):
    path = save_gguf_model(tmp_path / "bad.gguf", model_dir, **kwargs)
    with pytest.raises(ModelLoadError, match=match):
        load_base_model(str(path), dtype="float32")


def test_what_cannot_be_mapped_exactly_is_refused_by_name(twins, tmp_path):
    model_dir = twins["llama"][0]
    _refused(tmp_path, model_dir, r"architecture 'falcon'.*supported: llama, qwen2, qwen3, .*gemma3, phi3", architecture="falcon")
    _refused(tmp_path, model_dir, r"mixture-of-experts.*expert_count = 8",
             metadata={"llama.expert_count": (8, GGUFValueType.UINT32)})
    _refused(tmp_path, model_dir, r"rope scaling 'yarn'",
             metadata={"llama.rope.scaling.type": "yarn",
                       "llama.rope.scaling.factor": (4.0, GGUFValueType.FLOAT32)})
    _refused(tmp_path, model_dir, r"rope_freqs\.weight", extra_tensors={"rope_freqs.weight": np.ones(8)})
    _refused(tmp_path, model_dir, r"'blk\.0\.attn_rot_embd\.weight'.*no place",
             extra_tensors={"blk.0.attn_rot_embd.weight": np.ones(8)})
    lora = save_gguf_adapter(tmp_path / "lora.gguf", random_lora(model_dir, rank=2), n_head=4, n_kv_head=2)
    with pytest.raises(ModelLoadError, match=r"general.type 'adapter'.*--adapter"):
        load_base_model(str(lora))


def test_linear_rope_scaling_is_applied(twins, tmp_path):
    from mlx_lm.models.llama import Model, ModelArgs

    path = save_gguf_model(tmp_path / "linear.gguf", twins["llama"][0],
                           metadata={"llama.rope.scaling.type": "linear",
                                     "llama.rope.scaling.factor": (2.0, GGUFValueType.FLOAT32)})
    loaded = load_base_model(str(path), dtype="float32")
    assert loaded.config["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert loaded.model.model.layers[0].self_attn.rope.scale == 0.5
    assert isinstance(loaded.model, Model) and ModelArgs


# ---- the real model ----------------------------------------------------------------


def mola_greedy(loaded, prompt, max_tokens):
    """Greedy tokens (up to EOS) with mlx-lm's generate_step on mola's model, and
    the log-probabilities each was picked from."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    tokens, logprobs = [], []
    for t, lp in generate_step(mx.array(prompt), loaded.model, max_tokens=max_tokens,
                               sampler=make_sampler(0.0)):
        tokens.append(int(t))
        logprobs.append(np.array(lp))
        if tokens[-1] in loaded.tokenizer.eos_token_ids:
            break
    return tokens, np.stack(logprobs)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow
def test_the_real_model_matches_llama_cpp_in_numpy(smollm, llama_cpp):
    """Greedy tokens equal, and every step's log-probabilities agree to 1e-3."""
    tok = smollm.tokenizer
    prompt = tok.apply_chat_template(FRANCE, add_generation_prompt=True)
    tokens, logprobs = mola_greedy(smollm, prompt, 12)
    assert tok.decode(tokens, skip_special_tokens=True) == "The capital of France is Paris."
    ref = llama_cpp.logits(prompt + tokens)  # the file's own layout
    ref = ref[len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    assert list(ref.argmax(-1)) == tokens  # so numpy's greedy path is the same
    np.testing.assert_allclose(logprobs, log_softmax(ref), rtol=0, atol=1e-3)


def test_the_real_model_kept_quantized(smollm, smollm_gguf):
    """--dtype keep: Q4_1 layers and the Q8_0 embedding stay quantized, and compute
    what the dequantized float32 model computes (short: quantized matmul is slow on
    a CPU without OpenBLAS)."""
    import mlx.nn as nn

    kept = load_base_model(str(smollm_gguf), dtype="keep")
    layer = kept.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear) and layer.self_attn.q_proj.bits == 4
    assert isinstance(kept.model.model.embed_tokens, nn.QuantizedEmbedding)
    assert kept.model.model.embed_tokens.bits == 8
    prompt = mx.array([smollm.tokenizer.encode("The capital of France is")])
    a, b = np.array(kept.model(prompt)[0, -1]), np.array(smollm.model(prompt)[0, -1])
    assert a.argmax() == b.argmax()
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)


@pytest.mark.skipif(not HAS_SMAPS, reason="reads the mapping's Rss from /proc/self/smaps")
def test_a_load_gives_back_the_files_pages_as_it_converts(tmp_path):
    """read_weights drops each tensor's pages of the file from resident memory
    once it is converted (GGUFFileReader.release): what a load holds at its
    peak is about its result, not the result and the file."""
    from mola.models.gguf import read_weights
    from mola.models.gguf_file import open_gguf

    spec = TinyModelSpec(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4)
    gguf = save_gguf_model(tmp_path / "wide.gguf", make_tiny_model(tmp_path / "wide", spec))
    f = open_gguf(gguf)
    _, weights, _ = read_weights(f, "float32")
    mx.eval(list(weights.values()))
    size_kib = gguf.stat().st_size // 1024
    assert size_kib > 4096  # the file is worth releasing: megabytes of tensors
    assert mapped_rss_kib(gguf) < size_kib // 10, (mapped_rss_kib(gguf), size_kib)
