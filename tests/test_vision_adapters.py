"""Adapters of a vision-language base (the formats' language_path): mlx-vlm's
trainer's files and PEFT's with Hugging Face's names of the VLM land on the
decoder mola lays out, and answer as mlx-vlm does with the adapter fused;
LoRA on the vision tower or its projector is refused at load, saying why.
Skipped without mlx-vlm, saying why (MOLA_REQUIRE_VISION=1: failed)."""

from __future__ import annotations

import pytest

from helpers.vision import require_mlx_vlm

require_mlx_vlm()  # skipped without mlx-vlm, saying why; failed where MOLA_REQUIRE_VISION=1 (CI)

import mlx.core as mx
from helpers.vision_models import make_tiny_qwen2_vl, make_vlm_adapter

from mola.adapters.formats import read_adapter
from mola.adapters.formats.common import language_path
from mola.adapters.weights import LoRAWeights, validate
from mola.errors import InvalidAdapter
from mola.testing.peft import save_peft_adapter


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2_vl_adapters")
    model = make_tiny_qwen2_vl(root / "model")
    return root, model, make_vlm_adapter(root / "a", model, seed=1)


def test_language_paths_of_mlx_vlm_and_hugging_face_land_on_the_decoder():
    assert language_path("language_model.model.layers.3.self_attn.q_proj", "f") == "model.layers.3.self_attn.q_proj"
    assert language_path("model.language_model.layers.3.mlp.up_proj", "f") == "model.layers.3.mlp.up_proj"
    assert language_path("model.text_model.layers.0.self_attn.o_proj", "f") == "model.layers.0.self_attn.o_proj"
    assert language_path("language_model.layers.1.mlp.up_proj", "f") == "model.layers.1.mlp.up_proj"  # Idefics3
    assert language_path("language_model.lm_head", "f") == "lm_head"
    assert language_path("model.layers.1.self_attn.q_proj", "f") == "model.layers.1.self_attn.q_proj"  # a text model's


@pytest.mark.parametrize("module", ["vision_tower.blocks.0.attn.qkv", "visual.blocks.0.attn.qkv",
                                    "model.visual.merger.mlp.0", "model.multi_modal_projector.linear_1",
                                    "model.connector.modality_projection.proj"])
def test_lora_on_the_vision_side_is_refused_naming_it(module):
    with pytest.raises(InvalidAdapter, match=f"'{module}'.*vision tower or its projector"):
        language_path(module, "adapter.safetensors")


def test_an_mlx_vlm_train_adapter_reads_onto_the_decoder(qwen2_vl):
    _, model, a = qwen2_vl
    weights = read_adapter(a)
    assert weights.modules and all(p.startswith("model.layers.") for p in weights.modules)
    raw = mx.load(str(a / "adapters.safetensors"))
    q = weights.modules["model.layers.0.self_attn.q_proj"]
    assert mx.array_equal(q.a, raw["language_model.model.layers.0.self_attn.q_proj.lora_a"])
    assert q.scale == 2.0  # its config's lora_parameters.scale (alpha / rank)


def test_an_mlx_vlm_adapter_on_the_vision_tower_is_refused_at_load(qwen2_vl):
    root, model, _ = qwen2_vl
    v = make_vlm_adapter(root / "v", model, vision_too=True)
    with pytest.raises(InvalidAdapter, match="vision_tower.blocks.0.attn.qkv.*language model only"):
        read_adapter(v)


def test_a_peft_adapter_by_hugging_face_names_reads_as_the_same_adapter(qwen2_vl, tmp_path):
    _, _, a = qwen2_vl
    mine = read_adapter(a)
    hf = {p.replace("model.layers.", "model.language_model.layers."): m for p, m in mine.modules.items()}
    peft = save_peft_adapter(tmp_path / "peft", LoRAWeights(source="hf", format="peft", modules=hf))
    theirs = read_adapter(peft)
    assert sorted(theirs.modules) == sorted(mine.modules)
    for p, m in mine.modules.items():
        assert mx.allclose(theirs.modules[p].a, m.a) and mx.allclose(theirs.modules[p].b, m.b)
        assert theirs.modules[p].scale == pytest.approx(m.scale)


def test_a_peft_adapter_on_the_visual_tower_is_refused(qwen2_vl, tmp_path):
    _, _, a = qwen2_vl
    mine = read_adapter(a)
    one = next(iter(mine.modules.values()))
    peft = save_peft_adapter(tmp_path / "peft", LoRAWeights(source="hf", format="peft",
                                                            modules={"visual.blocks.0.attn.proj": one}))
    with pytest.raises(InvalidAdapter, match="visual.blocks.0.attn.proj"):
        read_adapter(peft)


def test_mola_validate_checks_a_vlm_adapter_against_its_base(qwen2_vl, tmp_path):
    from mola.validate import validate

    root, model, a = qwen2_vl
    report = validate(str(a), str(model))
    assert report.ok and report.model.num_layers == 2 and report.model.model_type == "qwen2_vl"
    text = tmp_path / "text"
    from mola.testing.model import TinyModelSpec, make_tiny_model

    make_tiny_model(text, TinyModelSpec(hidden_size=32))  # another width: a's factors do not fit it
    assert not validate(str(a), str(text)).ok
    refused = validate(str(make_vlm_adapter(root / "v2", model, vision_too=True)), str(model))
    assert not refused.ok


def test_a_family_mola_does_not_serve_is_refused_at_start_naming_it(tmp_path):
    import json

    from mola.errors import ModelLoadError
    from mola.models.loader import load_base_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    (tmp_path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="'llava' vision model, which mola does not serve.*qwen2_vl"):
        load_base_model(str(tmp_path))


def test_without_mlx_vlm_a_vision_directory_serves_its_language_model_alone(qwen2_vl, monkeypatch):
    import importlib.util

    from mola.models.loader import load_base_model

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlx_vlm" else find(name, *a))
    loaded = load_base_model(str(qwen2_vl[1]))
    assert not loaded.takes_images and type(loaded.model).__module__ == "mlx_lm.models.qwen2_vl"
    monkeypatch.undo()
    assert load_base_model(str(qwen2_vl[1])).takes_images  # with it: mlx-vlm's model, images taken
