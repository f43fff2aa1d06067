"""llama.cpp GGUF LoRA adapters: the reader (mola/adapters/formats/gguf.py), the
writer that mirrors convert_lora_to_gguf.py (mola/adapters/formats/gguf_writer.py), the
devtools converter, and serving a GGUF twin beside its mlx-lm original."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mola.errors import InvalidAdapter
from mola.adapters.formats import detect_format, read_adapter
from mola.adapters.formats.gguf import is_gguf_file, read_gguf_adapter
from mola.adapters.weights import LoRAWeights, ModuleLoRA, validate
from mola.models.metadata import read_model_config
from mola.testing.adapter import linear_shapes
from mola.adapters.formats.gguf_writer import save_gguf_adapter

from helpers.engines import EngineRunner as Runner
from helpers.references import greedy_tokens, merged_model

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "Hello there",
    "What is the capital of France? Please answer in one word.",
    "Write a poem about autumn leaves falling softly on the quiet street, then explain it.",
]
MAX_TOKENS = 10
GGUF_TENSOR = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# ---- fixtures and helpers ------------------------------------------------------


@pytest.fixture(scope="module")
def config(tiny_model):
    return read_model_config(tiny_model)


@pytest.fixture(scope="module")
def heads(config):
    return dict(n_head=config["num_attention_heads"], n_kv_head=config["num_key_value_heads"])


@pytest.fixture(scope="module")
def targets(config):
    shapes = linear_shapes(config)
    return {f"model.layers.{i}.{k}": v for i in range(config["num_hidden_layers"]) for k, v in shapes.items()}


@pytest.fixture(scope="module")
def twins(adapters, heads, tmp_path_factory):
    """The llama GGUF (f32) twin of each mlx-lm adapter of the conftest."""
    root = tmp_path_factory.mktemp("gguf-twins")
    return {
        name: save_gguf_adapter(root / f"{name}.gguf", read_adapter(path), architecture="llama", **heads)
        for name, path in adapters.items()
    }


def raw_tensors(path) -> dict[str, np.ndarray]:
    """The file's tensors as GGUFReader gives them (numpy order: dims reversed
    from ggml's ne), dequantized to float32."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            for t in reader.tensors}


def raw_ne(path) -> dict[str, list[int]]:
    return {t.name: [int(n) for n in t.shape] for t in gguf.GGUFReader(str(path)).tensors}


def field(path, key):
    f = gguf.GGUFReader(str(path)).fields[key]
    return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()[0]


def tensor_name(module: str) -> str:
    _, _, layer, kind, proj = module.split(".")
    return f"blk.{layer}.{GGUF_TENSOR[f'{kind}.{proj}']}.weight"


def deltas(weights: LoRAWeights) -> dict[str, np.ndarray]:
    return {p: np.array((m.scale * (m.a.astype(mx.float32) @ m.b.astype(mx.float32))))
            for p, m in weights.modules.items()}


