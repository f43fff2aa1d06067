"""`mola validate` (mola/validate/): what an adapter is, in each format, and
whether a base takes it, checked offline with mola serve's readers and
checks; its messages are the ones a live server answers for the same
adapter, and the base's weights are never read."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import threading

import httpx
import mlx.core as mx
import pytest

from mola.cli import main
from mola.models.gguf_load import WRITER_THREAD
from mola.models.loader import load_base_model
from mola.adapters.formats import read_adapter
from mola.lora.pack import AdapterPacks, geometry_of
from mola.models.metadata import read_model_config
from mola.testing.adapter import make_random_adapter
from mola.adapters.formats.gguf_writer import save_gguf_adapter
from mola.testing.model import TinyModelSpec, make_tiny_model
from mola.testing.peft import save_peft_adapter
from mola.validate import describe, model_shape, validate

from conftest import ADAPTER_SPECS
from helpers.scripted import InProcessServer


def mola_validate(*args):
    """`mola validate ARGS` through the command line's own entry point
    (mola.cli.main) in this process, offline: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["validate", *map(str, args)])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def twins(adapters, tiny_model, tmp_path_factory):
    """Adapter b (rank 8 on q_proj and down_proj of the last layer, scale 2)
    as mlx-lm, PEFT and GGUF."""
    root = tmp_path_factory.mktemp("twins")
    weights = read_adapter(adapters["b"])
    config = read_model_config(tiny_model)
    peft = save_peft_adapter(root / "peft", weights, base_model_name_or_path="mola-test/tiny")
    gguf = save_gguf_adapter(root / "b.gguf", weights, n_head=config["num_attention_heads"],
                             n_kv_head=config["num_key_value_heads"], base_model="mola-test/tiny")
    return {"mlx-lm": adapters["b"], "peft": peft, "gguf": gguf}


@pytest.mark.parametrize("kind", ["mlx-lm", "peft", "gguf"])
def test_describe_each_format(twins, kind):
    spec = ADAPTER_SPECS["b"]
    info = describe(twins[kind])
    assert info.format == kind and info.ranks == [spec["rank"]] and info.rank == 8
    assert info.targets == sorted(spec["keys"]) and info.layers == [1]  # the last of two blocks
    assert info.scales == [2.0] and info.modules == 2
    files = [twins[kind]] if kind == "gguf" else list(twins[kind].iterdir())
    assert info.size_bytes == sum(f.stat().st_size for f in files if f.suffix in (".json", ".safetensors", ".gguf"))
    weights = read_adapter(twins["mlx-lm"])
    assert info.parameters == sum(m.a.size + m.b.size for m in weights.modules.values())
    if kind == "gguf":
        assert info.alpha == 16.0 and info.architecture == "llama" and info.dtypes == ["F32"]
        assert info.base == "mola-test/tiny"
    elif kind == "peft":
        assert info.alpha == 16 and info.base == "mola-test/tiny" and info.dtypes == ["float32"]
    else:
        assert info.alpha is None and info.dtypes == ["float32"]


def test_the_command_against_the_model(twins, tiny_model):
    code, out, err = mola_validate(twins["gguf"], "--model", tiny_model)
    assert code == 0, err
    assert "(gguf, llama)" in out and "targets  mlp.down_proj, self_attn.q_proj" in out
    assert "ok       the adapter would load on this model" in out and "llama, 2 layers, 14 linears + model.embed_tokens and lm_head" in out
    for kind, path in twins.items():
        report = validate(str(path), str(tiny_model))
        assert report.ok and report.info.format == kind and report.model.num_layers == 2, kind
    code, out, _ = mola_validate(twins["gguf"], "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["model"] is None
    assert report["info"]["rank"] == 8 and report["info"]["layers"] == [1] and report["info"]["format"] == "gguf"


def test_an_adapter_on_the_embedding_and_the_head_reports_its_parts(tiny_model, tmp_path):
    """Embedding LoRA and trainable tokens (mola/adapters/vocab.py): the parts in
    the text and the JSON, with and without a base; tokens beyond the base's
    vocabulary refused with serve's message."""
    from mola.adapters.weights import ModuleLoRA
    from mola.testing.peft_vocab import save_peft_vocab_adapter

    emb = ModuleLoRA(mx.zeros((512, 4)), mx.ones((4, 64)), 1.0)
    path = save_peft_vocab_adapter(tmp_path / "v", embedding=emb,
                                   tokens={"model.embed_tokens": ([7, 9, 11], mx.ones((3, 64)))})
    code, out, err = mola_validate(path)  # described: what its files hold
    assert code == 0 and "vocab    embedding LoRA rank 4, 3 embedding rows replaced (trainable tokens)" in out
    code, out, err = mola_validate(path, "--model", tiny_model)  # checked as serve checks it
    assert code == 1 and "both LoRA and trainable tokens on model.embed_tokens" in err
    path = save_peft_vocab_adapter(tmp_path / "t", tokens={"model.embed_tokens": ([7, 9, 11], mx.ones((3, 64)))})
    code, out, err = mola_validate(path, "--model", tiny_model)
    assert code == 0, err
    assert "vocab    3 embedding rows replaced (trainable tokens) (tied to a tied head)" in out
    report = validate(str(path), str(tiny_model)).to_json()
    assert report["info"]["vocab"] == {"embedding_lora_rank": 0, "head_lora_rank": 0, "embedding_tokens": 3,
                                       "head_tokens": 0, "tied": True}
    assert report["model"]["vocab_targets"] == ["model.embed_tokens", "lm_head"] and not report["model"]["tied_head"]
    code, out, _ = mola_validate(save_peft_vocab_adapter(tmp_path / "e", embedding=emb), "--json")
    assert code == 0 and json.loads(out)["info"]["vocab"]["embedding_lora_rank"] == 4
    beyond = save_peft_vocab_adapter(tmp_path / "b", tokens={"model.embed_tokens": ([3, 700], mx.ones((2, 64)))})
    code, _, err = mola_validate(beyond, "--model", tiny_model)
    assert code == 1 and "trains tokens [700]" in err and "vocabulary of 512" in err


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "wide", TinyModelSpec(hidden_size=96, num_hidden_layers=3))


