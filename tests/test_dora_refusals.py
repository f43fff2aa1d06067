"""What mola refuses of DoRA, each with a message that names the problem
(mola/adapters/dora.py, the readers' DoRA checks), and where it reports an
adapter's kind: /v1/models, /v1/adapters, mola validate; a DoRA training model
pushed from memory stays DoRA."""

from __future__ import annotations

import mlx.core as mx
import pytest

from helpers.dora import write_peft_dora
from mola.testing.adapter import make_mlx_lm_lora


@pytest.fixture(scope="module")
def peft_dora(tiny_model, tmp_path_factory):
    return write_peft_dora(tmp_path_factory.mktemp("peft") / "dora", tiny_model)


@pytest.fixture(scope="module")
def dora_dir(tiny_model, tmp_path_factory):
    return make_mlx_lm_lora(tmp_path_factory.mktemp("d") / "dora", tiny_model, rank=4, fine_tune_type="dora")


def test_a_request_scale_and_a_stack_are_refused_on_a_dora_adapter(engine, dora_dir, adapters):
    from helpers.engines import run_registry
    from mola.errors import InvalidAdapter, InvalidRequest

    async def scenario(registry):
        d = await registry.load("d", str(dora_dir))
        await registry.load("a", str(adapters["a"]))
        assert d.kind == d.describe()["kind"] == "dora"
        with pytest.raises(InvalidRequest, match="lora_scale 0.5 asks to scale 'd', a DoRA adapter"):
            await registry.acquire("d", 0.5)
        (await registry.acquire("d", 1.0)).release()  # its own scale is served
        with pytest.raises(InvalidAdapter, match="is a DoRA adapter: it is not stacked with others"):
            await registry.acquire("a", stack=[("d", 1.0)])
        lease = await registry.acquire("a", 0.5)  # a plain LoRA takes any scale
        assert lease.record.kind == "lora"
        lease.release()
    run_registry(engine, scenario, max_loras=3)


def _edit(src, dst, config=None, tensors=None):
    """A copy of the mlx-lm adapter ``src`` at ``dst``, its config and tensors edited."""
    import json
    import shutil

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps(config(cfg)))
    if tensors is not None:
        t = tensors(dict(mx.load(str(dst / "adapters.safetensors"))))
        mx.save_safetensors(str(dst / "adapters.safetensors"), t)
    return dst


@pytest.mark.parametrize("case, match", [
    ("as-lora", "not a LoRA factor .*a DoRA magnitude, but the config's fine_tune_type is not 'dora'"),
    ("no-m", "holds no DoRA magnitudes"),
    ("one-m-missing", "has LoRA factors and no magnitude vector"),
    ("short-m", "the DoRA magnitude of .* has shape \\(32,\\); expected \\(64,\\)"),
    ("nan-m", "the DoRA magnitude of .* contains non-finite values"),
    ("alora", "DoRA adapter with alora_invocation_tokens"),
])
def test_broken_or_unserved_dora_files_are_refused(tmp_path, tiny_model, dora_dir, case, match):
    from mola.adapters.formats import read_adapter
    from mola.adapters.weights import validate
    from mola.errors import InvalidAdapter
    from mola.lora.pack import geometry_of
    from mola.models.loader import load_base_model

    q = "model.layers.0.self_attn.q_proj.m"
    edits = {
        "as-lora": dict(config=lambda c: {**c, "fine_tune_type": "lora"}),
        "no-m": dict(tensors=lambda t: {k: v for k, v in t.items() if not k.endswith(".m")}),
        "one-m-missing": dict(tensors=lambda t: {k: v for k, v in t.items() if k != q}),
        "short-m": dict(tensors=lambda t: {**t, q: t[q][:32]}),
        "nan-m": dict(tensors=lambda t: {**t, q: t[q] * mx.array(float("nan"))}),
        "alora": dict(config=lambda c: {**c, "alora_invocation_tokens": [5, 6]}),
    }
    path = _edit(dora_dir, tmp_path / case, **edits[case])
    geometry = geometry_of(load_base_model(str(tiny_model)).model, max_rank=16, num_slots=3)
    with pytest.raises(InvalidAdapter, match=match):
        validate(read_adapter(path), geometry.targets, 16)


