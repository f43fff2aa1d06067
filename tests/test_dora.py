"""DoRA in the engine's mixed batch (issue 45, part 1): an adapter written by
mlx-lm's own DoRALinear answers as mlx-lm itself, loaded with
``load(adapter_path=)``, answers: alone, and in one batch with plain LoRA,
activated LoRA and base rows; on a bias-free base, a base with biases (qwen2)
and a quantized base. Each row is checked token by token against its
reference fed the row's own tokens (teacher forcing): the token mola chose is
within a small margin of the reference's best, and mola's log-probability of
it is the reference's, within float tolerance."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from helpers.engines import EngineRunner, together
from mola.testing.adapter import make_mlx_lm_lora
from mola.testing.model import TinyModelSpec, make_tiny_model

MAX_TOKENS = 8
TOL = 2e-3  # log-probabilities, float32 models


def reference_logprobs(base, adapted, tokens: list[int], start: int, num_prompt: int) -> list[mx.array]:
    """Log-softmax after each of ``tokens`` from the last prompt token on,
    fed one at a time into one cache: position p through ``adapted`` if
    p >= start, else through ``base`` (an activated LoRA's reference; start 0:
    ``adapted`` throughout)."""
    cache = make_prompt_cache(base)
    out = []
    for p, token in enumerate(tokens[:-1]):
        logits = (adapted if p >= start else base)(mx.array([[token]]), cache=cache)[0, -1]
        if p >= num_prompt - 1:
            out.append(logits - mx.logsumexp(logits))
    return out


def check_row(output: list[int], logprobs, reference: list[mx.array]) -> None:
    """mola's tokens are the reference's best within TOL, and its log-probabilities the reference's."""
    assert len(output) == len(reference) == MAX_TOKENS
    for token, (lp, _), ref in zip(output, logprobs, reference):
        assert float(ref.max()) - float(ref[token]) <= TOL, (token, int(ref.argmax()))
        assert abs(lp - float(ref[token])) <= TOL, (lp, float(ref[token]))


def _model(tmp_path_factory, **spec):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "dora", TinyModelSpec(**spec))


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-q4"])
def base_dir(request, tmp_path_factory):
    if request.param == "llama-q4":
        return _model(tmp_path_factory, quantize_bits=4, quantize_group_size=32)
    return _model(tmp_path_factory, model_type=request.param)


@pytest.fixture(scope="module")
def trio(base_dir, tmp_path_factory):
    """A DoRA and a plain LoRA adapter written by mlx-lm's tuner, and an activated LoRA (the LoRA invoked)."""
    root = tmp_path_factory.mktemp("dora-adapters")
    dora = make_mlx_lm_lora(root / "dora", base_dir, rank=8, scale=2.0, seed=1, fine_tune_type="dora")
    lora = make_mlx_lm_lora(root / "lora", base_dir, rank=4, scale=2.0, seed=2)
    return dora, lora


def test_dora_rows_match_mlx_lm_alone_and_beside_lora_alora_and_base_rows(base_dir, trio):
    from mlx_lm import load

    dora, lora = trio
    base = load(str(base_dir))[0]
    dora_model = load(str(base_dir), adapter_path=str(dora))[0]
    lora_model = load(str(base_dir), adapter_path=str(lora))[0]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (21, 9, 30, 14, 17)]
    r = EngineRunner(base_dir, adapters=[("d", dora), ("l", lora)], max_tokens=MAX_TOKENS)
    lp = {"logprobs": 1}
    try:
        alone = r.submit(prompts[0], "d", **lp)
        r.wait([alone])
        rows = [(0, "d", None), (1, "l", None), (2, "l", 11), (3, None, None), (4, "d", None)]
        seqs = together(r, lambda: [r.submit(prompts[i], a, adapter_start=s, **lp) for i, a, s in rows])
        r.wait(seqs)
    finally:
        r.stop()
    models = {"d": dora_model, "l": lora_model, None: base}
    check_row(alone.output, r.logprobs[alone.seq_id],
              reference_logprobs(base, dora_model, prompts[0] + alone.output, 0, len(prompts[0])))
    for seq, (i, a, start) in zip(seqs, rows):
        tokens = prompts[i] + seq.output
        check_row(seq.output, r.logprobs[seq.seq_id],
                  reference_logprobs(base, models[a], tokens, start or 0, len(prompts[i])))
    # the magnitudes matter: the DoRA model is neither the base nor its LoRA alone
    prompt = mx.array([prompts[0]])
    plain = load(str(base_dir), adapter_path=str(lora))[0]
    assert float(mx.abs(dora_model(prompt) - base(prompt)).max()) > 0.1
    assert float(mx.abs(dora_model(prompt) - plain(prompt)).max()) > 0.1


# ---- PEFT's use_dora, against the formula merged with numpy ------------------------------------


