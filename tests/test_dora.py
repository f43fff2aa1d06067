"""DoRA served (issue 45, part 1): an adapter written by mlx-lm's own
DoRALinear answers as mlx-lm itself, loaded with ``load(adapter_path=)``,
answers: alone, and in one batch with plain LoRA, activated LoRA and base
rows; on a bias-free base, a base with biases (qwen2) and a quantized base. A
PEFT use_dora adapter answers as the formula merged into the weights with
numpy, and `mola train --fine-tune-type dora` writes one that mola serves as
mlx-lm does. Each row is checked token by token against its reference fed
the row's own tokens (teacher forcing): the token mola chose is within a
small margin of the reference's best, and mola's log-probability of it is the
reference's, within float tolerance (helpers.dora)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from helpers.dora import check_row as _check_row, numpy_merged, reference_logprobs, write_peft_dora
from helpers.engines import EngineRunner, together
from mola.testing.adapter import make_mlx_lm_lora
from mola.testing.model import TinyModelSpec, make_tiny_model

MAX_TOKENS = 8


def check_row(output, logprobs, reference) -> None:
    _check_row(output, logprobs, reference, MAX_TOKENS)


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


def test_dora_on_the_attention_of_a_mixture_of_experts_beside_an_expert_lora(tmp_path):
    """On a MoE base, a DoRA adapter on attention (mlx-lm's DoRALinear does not
    wrap expert SwitchLinears) shares a batch with an expert LoRA's rows."""
    from mlx_lm import load

    model = make_tiny_model(tmp_path / "moe", TinyModelSpec(model_type="qwen3_moe"))
    dora = make_mlx_lm_lora(tmp_path / "dora", model, rank=4, keys=("self_attn.q_proj", "self_attn.v_proj"),
                            seed=3, fine_tune_type="dora")
    experts = make_mlx_lm_lora(tmp_path / "experts", model, rank=4, seed=1)  # every linear, experts too
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (26, 19)]
    r = EngineRunner(model, max_tokens=MAX_TOKENS, max_loras=2, max_lora_rank=8, expert_slots=2, max_expert_rank=8)
    try:
        r.add("dora", r.read(dora))
        r.add("experts", r.read(experts))
        seqs = together(r, lambda: [r.submit(prompts[0], "dora", logprobs=1),
                                    r.submit(prompts[1], "experts", logprobs=1)])
        r.wait(seqs)
    finally:
        r.stop()
    base = load(str(model))[0]
    for seq, prompt, adapter in zip(seqs, prompts, (dora, experts)):
        reference = load(str(model), adapter_path=str(adapter))[0]
        check_row(seq.output, r.logprobs[seq.seq_id],
                  reference_logprobs(base, reference, prompt + seq.output, 0, len(prompt)))


def test_a_dora_adapter_loaded_at_another_scale_is_mlx_lm_at_that_scale(tiny_model, tmp_path):
    """POST /v1/adapters' "scale" (the slot's scale, here 0.5) is folded in
    before g is computed: the rows are mlx-lm's DoRALinear at scale 0.5 x its own."""
    import json
    import shutil

    from mlx_lm import load

    from mola.lora.pack import prepare_rows

    dora = make_mlx_lm_lora(tmp_path / "dora", tiny_model, rank=4, scale=3.0, seed=5, fine_tune_type="dora")
    half = shutil.copytree(dora, tmp_path / "half")
    config = json.loads((half / "adapter_config.json").read_text())
    config["lora_parameters"]["scale"] = 1.5
    (half / "adapter_config.json").write_text(json.dumps(config))
    prompt = [9, 41, 302, 17, 88, 5]
    r = EngineRunner(tiny_model, max_tokens=MAX_TOKENS)
    try:
        rows = prepare_rows(r.read(dora), r.engine.geometry, 0.5)  # as the loader prepares a slot_scale
        r.engine.call(lambda: r.engine.packs.fill(1, rows)).result()
        r.slots["d"], r.versions["d"] = 1, 1
        seq = r.submit(prompt, "d", logprobs=1)
        r.wait([seq])
    finally:
        r.stop()
    base = load(str(tiny_model))[0]
    check_row(seq.output, r.logprobs[seq.seq_id],
              reference_logprobs(base, load(str(tiny_model), adapter_path=str(half))[0], prompt + seq.output, 0,
                                 len(prompt)))


# ---- PEFT's use_dora, against the formula merged with numpy ------------------------------------


@pytest.fixture(scope="module")
def peft_dora(tiny_model, tmp_path_factory):
    return write_peft_dora(tmp_path_factory.mktemp("peft") / "dora", tiny_model)


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
    check_row(seq.output, r.logprobs[seq.seq_id],
              reference_logprobs(base, reference, prompt + seq.output, 0, len(prompt)))