def test_messages_are_the_ones_serve_gives(server, twins, adapters, other_model, tmp_path):
    """Each bad case through POST /v1/adapters on a live server and through
    mola validate: the same message, exit status 1."""
    wrong_shape = make_random_adapter(tmp_path / "wrong", other_model, rank=4, seed=5)
    deep = make_random_adapter(tmp_path / "deep", other_model, rank=4, num_layers=3, keys=("mlp.up_proj",), seed=6)
    dora = shutil.copytree(adapters["a"], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    qwen = save_gguf_adapter(tmp_path / "qwen.gguf", read_adapter(adapters["a"]), architecture="qwen2")
    for i, bad in enumerate((wrong_shape, deep, dora, qwen)):
        r = httpx.post(server.url + "/v1/adapters", json={"name": f"bad-{i}", "path": str(bad)}, timeout=60)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert validate(str(bad), server.config.model, max_rank=16).error == message
        if i == 0:  # as a person runs it
            code, out, err = mola_validate(bad, "--model", server.config.model, "--max-lora-rank", "16")
            assert code == 1 and f"[mola] error: {message}" in err, (bad, err)
    error = validate(str(adapters["c"]), server.config.model, max_rank=8).error
    assert "rank 16" in error and "--max-lora-rank 8" in error
    assert "DoRA" in validate(str(dora)).error  # refused by its reader, with no model at all
    assert "does not exist" in validate(str(tmp_path / "nowhere")).error


def test_the_architecture_is_checked(tiny_model, adapters, tmp_path):
    odd = shutil.copytree(tiny_model, tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    report = validate(str(adapters["a"]), str(odd))
    assert not report.ok and "no_such_arch" in report.error and "not supported" in report.error


@pytest.mark.parametrize("quantized", [False, True])
def test_offline_geometry_is_what_serve_wraps(tiny_model, quantized_model, quantized):
    """The lazily built model offers exactly the targets, shapes (packed
    quantized ones unpacked) and dtype that AdapterPacks.install gives the
    loaded one."""
    path = quantized_model if quantized else tiny_model
    offline = model_shape(str(path), max_rank=16).geometry
    loaded = load_base_model(str(path))
    assert geometry_of(loaded.model, 16, 2) == offline  # the function install's targets come from
    packs = AdapterPacks.install(loaded.model, max_loras=1, max_rank=16)
    assert offline.targets == packs.geometry.targets and offline.dtype == packs.geometry.dtype


def test_the_base_weights_are_never_read(tmp_path):
    """A 25 MB float32 model: describing its targets allocates nothing."""
    model = make_tiny_model(tmp_path / "big", TinyModelSpec(hidden_size=512, intermediate_size=1536))
    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    shape = model_shape(str(model), max_rank=64)
    assert len(shape.geometry.targets) == 16 and shape.geometry.dims["model.layers.0.mlp.up_proj"] == (512, 1536)
    assert mx.get_active_memory() - before < 1 << 20


# ---- a GGUF base ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory):
    from mola.testing.gguf_model import save_gguf_model

    return save_gguf_model(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf", tiny_model, codec="Q4_1")


@pytest.mark.parametrize("dtype", ["keep", "float32", "float16"])
def test_offline_geometry_of_a_gguf_file(tiny_gguf, dtype):
    """From the metadata and tensor infos alone: what the loaded file gives."""
    offline = model_shape(str(tiny_gguf), max_rank=16, dtype=dtype)
    loaded = load_base_model(str(tiny_gguf), dtype=dtype)
    packs = AdapterPacks.install(loaded.model, max_loras=1, max_rank=16)
    assert offline.geometry.targets == packs.geometry.targets
    assert offline.geometry.dtype == packs.geometry.dtype
    for key in ("model_type", "num_attention_heads", "num_key_value_heads", "hidden_size"):
        assert offline.config[key] == loaded.config[key]


def test_the_conversion_a_gguf_file_gets_at_load(tiny_gguf, twins, tmp_path, monkeypatch):
    """Whether mola serve will read the file from the conversion cache or convert it."""
    monkeypatch.setenv("MOLA_GGUF_CACHE", str(tmp_path / "cache"))
    assert model_shape(str(tiny_gguf), max_rank=16, dtype="keep").conversion.startswith("not cached: converted")
    load_base_model(str(tiny_gguf), dtype="keep")
    for thread in threading.enumerate():  # the entry is written after the load
        if thread.name == WRITER_THREAD:
            thread.join()
    assert model_shape(str(tiny_gguf), max_rank=16, dtype="keep").conversion.startswith("cached (")
    assert model_shape(str(tiny_gguf), max_rank=16, dtype="float32").conversion.startswith("not cached")
    code, out, _ = mola_validate(twins["gguf"], "--model", tiny_gguf, "--dtype", "keep")
    assert code == 0 and "convert  cached (" in out
    monkeypatch.setenv("MOLA_GGUF_CACHE", "off")
    assert "cache is off" in model_shape(str(tiny_gguf), max_rank=16, dtype="keep").conversion


def test_adapters_against_a_gguf_file(tiny_gguf, twins, other_model, tmp_path):
    for kind, path in twins.items():
        assert validate(str(path), str(tiny_gguf)).ok, kind
    wrong = make_random_adapter(tmp_path / "wrong", other_model, rank=4, seed=5)
    error = validate(str(wrong), str(tiny_gguf)).error
    # The live server's answer: the app in process over the GGUF file as mola serve loads it.
    server = InProcessServer(load_base_model(str(tiny_gguf)), max_loras=1, max_lora_rank=64,
                             allow_any_adapter_path=True)
    try:
        with server.client(timeout=60) as c:
            r = c.post("/v1/adapters", json={"name": "wrong", "path": str(wrong)})
        assert r.status_code == 400 and r.json()["error"]["message"] == error
    finally:
        server.stop()


def test_against_the_real_model(smollm_gguf, adapters, tmp_path):
    """SmolLM2-135M-Instruct Q4_1, opened once (gguf-py takes seconds to read
    its header): a LoRA of the shapes its metadata give would load (as a GGUF
    LoRA, q/k rows in llama.cpp's order), one of the tiny model's would not;
    its 98 MB of weights are not read. (validate() runs exactly these steps.)"""
    from mola.errors import InvalidAdapter
    from mola.adapters.recipe import read_checked
    from mola.adapters.weights import LoRAWeights, ModuleLoRA

    mx.eval(mx.zeros(1))
    before = mx.get_active_memory()
    shape = model_shape(str(smollm_gguf), max_rank=64)
    assert mx.get_active_memory() - before < 1 << 20
    assert shape.num_layers == 30 and len(shape.geometry.targets) == 212  # 7 a block, the embedding, the head
    assert shape.geometry.dims["model.layers.29.self_attn.k_proj"] == (576, 192)
    modules = {p: ModuleLoRA(a=mx.random.normal((d[0], 4)) * 0.01, b=mx.random.normal((4, d[1])) * 0.01, scale=2.0)
               for p, d in shape.geometry.dims.items() if p.startswith("model.layers.29.")}
    lora = save_gguf_adapter(tmp_path / "smol.gguf", LoRAWeights("random", "mlx-lm", modules),
                             n_head=shape.config["num_attention_heads"],
                             n_kv_head=shape.config["num_key_value_heads"])
    assert describe(lora).layers == [29] and len(describe(lora).targets) == 7
    read_checked(str(lora), shape.geometry, shape.config)
    with pytest.raises(InvalidAdapter, match="do not fit the base model"):
        read_checked(str(adapters["a"]), shape.geometry, shape.config)  # the tiny model's


def test_moe_adapters_report_their_experts_and_expert_rank(tmp_path):
    from mola.testing.adapter import make_mlx_lm_lora

    model = make_tiny_model(tmp_path / "moe", TinyModelSpec(model_type="qwen3_moe", num_experts=4))
    adapter = make_mlx_lm_lora(tmp_path / "ad", model, rank=4, seed=1)
    code, out, err = mola_validate(adapter, "--model", model, "--json")
    assert code == 0, err
    report = json.loads(out)
    info, shape = report["info"], report["model"]
    assert info["num_experts"] == 4 and info["expert_modules"] == 6  # 2 layers x gate, up, down
    assert info["expert_targets"] == ["mlp.switch_mlp.down_proj", "mlp.switch_mlp.gate_proj",
                                      "mlp.switch_mlp.up_proj"]
    assert (shape["num_experts"], shape["expert_targets"]) == (4, 6)
    code, out, err = mola_validate(adapter, "--model", model, "--max-expert-lora-rank", 2)
    assert code == 1 and "--max-expert-lora-rank 2" in err
    assert "experts  mlp.switch_mlp.down_proj" in out and "4 experts each" in out