def numpy_merged(base_dir, weights):
    """mlx-lm's base with each DoRA module merged by numpy (float64):
    W' = m / ||W + s (A B)^T|| (row-wise) * (W + s (A B)^T); biases unchanged."""
    import numpy as np
    from mlx_lm import load

    model = load(str(base_dir))[0]
    modules = dict(model.named_modules())
    for path, mod in weights.modules.items():
        lin = modules[path]
        w = np.array(lin.weight, dtype=np.float64) + mod.scale * (np.array(mod.a, np.float64) @ np.array(mod.b)).T
        g = np.array(weights.magnitudes[path], np.float64) / np.linalg.norm(w, axis=1)
        lin.weight = mx.array((g[:, None] * w).astype(np.float32))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def peft_dora(tiny_model, tmp_path_factory):
    """A PEFT use_dora adapter written by the project's PEFT writer: random
    factors (alpha / r = 1.5) and magnitudes, and the weights it was written from."""
    import dataclasses

    import numpy as np

    from mola.adapters.weights import LoRAWeights
    from mola.testing.adapter import random_lora
    from mola.testing.model import TinyModelSpec
    from mola.testing.peft import save_peft_adapter

    weights = random_lora(tiny_model, rank=4, scale=1.5, seed=11, num_layers=1)
    rng = np.random.default_rng(12)
    spec = TinyModelSpec()
    magnitudes = {p: mx.array(rng.uniform(2.0, 9.0, m.b.shape[1]).astype(np.float32)) for p, m in weights.modules.items()}
    assert spec.num_hidden_layers > 1  # the first block has no DoRA: its layers take the base path
    weights = dataclasses.replace(weights, magnitudes=magnitudes)
    assert isinstance(weights, LoRAWeights) and weights.kind == "dora"
    return save_peft_adapter(tmp_path_factory.mktemp("peft") / "dora", weights), weights


def test_a_peft_dora_adapter_is_the_formula_merged_into_the_weights(tiny_model, peft_dora):
    path, weights = peft_dora
    reference = numpy_merged(tiny_model, weights)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (19, 26)]
    r = EngineRunner(tiny_model, adapters=[("p", path)], max_tokens=MAX_TOKENS)
    try:
        assert r.read(path).kind == "dora" and r.read(path).format == "peft"
        seqs = together(r, lambda: [r.submit(prompts[0], "p", logprobs=1), r.submit(prompts[1], logprobs=1)])
        r.wait(seqs)
    finally:
        r.stop()
    check_row(seqs[0].output, r.logprobs[seqs[0].seq_id],
              reference_logprobs(reference, reference, prompts[0] + seqs[0].output, 0, len(prompts[0])))
    from mlx_lm import load

    x = mx.array([prompts[0]])
    assert float(mx.abs(reference(x) - load(str(tiny_model))[0](x)).max()) > 0.1  # the adapter matters


# ---- refusals, each naming its problem ---------------------------------------------------------


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


def test_models_list_each_adapter_kind(client):
    adapters = [c for c in client.get("/v1/models").json()["data"] if c["parent"] is not None]
    assert adapters and all("kind" in c for c in adapters)
    assert {c["kind"] for c in adapters} <= {"lora", "alora", "dora", None}


# ---- mola train --fine-tune-type dora ----------------------------------------------------------


def test_mola_train_writes_a_dora_adapter_that_mola_serves_as_mlx_lm_does(tiny_model, tmp_path):
    import json

    from mlx_lm import load

    from mola.cli import build_parser, train_config_from_args
    from mola.train import train_adapter

    data = tmp_path / "data"
    data.mkdir()
    lines = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "yes"}]}
             for q in ("hi", "what now?", "tell me", "go on")]
    (data / "train.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "dora"
    args = build_parser().parse_args(["train", "--model", str(tiny_model), "--data", str(data), "--out", str(out),
                                      "--fine-tune-type", "dora", "--iters", "6", "--batch-size", "2",
                                      "--learning-rate", "1e-2", "--rank", "4"])
    config = train_config_from_args(args)
    assert config.fine_tune_type == "dora"
    train_adapter(config, log=lambda line: None)
    assert json.loads((out / "adapter_config.json").read_text())["fine_tune_type"] == "dora"
    tensors = mx.load(str(out / "adapters.safetensors"))
    assert any(k.endswith(".m") for k in tensors)
    base = load(str(tiny_model))[0]
    reference = load(str(tiny_model), adapter_path=str(out))[0]
    prompt = [5, 77, 301, 12, 9, 44, 250]
    r = EngineRunner(tiny_model, adapters=[("t", out)], max_tokens=MAX_TOKENS)
    try:
        assert r.read(out).kind == "dora"
        seq = r.submit(prompt, "t", logprobs=1)
        r.wait([seq])
    finally:
        r.stop()
    check_row(seq.output, r.logprobs[seq.seq_id], reference_logprobs(base, reference, prompt + seq.output, 0, len(prompt)))


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