def by_index_llama_cpp_order(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order written out index by index (independent of the
    reshape/swapaxes in the code under test): in each head of d rows, HF row
    s * d/2 + t (s = which rotated half) goes to row 2 * t + s."""
    d = rows.shape[0] // n_heads
    out = np.empty_like(rows)
    for h in range(n_heads):
        for s in range(2):
            for t in range(d // 2):
                out[h * d + 2 * t + s] = rows[h * d + s * d // 2 + t]
    return out


def write_raw_gguf(path, *, general_type="adapter", adapter_type="lora", arch="llama", alpha=8.0,
                   tensors=None, extra=None):
    """A GGUF file written key by key, to build broken adapters. ``tensors``:
    name -> numpy array (numpy order); None: a valid rank-4 pair on blk.0.attn_v."""
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = {
            "blk.0.attn_v.weight.lora_a": rng.normal(size=(4, 64)).astype(np.float32),
            "blk.0.attn_v.weight.lora_b": rng.normal(size=(32, 4)).astype(np.float32),
        }
    w = gguf.GGUFWriter(str(path), arch)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    if general_type is not None:
        w.add_string("general.type", general_type)
    if adapter_type is not None:
        w.add_string("adapter.type", adapter_type)
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    for key, value in (extra or {}).items():
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- 1. round trip at the weights level ----------------------------------------


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_llama_twin_round_trips_exactly_in_f32(adapters, twins, config, targets, name):
    original = read_adapter(adapters[name])
    back = read_gguf_adapter(twins[name], model_config=config)
    assert back.format == "gguf" and back.source == str(twins[name])
    assert sorted(back.modules) == sorted(original.modules)
    validate(back, targets, max_rank=16)
    for path, m in original.modules.items():
        got = back.modules[path]
        assert got.scale == m.scale and got.rank == m.rank
        assert mx.array_equal(got.a, m.a).item() and mx.array_equal(got.b, m.b).item(), path
    # What llama.cpp's loader checks: lora_a ne = [in, r], lora_b ne = [r, out];
    # alpha = scale * rank (llama.cpp's scale is alpha / rank).
    ne = raw_ne(twins[name])
    assert len(ne) == 2 * len(original.modules)
    for path, m in original.modules.items():
        in_dims, out_dims = targets[path]
        assert ne[tensor_name(path) + ".lora_a"] == [in_dims, m.rank]
        assert ne[tensor_name(path) + ".lora_b"] == [m.rank, out_dims]
    assert field(twins[name], "adapter.lora.alpha") == pytest.approx(original.scale * original.rank)
    assert field(twins[name], "general.architecture") == "llama"
    assert field(twins[name], "general.type") == "adapter"
    assert field(twins[name], "adapter.type") == "lora"


@pytest.mark.parametrize("outtype, tol", [("f16", 2e-3), ("bf16", 2e-2), ("q8_0", 2e-2)])
@pytest.mark.parametrize("name", ["a", "c"])
def test_llama_twin_round_trips_in_lower_precision(adapters, heads, config, tmp_path, name, outtype, tol):
    original = read_adapter(adapters[name])
    path = save_gguf_adapter(tmp_path / "t.gguf", original, dtype=outtype, **heads)
    stored = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    # q8_0 falls back to F16 where a row is not a multiple of 32 (lora_b's rows are r long).
    assert stored == {"f16": {"F16"}, "bf16": {"BF16"}, "q8_0": {"Q8_0", "F16"}}[outtype]
    back = read_gguf_adapter(path, model_config=config)
    assert sorted(back.modules) == sorted(original.modules)
    want, got = deltas(original), deltas(back)
    for p in want:
        scale = np.abs(want[p]).max()
        assert np.abs(got[p] - want[p]).max() <= tol * scale, p
    # and the cast to the engine's dtype is applied
    assert {m.a.dtype for m in read_gguf_adapter(path, mx.float16, model_config=config).modules.values()} == {mx.float16}


def test_alpha_folds_into_lora_b_and_alpha_zero_means_scale_one(adapters, heads, config, tmp_path):
    original = read_adapter(adapters["a"])  # scale 2, rank 4
    for alpha in (0.0, 1.0, 24.0):
        path = save_gguf_adapter(tmp_path / f"{alpha}.gguf", original, alpha=alpha, **heads)
        back = read_gguf_adapter(path, model_config=config)
        assert {m.scale for m in back.modules.values()} == {alpha / 4 if alpha else 1.0}
        want, got = deltas(original), deltas(back)
        for p in want:
            np.testing.assert_allclose(got[p], want[p], rtol=1e-5, atol=1e-6)
    zero = LoRAWeights("x", "mlx-lm", {p: ModuleLoRA(m.a, m.b, 0.0) for p, m in original.modules.items()})
    with pytest.raises(ValueError, match="scale 0"):
        save_gguf_adapter(tmp_path / "zero.gguf", zero, **heads)


# ---- 2. the q/k permutation ----------------------------------------------------


def test_llama_q_and_k_lora_b_are_stored_permuted_and_read_back_unpermuted(adapters, twins, config, heads):
    original = read_adapter(adapters["c"])  # q, k, v, o, gate, up, down on every layer
    raw = raw_tensors(twins["c"])
    back = read_gguf_adapter(twins["c"], model_config=config)
    for path, m in original.modules.items():
        base = tensor_name(path)
        hf_b = np.array(m.b).T  # [out, r], Hugging Face row order
        assert np.array_equal(raw[base + ".lora_a"], np.array(m.a).T), path  # A is never permuted
        if ".q_proj" in path or ".k_proj" in path:
            n = heads["n_head"] if ".q_proj" in path else heads["n_kv_head"]
            assert not np.array_equal(raw[base + ".lora_b"], hf_b), path
            assert np.array_equal(raw[base + ".lora_b"], by_index_llama_cpp_order(hf_b, n)), path
        else:
            assert np.array_equal(raw[base + ".lora_b"], hf_b), path
        assert mx.array_equal(back.modules[path].b, m.b).item(), path
    # The un-permutation depends on the head counts: other counts give other rows.
    wrong = read_gguf_adapter(twins["c"], model_config={"num_attention_heads": 2, "num_key_value_heads": 1})
    assert not mx.array_equal(wrong.modules["model.layers.0.self_attn.q_proj"].b,
                              original.modules["model.layers.0.self_attn.q_proj"].b).item()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_lora_b_is_not_permuted(adapters, tmp_path, arch):
    original = read_adapter(adapters["c"])
    path = save_gguf_adapter(tmp_path / "q.gguf", original, architecture=arch)  # no head counts needed
    raw = raw_tensors(path)
    for p, m in original.modules.items():
        assert np.array_equal(raw[tensor_name(p) + ".lora_b"], np.array(m.b).T), p
    back = read_gguf_adapter(path, model_type=arch)
    for p, m in original.modules.items():
        assert mx.array_equal(back.modules[p].b, m.b).item() and mx.array_equal(back.modules[p].a, m.a).item()


# ---- 3. serving: the mlx-lm adapter and its GGUF twin in one batch ---------------


@pytest.fixture(scope="module")
def runner(tiny_model):
    r = Runner(tiny_model, max_tokens=MAX_TOKENS)
    yield r
    r.stop()


def test_gguf_twin_serves_like_its_mlx_lm_original_in_a_mixed_batch(runner, tiny_model, adapters, twins):
    mlx_weights = read_adapter(adapters["c"], dtype=runner.engine.geometry.dtype)
    gguf_weights = read_gguf_adapter(twins["c"], runner.engine.geometry.dtype, model_config=runner.loaded.config)
    # Negative control: the same file with llama.cpp's q/k row order left as stored.
    raw = raw_tensors(twins["c"])
    alpha = field(twins["c"], "adapter.lora.alpha")
    unpermuted = LoRAWeights("raw", "gguf", {
        p: ModuleLoRA(mx.array(raw[tensor_name(p) + ".lora_a"].T), mx.array(raw[tensor_name(p) + ".lora_b"].T),
                      alpha / raw[tensor_name(p) + ".lora_b"].shape[1])
        for p in mlx_weights.modules
    })
    runner.add("mlx", mlx_weights)
    runner.add("gguf", gguf_weights)
    runner.add("stored-order", unpermuted)

    prompts = {q: runner.prompt(q) for q in QUESTIONS}
    base_model, _ = merged_model(tiny_model)
    merged, _ = merged_model(tiny_model, [adapters["c"]])
    refs = {(None, q): greedy_tokens(base_model, prompts[q], MAX_TOKENS) for q in QUESTIONS}
    refs |= {("mlx", q): greedy_tokens(merged, prompts[q], MAX_TOKENS) for q in QUESTIONS}
    assert any(refs[None, q] != refs["mlx", q] for q in QUESTIONS)  # the adapter changes the output

    jobs = [(name, q) for q in QUESTIONS for name in (None, "gguf", "mlx", "stored-order")]
    outputs = dict(zip(jobs, runner.wait([runner.submit(prompts[q], name) for name, q in jobs])))
    for q in QUESTIONS:
        assert outputs[None, q] == refs[None, q], q
        assert outputs["mlx", q] == refs["mlx", q], q
        assert outputs["gguf", q] == refs["mlx", q], q
    # Without undoing llama.cpp's q/k order the same file decodes differently.
    assert any(outputs["stored-order", q] != refs["mlx", q] for q in QUESTIONS)


# ---- 4. refusals ---------------------------------------------------------------

RNG = np.random.default_rng(1)
A4 = RNG.normal(size=(4, 64)).astype(np.float32)  # numpy [r, in]


@pytest.mark.parametrize("kwargs, read_kwargs, match", [
    (dict(general_type="model"), {}, r"general\.type 'model'"),
    (dict(general_type=None), {}, r"no general\.type"),
    (dict(adapter_type="control_vector"), {}, r"adapter\.type 'control_vector'"),
    (dict(arch="falcon"), {}, r"architecture 'falcon'"),
    (dict(arch="mistral"), {}, r"architecture 'mistral'"),
    ({}, dict(model_type="qwen2"), r"'llama' model .*'qwen2'"),
    (dict(arch="qwen2"), dict(model_type="llama"), r"'qwen2' model .*'llama'"),
    (dict(arch="qwen2"), dict(model_config={"model_type": "mistral"}), r"'qwen2' model .*'mistral'"),
    (dict(tensors={"token_embd.weight.lora_a": A4, "token_embd.weight.lora_b": RNG.normal(size=(512, 4)).astype(np.float32)}),
     {}, r"cannot map .*token_embd\.weight\.lora_a"),
    (dict(tensors={"output.weight.lora_a": A4, "output.weight.lora_b": A4}), {}, r"output\.weight\.lora_a"),
    (dict(tensors={"blk.0.attn_qkv.weight.lora_a": A4, "blk.0.attn_qkv.weight.lora_b": A4}), {}, r"blk\.0\.attn_qkv"),
    (dict(tensors={"blk.0.attn_v.weight.lora_a": A4}), {}, r"'blk\.0\.attn_v\.weight' has no lora_b"),
    (dict(tensors={"blk.1.ffn_up.weight.lora_b": A4.T.copy()}), {}, r"'blk\.1\.ffn_up\.weight' has no lora_a"),
    (dict(tensors={"blk.0.attn_v.weight": A4}), {}, r"'blk\.0\.attn_v\.weight', which is not a LoRA factor"),
    (dict(tensors={"blk.0.attn_v.weight.lora_a": A4, "blk.0.attn_v.weight.lora_b": A4.T.copy(),
                   "blk.0.attn_norm.weight": np.ones(64, np.float32)}), {}, r"norm weights \(blk\.0\.attn_norm\.weight\)"),
    (dict(tensors={"blk.0.attn_v.weight.lora_a": A4, "blk.0.attn_v.weight.lora_b": RNG.normal(size=(32, 8)).astype(np.float32)}),
     {}, r"lora_a of rank 4 .* lora_b of rank 8"),
    (dict(tensors={"blk.0.attn_v.weight.lora_a": (A4 * 100).astype(np.int32), "blk.0.attn_v.weight.lora_b": A4.T.copy()}),
     {}, r"type I32"),
    (dict(extra={"adapter.alora.invocation_tokens": 7}), {}, r"invocation_tokens .*list of token ids, got 7"),
    (dict(tensors={"blk.0.attn_q.weight.lora_a": A4, "blk.0.attn_q.weight.lora_b": RNG.normal(size=(64, 4)).astype(np.float32)}),
     {}, r"num_attention_heads"),
    (dict(tensors={"blk.0.attn_k.weight.lora_a": A4, "blk.0.attn_k.weight.lora_b": RNG.normal(size=(30, 4)).astype(np.float32)}),
     dict(model_config={"num_attention_heads": 4, "num_key_value_heads": 4}), r"30 rows, which do not split into 4 heads"),
], ids=["general-type", "no-general-type", "adapter-type", "unknown-arch", "mistral-arch", "llama-on-qwen2",
        "qwen2-on-llama", "qwen2-on-mistral-config", "token-embd", "output", "fused-qkv", "a-without-b",
        "b-without-a", "no-suffix", "norm", "rank-mismatch", "int32-tensor", "alora", "no-head-counts",
        "bad-head-split"])
def test_refuses_with_a_message_naming_the_problem(tmp_path, kwargs, read_kwargs, match):
    path = write_raw_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(InvalidAdapter, match=match):
        read_gguf_adapter(path, **read_kwargs)


@pytest.mark.parametrize("keep", [0.5, 0.9, 30])
def test_refuses_a_truncated_file(twins, tmp_path, keep):
    data = twins["c"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(InvalidAdapter, match="not a readable GGUF file"):
        read_adapter(cut)


def test_the_untouched_raw_file_is_accepted(tmp_path):
    """The refusal cases above differ from this one only in what they break."""
    back = read_gguf_adapter(write_raw_gguf(tmp_path / "ok.gguf"))
    assert list(back.modules) == ["model.layers.0.self_attn.v_proj"]
    assert back.modules["model.layers.0.self_attn.v_proj"].scale == 2.0  # alpha 8 / rank 4
    # llama.cpp reads a missing alpha as 0, and alpha 0 as scale 1.
    back = read_gguf_adapter(write_raw_gguf(tmp_path / "noalpha.gguf", alpha=None))
    assert back.modules["model.layers.0.self_attn.v_proj"].scale == 1.0


# ---- 5. dispatch ---------------------------------------------------------------


def test_dispatch_reads_a_gguf_file_and_a_directory_holding_one(adapters, tmp_path):
    original = read_adapter(adapters["a"])
    folder = tmp_path / "adapter"
    path = save_gguf_adapter(folder / "lora.gguf", original, architecture="qwen2")
    assert is_gguf_file(path) and not is_gguf_file(adapters["a"] / "adapters.safetensors")
    assert detect_format(path) == detect_format(folder) == "gguf"
    from_file = read_adapter(path, model_type="qwen2")
    from_dir = read_adapter(folder, dtype=mx.float16)
    for weights in (from_file, from_dir):
        assert weights.format == "gguf" and sorted(weights.modules) == sorted(original.modules)
    for p, m in original.modules.items():
        assert mx.array_equal(from_file.modules[p].b, m.b).item()
        assert from_dir.modules[p].a.dtype == mx.float16
    with pytest.raises(InvalidAdapter, match="'qwen2' model .*'llama'"):
        read_adapter(folder, model_type="llama")


def test_dispatch_of_a_llama_file_takes_head_counts_from_its_metadata(adapters, twins, tmp_path):
    """read_adapter passes no model config: a llama q/k adapter is readable
    through it when the file carries the head counts, and refused otherwise."""
    with pytest.raises(InvalidAdapter, match="num_attention_heads"):
        read_adapter(twins["a"])
    original = read_adapter(adapters["a"])
    raw = raw_tensors(twins["a"])
    path = write_raw_gguf(tmp_path / "heads.gguf", alpha=8.0, tensors=raw,
                          extra={"llama.attention.head_count": 4, "llama.attention.head_count_kv": 2})
    back = read_adapter(path, model_type="llama")
    for p, m in original.modules.items():
        assert mx.array_equal(back.modules[p].b, m.b).item(), p


def test_a_file_that_is_not_gguf_is_not_taken_for_one(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(InvalidAdapter, match="not a GGUF adapter"):
        read_adapter(fake)


# ---- devtools ------------------------------------------------------------------


def test_devtools_converter_writes_the_gguf_twin(tiny_model, adapters, config, tmp_path):
    out = tmp_path / "c.gguf"
    r = subprocess.run(
        [sys.executable, str(ROOT / "devtools" / "convert_mlx_lm_to_gguf.py"), str(adapters["c"]), str(out),
         "--model", str(tiny_model)],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert field(out, "general.architecture") == "llama"
    original = read_adapter(adapters["c"])
    back = read_gguf_adapter(out, model_config=config)
    assert sorted(back.modules) == sorted(original.modules)
    for p, m in original.modules.items():
        assert mx.array_equal(back.modules[p].b, m.b).item() and back.modules[p].scale == m.scale
