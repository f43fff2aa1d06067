"""Gemma GGUF bases (models/gguf_arch/gemma.py) beyond what test_models_gguf_families.py
shows: the metadata keys read as llama.cpp reads them (src/models/gemma2.cpp,
gemma3.cpp: sliding window patterns and their defaults, the 27B attention scale,
soft-capping, the local rope base), what mlx-lm's models cannot follow refused by
name, gemma3 with llama.cpp's default period and a tied output (and without a window)
exactly as mlx-lm computes it, gemma2 batches with grouped queries, the norms' 1 + w,
and a Gemma SentencePiece vocabulary through mola's tokenizer loader."""

from __future__ import annotations

import dataclasses
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter

from twin_checks import assert_exact
from mola.errors import ModelLoadError
from mola.models.codecs import BFloat16
from mola.models.gguf_arch import BASE_ARCHITECTURES
from mola.models.gguf_file import open_gguf
from mola.models.loader import load_base_model
from mola.models.metadata import model_config
from mola.models.tokenizer import load_tokenizer
from mola.testing.gguf_model import save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

TOKENS = mx.array([[1, 17, 300, 45, 2, 99, 7, 256, 12, 5, 64, 33, 401, 8, 77, 150, 3, 42]])
ARCH = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3"}


def edit(model_dir, dest, drop_weights=(), **changes):
    """A copy of ``model_dir`` with config.json keys changed (None: removed) and weights dropped."""
    shutil.copytree(model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    config = {k: v for k, v in {**config, **changes}.items() if v is not None}
    (dest / "config.json").write_text(json.dumps(config))
    if drop_weights:
        weights = mx.load(str(dest / "model.safetensors"))
        mx.save_safetensors(str(dest / "model.safetensors"),
                            {k: v for k, v in weights.items() if k not in drop_weights})
    return dest


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """model_type -> (tiny mlx-lm directory, its GGUF twin)."""
    root = tmp_path_factory.mktemp("gemma")
    out = {}
    for model_type in ARCH:
        model_dir = make_tiny_model(root / model_type, TinyModelSpec(model_type=model_type, norm_noise=0.3))
        out[model_type] = model_dir, save_gguf_model(root / f"{model_type}.gguf", model_dir)
    return out


def config_of(twin, changes=None, drop=(), tensors=()):
    """The mlx-lm config of ``twin`` with its ``{arch}.key`` metadata changed or dropped
    and more tensor names, as metadata.model_config reads it."""
    f = open_gguf(twin)
    arch = f.arch.name
    metadata = {**f.metadata, **{f"{arch}.{k}": v for k, v in (changes or {}).items()}}
    for key in drop:
        metadata.pop(f"{arch}.{key}")
    names = {t.name for t in f.reader.tensors} | set(tensors)
    embed = next(t for t in f.reader.tensors if t.name == "token_embd.weight")
    return model_config(dataclasses.replace(f, metadata=metadata), names, int(embed.shape[-1]))




def test_gemma3_with_llama_cpp_default_period_and_a_tied_output(tmp_path):
    """Gemma3Model writes no sliding_window_pattern: llama.cpp's 6 (five sliding layers,
    then a global one), and a real Gemma 3 ties its output to token_embd."""
    model_dir = make_tiny_model(tmp_path / "src", TinyModelSpec(
        model_type="gemma3_text", num_hidden_layers=6, norm_noise=0.3))
    model_dir = edit(model_dir, tmp_path / "tied", drop_weights=("lm_head.weight",), sliding_window_pattern=6)
    twin = save_gguf_model(tmp_path / "tied.gguf", model_dir)
    assert "gemma3.attention.sliding_window_pattern" not in open_gguf(twin).metadata
    got = assert_exact(model_dir, twin)
    assert got.config["sliding_window_pattern"] == 6 and got.config["tie_word_embeddings"]
    assert "lm_head" not in got.model


def test_gemma3_without_a_sliding_window(twins, tmp_path):
    """sliding_window_pattern 1: the converter writes no window, llama.cpp's gemma3 has
    no sliding layer (swa_type NONE), every layer global with the scaled rope."""
    model_dir = edit(twins["gemma3_text"][0], tmp_path / "global", sliding_window_pattern=1)
    twin = save_gguf_model(tmp_path / "global.gguf", model_dir)
    assert "gemma3.attention.sliding_window" not in open_gguf(twin).metadata
    assert assert_exact(model_dir, twin).config["sliding_window_pattern"] == 1


# (model type, metadata changes, metadata dropped, config keys expected)
CONFIGS = [
    ("gemma", {}, (), {"head_dim": 24, "rope_theta": 10000.0, "tie_word_embeddings": True}),
    # the twin's own keys; rope.freq_base is not written (llama.cpp: 10000); the
    # window of the sliding layers (0, 2, ...) caps the context
    ("gemma2", {}, (), {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 7.0, "head_dim": 24,
                        "query_pre_attn_scalar": 24, "rope_theta": 10000.0, "max_position_embeddings": 64,
                        "sliding_window": 64}),
    # llama.cpp's 27B scale: 1/sqrt(n_embd / n_head), not of the head size
    ("gemma2", {"block_count": 46}, (), {"query_pre_attn_scalar": 16}),
    ("gemma2", {"attention.sliding_window_pattern": [False, False]}, (), {"max_position_embeddings": 2048}),
    ("gemma2", {"context_length": 8192}, ("attention.sliding_window", "attn_logit_softcapping",
                                          "final_logit_softcapping"),
     {"max_position_embeddings": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    ("gemma2", {"rope.freq_base": 20000.0, "rope.freq_base_swa": 20000.0}, (), {"rope_theta": 20000.0}),
    ("gemma3_text", {}, (), {"sliding_window": 8, "sliding_window_pattern": 2, "rope_local_base_freq": 1000.0,
                             "rope_theta": 10000.0, "query_pre_attn_scalar": 24,
                             "rope_scaling": {"type": "linear", "factor": 4.0}, "tie_word_embeddings": False}),
    ("gemma3_text", {"block_count": 62}, (), {"query_pre_attn_scalar": 16, "sliding_window_pattern": 2}),
    ("gemma3_text", {}, ("rope.freq_base_swa",), {"rope_local_base_freq": 10000.0}),
    ("gemma3_text", {"block_count": 12}, ("attention.sliding_window_pattern",), {"sliding_window_pattern": 6}),
    ("gemma3_text", {"block_count": 6, "attention.sliding_window_pattern": [True, True, False] * 2}, (),
     {"sliding_window_pattern": 3}),
    ("gemma3_text", {"attention.sliding_window": 0}, (), {"sliding_window_pattern": 1}),
]


@pytest.mark.parametrize("model_type, changes, drop, expected", CONFIGS)
def test_metadata_read_as_llama_cpp_reads_it(twins, model_type, changes, drop, expected):
    config = config_of(twins[model_type][1], changes, drop)
    assert {k: config.get(k) for k in expected} == expected


# (model type, metadata changes, more tensors, what the refusal names)
REFUSED = [
    ("gemma", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, (), "rope.scaling.type"),
    ("gemma2", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, (), "rope.scaling.type"),
    ("gemma2", {"rope.freq_base_swa": 5000.0}, (), "gemma2.rope.freq_base_swa"),
    ("gemma2", {}, ("output.weight",), "output.weight"),
    ("gemma", {}, ("output.weight",), "output.weight"),
    ("gemma3_text", {"final_logit_softcapping": 30.0}, (), "gemma3.final_logit_softcapping"),
    ("gemma3_text", {"attention.sliding_window_pattern": 0}, (), "sliding_window_pattern"),  # every layer slides
    ("gemma3_text", {"attention.sliding_window_pattern": 6}, (), "sliding_window_pattern"),  # 2 layers: both slide
    ("gemma3_text", {"block_count": 4, "attention.sliding_window_pattern": [True, False, False, True]}, (),
     "sliding_window_pattern"),
    ("gemma3_text", {"attention.key_length_swa": 32}, (), "key_length_swa"),
]


@pytest.mark.parametrize("model_type, changes, tensors, named", REFUSED)
def test_what_mlx_lm_cannot_follow_is_refused_by_name(twins, model_type, changes, tensors, named):
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.")):
        config_of(twins[model_type][1], changes, tensors=tensors)


def test_a_refused_file_does_not_load(twins, tmp_path):
    path = save_gguf_model(tmp_path / "out.gguf", twins["gemma2"][0],
                           extra_tensors={"output.weight": np.zeros((512, 64), np.float32)})
    with pytest.raises(ModelLoadError, match=r"output\.weight"):
        load_base_model(str(path), dtype="float32")
    path = save_gguf_model(tmp_path / "swa0.gguf", twins["gemma3_text"][0], metadata={
        "gemma3.attention.sliding_window_pattern": (0, GGUFValueType.UINT32)})
    with pytest.raises(ModelLoadError, match="sliding_window_pattern"):
        load_base_model(str(path), dtype="float32")


def test_norms_come_back_exactly(twins):
    """The held ``s - 1`` gives ``1 + (s - 1) == s`` for s >= 0.5 (F32, and BF16 widened);
    so a loaded norm's ``1 + weight`` is the directory's, though the weight need not be
    (w + 1 rounds where w is finer than 1's ulp)."""
    norms = BASE_ARCHITECTURES["gemma3"].weights
    s = np.random.default_rng(0).uniform(0.5, 8.0, 100_000).astype(np.float32)
    bf16 = (s.view(np.uint32) >> 16).astype(np.uint16)
    held = {"model.norm.weight": s, "model.layers.0.self_attn.q_norm.weight": BFloat16(bf16),
            "model.layers.0.mlp.up_proj.weight": s}
    norms(held, {})
    np.testing.assert_array_equal(np.float32(1) + held["model.norm.weight"], s)
    widened = (bf16.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(np.float32(1) + held["model.layers.0.self_attn.q_norm.weight"], widened)
    assert held["model.layers.0.mlp.up_proj.weight"] is s
    model_dir, twin = twins["gemma2"]
    got = load_base_model(str(twin), dtype="float32").model.model.layers[1].pre_feedforward_layernorm.weight
    want = mx.load(str(model_dir / "model.safetensors"))["model.layers.1.pre_feedforward_layernorm.weight"]
    np.testing.assert_array_equal(np.array(1 + got), np.array(1 + want))


@pytest.mark.parametrize("source", ["gguf", "mlx-lm"])
@pytest.mark.parametrize("rows", [2, 3])
def test_gemma2_batches_with_grouped_queries(twins, rows, source):
    """Left-padded rows in one batch (BatchKVCache's [B, 1, L, S] mask) answer as alone,
    with as many rows as kv heads (2: mlx-lm's gemma2 would mask the wrong rows) and
    with another count (3: it would fail to broadcast); a GGUF base and an mlx-lm
    directory alike (models/loader.py mends both)."""
    from mlx_lm.models.cache import BatchKVCache

    model_dir, twin = twins["gemma2"]
    model = load_base_model(str(twin if source == "gguf" else model_dir), dtype="float32").model
    prompts = [TOKENS[0, : 18 - 5 * i].tolist() for i in range(rows)]
    pad = [18 - len(p) for p in prompts]
    cache = [BatchKVCache(pad) for _ in model.layers]
    batch = model(mx.array([[0] * n + p for n, p in zip(pad, prompts)]), cache=cache)
    step = model(mx.array([[7]] * rows), cache=cache)
    for i, p in enumerate(prompts):
        alone = model(mx.array([p + [7]]))
        np.testing.assert_allclose(np.array(batch[i, -1]), np.array(alone[0, -2]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.array(step[i, -1]), np.array(alone[0, -1]), rtol=1e-5, atol=1e-5)


# A Gemma-style SentencePiece vocabulary: control tokens, pieces best-first (scores
# falling), byte fallback tokens, and a run of spaces stored as spaces (as Gemma's is)
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["he", "ll", "llo", "hello", "▁hello", "or", "wor", "ld", "world", "▁world", "  ",
          "▁", "h", "e", "l", "o", "w", "r", "d"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def test_a_gemma3_sentencepiece_vocabulary_loads_and_round_trips(tmp_path):
    """tokenizer.ggml.model "llama" with scores and token types, as Gemma3Model's
    _set_vocab_sentencepiece writes it (add_space_prefix False), through mola's
    tokenizer loader (transformers' gemma builder): BOS first, the pieces llama.cpp's
    SPM merges reach (best score first), byte fallback, whole control tokens, and
    <end_of_turn> ends a generation."""
    tokens = SPECIAL + PIECES + BYTES
    writer = GGUFWriter(str(tmp_path / "tok.gguf"), "gemma3")
    writer.add_type("model")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(SPECIAL) + [-float(i) for i in range(len(PIECES))] + [0.0] * 256)
    writer.add_token_types([3, 3, 3, 2, 3, 3] + [1] * len(PIECES) + [6] * 256)
    for add, token in ((writer.add_bos_token_id, "<bos>"), (writer.add_eos_token_id, "<eos>"),
                       (writer.add_unk_token_id, "<unk>"), (writer.add_pad_token_id, "<pad>")):
        add(tokens.index(token))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = open_gguf(tmp_path / "tok.gguf")
    tok = load_tokenizer(f.metadata, f.arch.name)
    ids = tok.encode("hello world")
    assert [tokens[i] for i in ids] == ["<bos>", "hello", "▁world"]
    for text in ("hello world", "hello  world", "héllo", " hello", "<start_of_turn>hello<end_of_turn>"):
        ids = tok.encode(text)
        assert ids[0] == tokens.index("<bos>") and tokens.index("<unk>") not in ids
        assert tok.decode(ids[1:]) == text
    ids = tok.encode("<start_of_turn>hello<end_of_turn>")
    assert [tokens[i] for i in ids] == ["<bos>", "<start_of_turn>", "hello", "<end_of_turn>"]
    assert tokens.index("<end_of_turn>") in tok.eos_token_ids