def test_dora_on_a_tensor_parallel_base_or_on_experts_is_refused(dora_dir, tiny_model):
    from mola.adapters.formats import read_adapter
    from mola.adapters.weights import validate
    from mola.errors import InvalidAdapter
    from mola.lora.geometry import Sharding, TargetGeometry
    from mola.lora.pack import geometry_of
    from mola.models.loader import load_base_model

    weights = read_adapter(dora_dir)
    targets = dict(geometry_of(load_base_model(str(tiny_model)).model, max_rank=16, num_slots=3).targets)
    q = "model.layers.0.self_attn.q_proj"
    split = {**targets, q: TargetGeometry(*targets[q].dims, Sharding("column", 0, 2))}
    with pytest.raises(InvalidAdapter, match="split across a tensor-parallel group .*column-sharded.*does not serve "
                                             "DoRA on a tensor-parallel base"):
        validate(weights, split, 16)
    # an expert module with a magnitude: as if the base's q_proj held experts
    m = weights.modules[q]
    experts = {**targets, q: TargetGeometry(*targets[q].dims, num_experts=2)}
    import dataclasses

    from mola.adapters.weights import ModuleLoRA
    from mola.adapters.dora import check_dora

    stacked = ModuleLoRA(a=mx.stack([m.a, m.a]), b=mx.stack([m.b, m.b]), scale=m.scale)
    on_experts = dataclasses.replace(weights, modules={**weights.modules, q: stacked})
    with pytest.raises(InvalidAdapter, match="puts DoRA on the experts of a mixture of experts"):
        check_dora(on_experts, experts)


def test_peft_magnitudes_without_use_dora_are_refused(tmp_path, peft_dora):
    import json
    import shutil

    from mola.adapters.formats import read_adapter
    from mola.errors import InvalidAdapter

    path = shutil.copytree(peft_dora[0], tmp_path / "p")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    with pytest.raises(InvalidAdapter, match="DoRA magnitude vector, but the config's use_dora is not true"):
        read_adapter(path)


def test_over_http_models_list_kinds_and_a_scaled_dora_request_is_a_400(client, dora_dir):
    r = client.post("/v1/adapters", json={"name": "dora", "path": str(dora_dir)})
    assert r.status_code == 200, r.text
    chat = {"model": "dora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    r = client.post("/v1/chat/completions", json={**chat, "lora_scale": 0.5})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_scale" and "'dora', a DoRA adapter" in error["message"], error
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["dora"]["kind"] == "dora" and cards["a"]["kind"] == "lora" and "kind" not in cards["tiny"]
    assert client.get("/v1/adapters/dora").json()["kind"] == "dora"


def test_train_refuses_dora_with_a_gguf_output_or_an_invocation(tiny_model, tmp_path):
    from mola.train import TrainConfig

    with pytest.raises(ValueError, match="cannot be written as GGUF .*llama.cpp has no DoRA"):
        TrainConfig(model=str(tiny_model), data=tmp_path, out=tmp_path / "a.gguf", fine_tune_type="dora")
    with pytest.raises(ValueError, match="'dora' and alora_invocation do not go together"):
        TrainConfig(model=str(tiny_model), data=tmp_path, out=tmp_path / "a", fine_tune_type="dora",
                    alora_invocation="<|im_start|>assistant")
    with pytest.raises(ValueError, match="fine_tune_type must be 'lora' or 'dora', got 'full'"):
        TrainConfig(model=str(tiny_model), data=tmp_path, out=tmp_path / "a", fine_tune_type="full")


def test_validate_reports_each_adapters_kind(dora_dir, peft_dora, adapters, tiny_model):
    from mola.validate.command import text, validate

    for path, kind in ((dora_dir, "dora"), (peft_dora[0], "dora"), (adapters["a"], "lora")):
        report = validate(str(path), str(tiny_model), max_rank=16)
        assert report.ok and report.info.kind == kind and report.to_json()["info"]["kind"] == kind
        assert f"kind     {kind}" in text(report)


def test_a_dora_training_model_pushes_as_dora(tiny_model):
    """mola.client's adapter_body carries DoRALinear's magnitudes (never a DoRA pushed as its LoRA alone)."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mola.adapters import pushed
    from mola.client import adapter_body

    model = load(str(tiny_model))[0]
    model.freeze()
    linear_to_lora_layers(model, 1, {"rank": 2, "scale": 3.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]},
                          use_dora=True)
    read = pushed.parse("d", adapter_body(model))
    (path, m), = read.weights.magnitudes.items()
    assert read.weights.kind == "dora" and path.endswith("self_attn.q_proj") and path in read.weights.modules
    q = dict(model.named_modules())[path]
    assert mx.array_equal(m, q.m).item()


def test_the_gguf_writer_refuses_a_dora_adapter(dora_dir, tmp_path):
    """llama.cpp has no DoRA: mola's GGUF writer (mola train's .gguf output,
    devtools/convert_mlx_lm_to_gguf.py) never writes a DoRA's LoRA alone."""
    from mola.adapters.formats import read_adapter
    from mola.adapters.formats.gguf_writer import save_gguf_adapter

    with pytest.raises(ValueError, match="is a DoRA adapter; llama.cpp's GGUF LoRA has no DoRA"):
        save_gguf_adapter(tmp_path / "d.gguf", read_adapter(dora_dir))
    assert not (tmp_path / "d.gguf").exists()
