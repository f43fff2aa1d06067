"""Reading mlx-lm adapters and refusing broken ones with a message that names
the problem (mola/adapters/formats, mola/adapters/weights.py)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from mola.errors import AdapterPathNotFound, InvalidAdapter
from mola.adapters.formats import read_adapter
from mola.adapters.weights import validate
from mola.models.metadata import read_model_config
from mola.testing.adapter import linear_shapes


@pytest.fixture()
def targets(tiny_model):
    config = read_model_config(tiny_model)
    shapes = linear_shapes(config)
    return {
        f"model.layers.{i}.{k}": v
        for i in range(config["num_hidden_layers"])
        for k, v in shapes.items()
    }


@pytest.fixture()
def broken(tmp_path, adapters):
    """A copy of adapter 'a' to damage."""
    path = tmp_path / "broken"
    shutil.copytree(adapters["a"], path)
    return path


def load_and_validate(path, targets, max_rank=16):
    weights = read_adapter(path)
    validate(weights, targets, max_rank)
    return weights


def test_reads_mlx_lm_adapter(adapters, targets):
    weights = load_and_validate(adapters["a"], targets)
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    tensors = mx.load(str(adapters["a"] / "adapters.safetensors"))
    assert weights.rank == 4 and weights.scale == config["lora_parameters"]["scale"]
    assert len(weights.modules) == len(tensors) // 2
    for path, m in weights.modules.items():
        assert mx.array_equal(m.a, tensors[f"{path}.lora_a"]).item()
        assert mx.array_equal(m.b, tensors[f"{path}.lora_b"]).item()


def test_missing_path(tmp_path):
    with pytest.raises(AdapterPathNotFound, match="does not exist"):
        read_adapter(tmp_path / "nope")


def test_missing_files(tmp_path, broken):
    (broken / "adapters.safetensors").unlink()
    with pytest.raises(InvalidAdapter, match="adapters.safetensors"):
        read_adapter(broken)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidAdapter, match="No adapter found"):
        read_adapter(empty)


def test_config_not_json(broken):
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidAdapter, match="not valid JSON"):
        read_adapter(broken)


@pytest.mark.parametrize("kind", ["dora", "full"])
def test_refuses_full_and_dora_without_magnitudes(broken, kind):
    config = json.loads((broken / "adapter_config.json").read_text())
    config["fine_tune_type"] = kind
    (broken / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidAdapter, match=kind):
        read_adapter(broken)


def test_missing_scale(broken):
    config = json.loads((broken / "adapter_config.json").read_text())
    del config["lora_parameters"]["scale"]
    (broken / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidAdapter, match="scale"):
        read_adapter(broken)


def test_rank_above_max(adapters, targets):
    with pytest.raises(InvalidAdapter, match=r"rank 16 .*--max-lora-rank 8"):
        load_and_validate(adapters["c"], targets, max_rank=8)


def test_module_the_model_lacks(broken, targets):
    tensors = mx.load(str(broken / "adapters.safetensors"))
    tensors["model.layers.9.self_attn.q_proj.lora_a"] = mx.zeros((64, 4))
    tensors["model.layers.9.self_attn.q_proj.lora_b"] = mx.zeros((4, 64))
    mx.save_safetensors(str(broken / "adapters.safetensors"), tensors)
    with pytest.raises(InvalidAdapter, match=r"model\.layers\.9\.self_attn\.q_proj"):
        load_and_validate(broken, targets)


def test_shapes_that_do_not_fit(broken, targets):
    tensors = mx.load(str(broken / "adapters.safetensors"))
    key = "model.layers.0.self_attn.v_proj.lora_b"
    tensors[key] = mx.zeros((4, 7))
    mx.save_safetensors(str(broken / "adapters.safetensors"), tensors)
    with pytest.raises(InvalidAdapter) as e:
        load_and_validate(broken, targets)
    message = str(e.value)
    assert "model.layers.0.self_attn.v_proj" in message and "(4, 7)" in message
    assert "expected" in message


def test_non_finite_values(broken, targets):
    tensors = mx.load(str(broken / "adapters.safetensors"))
    key = "model.layers.1.self_attn.q_proj.lora_a"
    tensors[key] = mx.full(tensors[key].shape, float("nan"))
    mx.save_safetensors(str(broken / "adapters.safetensors"), tensors)
    with pytest.raises(InvalidAdapter, match="non-finite"):
        load_and_validate(broken, targets)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_the_finiteness_check_in_every_float_dtype(dtype):
    """One bad value anywhere is found; the largest finite values are not
    mistaken for infinities (compared with MLX's own isfinite)."""
    from mola.adapters.weights import all_finite

    big = {mx.float32: 3.0e38, mx.float16: 65504.0, mx.bfloat16: 3.0e38}[dtype]
    x = mx.random.normal((37, 16)).astype(dtype)
    x[5, 3] = big
    x[6, 4] = -big
    x[7, 5] = 0.0
    assert all_finite(x) and mx.isfinite(x).all().item()
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = mx.array(x)
        y[36, 15] = bad
        mx.eval(y)
        assert not all_finite(y) and not mx.isfinite(y).all().item()


def test_truncated_safetensors(broken):
    data = (broken / "adapters.safetensors").read_bytes()
    (broken / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidAdapter):
        read_adapter(broken)


def test_unpaired_factor(broken):
    tensors = mx.load(str(broken / "adapters.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.lora_b"]
    mx.save_safetensors(str(broken / "adapters.safetensors"), tensors)
    with pytest.raises(InvalidAdapter, match="q_proj has no lora_b"):
        read_adapter(broken)


def test_bfloat16_adapter_is_cast(broken, targets):
    tensors = mx.load(str(broken / "adapters.safetensors"))
    mx.save_safetensors(
        str(broken / "adapters.safetensors"), {k: v.astype(mx.bfloat16) for k, v in tensors.items()}
    )
    weights = read_adapter(broken, dtype=mx.float32)
    validate(weights, targets, 16)
    assert all(m.a.dtype == mx.float32 for m in weights.modules.values())
