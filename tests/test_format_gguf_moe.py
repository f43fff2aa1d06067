"""llama.cpp GGUF LoRA adapters on mixtures of experts (mola/adapters/formats/gguf.py and
gguf_writer.py): an adapter written through mlx-lm's own linear_to_lora_layers
(experts, routers, qwen2_moe's shared expert) is written by hand in llama.cpp's layout
(names from gguf-py's TensorNameMap, factors stacked per expert as
convert_lora_to_gguf.py stacks them: lora_a numpy [E, r, in], lora_b [E, out, r]);
mola reads it back equal to its mlx-lm twin, its shapes pass llama-adapter.cpp's checks
against the GGUF base, mola's writer writes the same file, and what does not fit the
base's experts is refused by name."""

from __future__ import annotations

import json

import gguf
import mlx.core as mx
import numpy as np
import pytest

from mola.errors import InvalidAdapter
from mola.adapters.formats import read_adapter
from mola.adapters.formats.gguf import read_gguf_adapter
from mola.adapters.formats.gguf_writer import save_gguf_adapter
from mola.testing.adapter import make_mlx_lm_lora
from mola.testing.gguf_model import gguf_name, save_gguf_model
from mola.testing.model import TinyModelSpec, make_tiny_model

ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen2_moe": "qwen2moe", "gpt_oss": "gpt-oss"}
RANK, SCALE = 4, 2.0


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """model_type -> (model directory, its config, mlx-lm adapter directory)."""
    root = tmp_path_factory.mktemp("moe-lora")
    out = {}
    for model_type in ARCH:
        model = make_tiny_model(root / model_type, TinyModelSpec(model_type=model_type))
        adapter = make_mlx_lm_lora(root / f"{model_type}-lora", model, rank=RANK, scale=SCALE, seed=1)
        out[model_type] = model, json.loads((model / "config.json").read_text()), adapter
    return out


def llama_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute on the rows of a lora_b [out, r]."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def by_hand(path, model_type, config, adapter_dir) -> dict[str, np.ndarray]:
    """Write the adapter as convert_lora_to_gguf.py lays it out; returns its tensors."""
    tensors = {}
    for key, value in mx.load(str(adapter_dir / "adapters.safetensors")).items():
        module, _, leaf = key.rpartition(".")
        name = gguf_name(f"{module}.weight", model_type, config["num_hidden_layers"])
        data = np.array(value.astype(mx.float32))  # experts: a [E, r, in], b [E, out, r] as llama.cpp stores them
        if data.ndim == 2:
            data = data.T  # a [in, r] -> [r, in]; b [r, out] -> [out, r]
        if model_type == "mixtral" and leaf == "lora_b" and name.split(".")[2] in ("attn_q", "attn_k"):
            data = llama_permute(data, config["num_attention_heads"] if ".attn_q." in name else
                                 config["num_key_value_heads"])
        tensors[f"{name}.{leaf}"] = np.ascontiguousarray(data)
    write_lora(path, ARCH[model_type], tensors)
    return tensors


def write_lora(path, arch, tensors, alpha=SCALE * RANK):
    w = gguf.GGUFWriter(str(path), arch)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def ne(path) -> dict[str, list[int]]:
    return {t.name: [int(n) for n in t.shape] for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("model_type", list(ARCH))
def test_a_gguf_expert_lora_reads_back_equal_to_its_mlx_lm_twin(model_type, moe, tmp_path):
    model, config, adapter = moe[model_type]
    by_hand(tmp_path / "lora.gguf", model_type, config, adapter)
    twin = read_adapter(adapter)
    got = read_adapter(tmp_path / "lora.gguf", model_type=model_type, model_config=config)
    assert set(got.modules) == set(twin.modules)
    assert any(m.num_experts == 8 for m in got.modules.values())
    for path, m in twin.modules.items():
        g = got.modules[path]
        assert g.a.shape == m.a.shape and g.b.shape == m.b.shape, path  # [E, in, r], [E, r, out]
        np.testing.assert_array_equal(np.array(g.a), np.array(m.a), err_msg=path)
        np.testing.assert_array_equal(np.array(g.b), np.array(m.b), err_msg=path)
        assert g.scale == pytest.approx(m.scale, rel=1e-6)
    # without its base: the same module paths, llama's q/k rows left as stored
    assert set(read_adapter(tmp_path / "lora.gguf", rows_as_stored=True).modules) == set(twin.modules)


@pytest.mark.parametrize("model_type", list(ARCH))
def test_the_shapes_pass_llama_adapter_cpp_checks_against_the_gguf_base(model_type, moe, tmp_path):
    """llama-adapter.cpp: model ne[0] == a ne[0], model ne[1] == b ne[1], a ne[1] == b
    ne[0]; and build_lora_mm_id indexes a and b by expert: their ne[2] is the model's."""
    model, config, adapter = moe[model_type]
    lora = by_hand(tmp_path / "lora.gguf", model_type, config, adapter)
    base = ne(save_gguf_model(tmp_path / "base.gguf", model))
    factors = ne(tmp_path / "lora.gguf")
    for name in {n.rpartition(".")[0] for n in lora}:
        a, b, w = factors[f"{name}.lora_a"], factors[f"{name}.lora_b"], base[name]
        w = w + [1] * (len(a) - len(w))  # llama.cpp's 1-D ffn_gate_inp_shexp is [n_embd, 1]
        assert (a[0], b[1], a[1]) == (w[0], w[1], b[0]), name
        assert a[2:] == b[2:] == w[2:], name


@pytest.mark.parametrize("model_type", list(ARCH))
def test_molas_writer_writes_what_the_converter_writes(model_type, moe, tmp_path):
    model, config, adapter = moe[model_type]
    expected = by_hand(tmp_path / "hand.gguf", model_type, config, adapter)
    path = save_gguf_adapter(tmp_path / "mola.gguf", read_adapter(adapter), architecture=ARCH[model_type],
                             n_head=config["num_attention_heads"], n_kv_head=config["num_key_value_heads"])
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == ARCH[model_type]
    assert reader.fields["adapter.lora.alpha"].contents() == pytest.approx(SCALE * RANK)
    got = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert set(got) == set(expected)
    for name, data in expected.items():
        np.testing.assert_allclose(got[name], data, rtol=1e-6, atol=0, err_msg=name)


def stacked(rng, experts=8, rank=RANK, inp=64, out=32):
    return {"blk.0.ffn_up_exps.weight.lora_a": rng.normal(size=(experts, rank, inp)).astype(np.float32),
            "blk.0.ffn_up_exps.weight.lora_b": rng.normal(size=(experts, out, rank)).astype(np.float32)}


@pytest.mark.parametrize("arch, tensors, model_type, match", [
    ("qwen3moe", dict(experts=4), "qwen3_moe", r"factors for 4 experts .*base model has 8 experts"),
    ("qwen3moe", {"blk.0.ffn_up_exps.weight.lora_b": (4, 32, RANK)}, "qwen3_moe",
     r"lora_a of rank 4 \(ne \[64, 4, 8\]\) but lora_b of rank 4 \(ne \[4, 32, 4\]\)"),
    ("qwen3moe", {"blk.0.ffn_up_exps.weight.lora_a": (RANK, 64), "blk.0.ffn_up_exps.weight.lora_b": (32, RANK)},
     "qwen3_moe", r"2 dimensions .*stacked per expert"),
    ("qwen3moe", {}, "qwen2_moe", r"'qwen3moe' model .*base model's type is 'qwen2_moe'"),
    ("llama", {}, "llama", r"mixture-of-experts LoRA tensors \(ffn_up_exps\).*base model \('llama'\) is dense"),
    ("llama", {"blk.0.ffn_up.weight.lora_a": (RANK, 64), "blk.0.ffn_up.weight.lora_b": (128, RANK),
               "blk.0.ffn_up_exps.weight.lora_a": None, "blk.0.ffn_up_exps.weight.lora_b": None},
     "mixtral", r"cannot map onto the linears of a 'mixtral' model .*blk\.0\.ffn_up\.weight"),
    ("qwen3moe", {"blk.0.ffn_up_shexp.weight.lora_a": (RANK, 64), "blk.0.ffn_up_shexp.weight.lora_b": (48, RANK)},
     "qwen3_moe", r"'qwen3_moe' model .*blk\.0\.ffn_up_shexp"),
], ids=["expert-count", "a-b-experts", "unstacked", "qwen3moe-on-qwen2moe", "experts-on-dense-llama",
        "dense-ffn-on-mixtral", "shared-expert-on-qwen3moe"])
def test_what_does_not_fit_the_bases_experts_is_refused_by_name(arch, tensors, model_type, match, tmp_path, moe):
    rng = np.random.default_rng(0)
    files = stacked(rng, **{k: v for k, v in tensors.items() if k == "experts"})
    for name, shape in tensors.items():
        if name == "experts":
            continue
        if shape is None:
            files.pop(name)
        else:
            files[name] = rng.normal(size=shape).astype(np.float32)
    path = write_lora(tmp_path / "bad.gguf", arch, files)
    config = dict(moe[model_type][1]) if model_type in moe else {"model_type": model_type}
    with pytest.raises(InvalidAdapter, match=match):
        read_gguf_adapter(path, model_config=config)


def test_mola_train_may_write_expert_lora_as_gguf():
    """``mola train --out x.gguf`` accepts the keys mlx-lm's tuner puts LoRA on in a
    mixture of experts, and names the architecture the file is written for."""
    from mola.train.export import check_gguf_export

    keys = ["mlp.gate", "mlp.switch_mlp.gate_proj", "mlp.switch_mlp.down_proj", "self_attn.q_proj"]
    assert check_gguf_export({"model_type": "qwen3_moe"}, keys) == "qwen3moe"
    assert check_gguf_export({"model_type": "mixtral"}, ["block_sparse_moe.switch_mlp.up_proj"]) == "llama"
    assert check_gguf_export({"model_type": "gpt_oss"}, ["mlp.router", "mlp.experts.up_proj"]) == "gpt-oss"
