"""`mola train` (mola/train.py, the `train` subcommand of mola/cli.py): data
and output checks before any model loads, then real short training runs whose
adapters change the served answers toward the data and load in mlx-lm, over
POST /v1/adapters and through --serve-url."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

import mola.models.loader
from mola.config import AdapterSpec
from mola.train import DataError, OutputPathError, TrainConfig, TrainError, check_data, check_output, hot_load, train_adapter

from helpers.references import greedy_tokens
from helpers.servers import free_port, start_server

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write(folder: Path, name: str, lines: list) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    (folder / name).write_text(text + ("\n" if lines else ""))
    return folder


def mola_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mola", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def served_answers(model, adapters: dict, prompts: list, max_tokens: int, **settings) -> dict[str, list[tuple]]:
    """Greedy /v1/completions answers, (text, tokens), of the base model (as
    "base") and of each of ``adapters`` (name -> path) to each prompt (text or
    token ids), from a server of ``model`` started for them."""
    handle = start_server(model=str(model), served_model_name="base", max_loras=2, max_lora_rank=8,
                          adapters=tuple(AdapterSpec(n, str(p)) for n, p in adapters.items()), **settings)
    try:
        def answer(name, prompt):
            r = httpx.post(handle.url + "/v1/completions", timeout=60, json={
                "model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"], choice["logprobs"]["tokens"]
        return {name: [answer(name, p) for p in prompts] for name in ("base", *adapters)}
    finally:
        handle.stop()


# ---- data checks ----------------------------------------------------------------


@pytest.mark.parametrize(
    "lines, problem",
    [
        ([CHAT, "{not json", CHAT], "train.jsonl:2: not valid JSON"),
        ([CHAT, [1, 2], CHAT], "train.jsonl:2: expected a JSON object, got list"),
        ([CHAT, {"prompt": "x"}], "train.jsonl:2: the completions format needs 'prompt' and 'completion'; "
                                   "missing 'completion'"),
        ([{"input": "x", "output": "y"}], "train.jsonl:1: no data keys"),
        ([CHAT, {"text": "a", "label": 1}], "train.jsonl:2: unknown key(s) 'label' for the text format"),
        ([{"text": "a"}, CHAT], "train.jsonl:2: this example is in the chat format but line 1 is in the "
                                "text format"),
        ([{"messages": [{"role": "robot", "content": "x"}]}], "train.jsonl:1: messages[0] has role 'robot'"),
        ([{"messages": [{"role": "user", "content": "x"}]}], "train.jsonl:1: the conversation has no "
                                                             "assistant message"),
        ([{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}],
         "messages[0] (role user) needs a string \"content\""),
        ([{"prompt": "x", "completion": ""}], "\"completion\" is empty"),
        ([{"text": ""}], "\"text\" must be a non-empty string"),
        ([], "train.jsonl is empty"),
    ],
)
def test_bad_data_is_refused_naming_file_line_and_problem(tmp_path, lines, problem):
    data = write(tmp_path / "data", "train.jsonl", lines)
    with pytest.raises(DataError) as e:
        check_data(data, batch_size=1)
    assert problem in e.value.message
    assert str(data / "train.jsonl") in e.value.message


def test_valid_file_and_folder_problems(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        check_data(tmp_path / "missing")
    (tmp_path / "file.jsonl").write_text(json.dumps(CHAT))
    with pytest.raises(DataError, match="is not a directory"):
        check_data(tmp_path / "file.jsonl")
    with pytest.raises(DataError, match="has no train.jsonl"):
        check_data(tmp_path)
    data = write(tmp_path / "d", "train.jsonl", [CHAT] * 4)
    write(data, "valid.jsonl", [CHAT, "oops"])
    with pytest.raises(DataError, match=r"valid\.jsonl:2: not valid JSON"):
        check_data(data, batch_size=1)
    write(data, "valid.jsonl", [CHAT] * 2)
    with pytest.raises(DataError, match=r"valid\.jsonl has 2 example\(s\); a batch size of 4"):
        check_data(data, batch_size=4)
    ok = check_data(data, batch_size=2)  # blank lines are skipped, formats reported
    assert ok.format == "chat" and len(ok.train.examples) == 4 and len(ok.valid.examples) == 2
    write(data, "train.jsonl", [{"prompt": "a", "completion": "b"}, "", {"prompt": "c", "completion": "d"}])
    assert check_data(data, batch_size=2).format == "completions"


def test_output_path_checks(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(OutputPathError, match="is a file"):
        check_output(tmp_path / "a-file")
    with pytest.raises(OutputPathError, match="is not a directory"):
        check_output(tmp_path / "a-file" / "adapter")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    with pytest.raises(OutputPathError, match="not empty; choose another --out or pass --force"):
        check_output(full)
    check_output(full, force=True)
    with pytest.raises(OutputPathError, match="refusing to replace"):
        check_output(full, force=True, protect=(full / "data",))
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty")
    check_output(tmp_path / "new" / "deeper")


def test_settings_are_checked():
    for bad in (dict(rank=0), dict(iters=0), dict(batch_size=0), dict(learning_rate=-1.0), dict(layers=0),
                dict(dropout=1.0), dict(targets=("q_proj", "")), dict(serve_url="localhost:8000"),
                dict(warmup=5, iters=5), dict(lr_schedule="linear"), dict(grad_clip=0.0)):
        with pytest.raises(ValueError):
            TrainConfig(model="m", data=Path("d"), out=Path("o"), **bad)


def test_checks_come_before_the_model_loads(tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mola.models.loader, "load_base_model", no_load)
    bad = write(tmp_path / "bad", "train.jsonl", [CHAT, "{"])
    good = write(tmp_path / "good", "train.jsonl", [CHAT] * 4)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("x")
    with pytest.raises(DataError):
        train_adapter(TrainConfig(model="org/model", data=bad, out=tmp_path / "out"))
    with pytest.raises(OutputPathError):
        train_adapter(TrainConfig(model="org/model", data=good, out=tmp_path / "taken"))
    with pytest.raises(TrainError, match="model path does not exist"):
        train_adapter(TrainConfig(model=str(tmp_path / "no-model"), data=good, out=tmp_path / "out"))


def test_cli_reports_problems(tmp_path):
    bad = write(tmp_path / "bad", "train.jsonl", [CHAT, {"prompt": "x"}])
    r = mola_cli("train", "--model", "org/never-loaded", "--data", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 1 and "train.jsonl:2" in r.stderr and "missing 'completion'" in r.stderr
    assert "loading" not in r.stderr
    r = mola_cli("train", "--model", "m", "--data", str(bad), "--out", str(tmp_path / "o"), "--rank", "0")
    assert r.returncode == 2 and "rank must be" in r.stderr
    r = mola_cli("train", "--help")
    assert r.returncode == 0 and "--serve-url" in r.stdout


# ---- real training -------------------------------------------------------------

TARGET = "yes"  # two tokens ('y', 'es'), then <|im_end|>
# A recipe the tiny random model learns with a wide margin whatever the BLAS
# and thread count: mlx-lm's default LoRA scale (20) with a constant 1e-2 rate
# oscillated (final losses 0.2-1.1, first-token probability 0.2-0.7 across
# BLAS builds); scale 2 with a cosine-decayed 3e-3 reaches a loss of ~0.003
# and >= 0.99 on every target token, with OpenBLAS, the reference BLAS, one
# thread or two, and seeds 0-2 alike.
RECIPE = ["--iters", "200", "--batch-size", "4", "--learning-rate", "3e-3", "--scale", "2",
          "--lr-schedule", "cosine", "--warmup", "20", "--rank", "8"]
MIN_TARGET_PROB = 0.9  # the margin the adapter must learn every target token with
PROMPTS = ["What is the answer?", "Tell me a thing.", "Hello there!", "Name a dessert.",
           "What do you like?", "Say something.", "Any ideas?", "Pick one."]


@pytest.fixture(scope="module")
def banana_data(tmp_path_factory):
    """Every prompt answered "yes"."""
    folder = tmp_path_factory.mktemp("banana")
    lines = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": TARGET}]}
             for p in PROMPTS]
    write(folder, "train.jsonl", lines)
    write(folder, "valid.jsonl", lines[:4])
    return folder


@pytest.fixture(scope="module")
def live(server):
    """A server for the tiny model that may load adapters from any path (the module's, conftest's)."""
    return server


def chat(url: str, model: str, content: str, max_tokens: int = 8) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def banana(tiny_model, banana_data, live, tmp_path_factory):
    """`mola train` run as a user runs it, hot-loading into the live server."""
    out = tmp_path_factory.mktemp("trained") / "banana"
    r = mola_cli("train", "--model", str(tiny_model), "--data", str(banana_data), "--out", str(out),
                 *RECIPE, "--mask-prompt", "--steps-per-report", "100", "--serve-url", live.url,
                 "--name", "banana")
    assert r.returncode == 0, r.stderr
    return out, r.stderr


def test_training_reports_progress_and_writes_an_mlx_lm_adapter(banana):
    out, log = banana
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapters.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["lora_parameters"]["rank"] == 8
    assert config["num_layers"] == 2  # the tiny model's two blocks
    assert "[mola] train [" in log and "200/200" in log and "loss" in log
    assert "valid" in log
    assert "now serves the adapter as model 'banana'" in log
    assert not list(out.parent.glob(".banana*"))  # no temporary directories left


def target_probabilities(model, tok, prompt: str) -> list[float]:
    """The probability of each token of TARGET (and the end of turn) after
    ``prompt``, by plain mlx-lm."""
    head = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    full = tok.apply_chat_template([{"role": "user", "content": prompt},
                                    {"role": "assistant", "content": TARGET}])
    assert full[:len(head)] == head
    target = full[len(head):len(head) + len(tok.encode(TARGET)) + 1]  # TARGET, <|im_end|>
    logits = model(mx.array(full)[None])[0]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [math.exp(logp[len(head) - 1 + i, t].item()) for i, t in enumerate(target)]


def test_the_adapter_moves_answers_toward_the_data(banana, tiny_model, live):
    """Served over --serve-url: the adapter answers "yes" where the
    base does not, having learnt every target token with a margin;
    mlx-lm with --adapter-path agrees token for token."""
    out, _ = banana
    from mlx_lm import load

    model, tok = load(str(tiny_model), adapter_path=str(out))
    for prompt in PROMPTS:
        probs = target_probabilities(model, tok, prompt)
        assert min(probs) >= MIN_TARGET_PROB, (prompt, probs)

    ids = [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]]
    assert "banana" in ids
    for prompt in PROMPTS[:3]:
        assert chat(live.url, "banana", prompt, max_tokens=12) == TARGET
        assert chat(live.url, "tiny", prompt, max_tokens=12) != TARGET

    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True)
    tokens = greedy_tokens(model, prompt, max_tokens=8)
    assert tok.decode(tokens).startswith(TARGET)


def test_the_adapter_loads_over_rest_and_names_clash(banana, live):
    out, _ = banana
    r = httpx.post(live.url + "/v1/adapters", json={"name": "banana-2", "path": str(out)}, timeout=60)
    assert r.status_code == 200, r.text
    assert chat(live.url, "banana-2", PROMPTS[1], max_tokens=12) == TARGET
    with pytest.raises(TrainError, match="HTTP 409"):
        hot_load(live.url, "banana-2", out)
    port = free_port()
    with pytest.raises(TrainError, match="could not be reached"):
        hot_load(f"http://127.0.0.1:{port}", "x", out, timeout=5)


def test_train_on_a_quantized_base(quantized_model, banana_data, tmp_path):
    out = tmp_path / "q-adapter"
    result = train_adapter(TrainConfig(model=str(quantized_model), data=banana_data, out=out, iters=5,
                                       batch_size=2, learning_rate=1e-3, targets=("q_proj", "v_proj"),
                                       steps_per_report=5), log=lambda line: None)
    assert result.train_loss is not None and result.trainable_parameters > 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["lora_parameters"]["keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
    keys = mx.load(str(out / "adapters.safetensors")).keys()
    assert keys and all(".q_proj." in k or ".v_proj." in k for k in keys)

    from mlx_lm import load

    load(str(quantized_model), adapter_path=str(out))
    (text, tokens), = served_answers(quantized_model, {"q-lora": out}, ["hi"], max_tokens=3)["q-lora"]
    assert len(tokens) == 3 and text == "".join(tokens)


def test_unknown_target_and_too_many_layers(tiny_model, banana_data, tmp_path):
    with pytest.raises(TrainError, match="--target nope: the model's blocks have no such linear layer"):
        train_adapter(TrainConfig(model=str(tiny_model), data=banana_data, out=tmp_path / "a",
                                  targets=("nope",)), log=lambda line: None)
    with pytest.raises(TrainError, match="--layers 5: the model has only 2 layers"):
        train_adapter(TrainConfig(model=str(tiny_model), data=banana_data, out=tmp_path / "b", layers=5),
                      log=lambda line: None)


def test_train_on_a_mixture_of_experts_trains_the_experts(banana_data, tmp_path):
    """The default targets include the experts (as mlx-lm's default keys do);
    mola serves the result as mlx-lm's own LoRASwitchLinear computes it."""
    from mlx_lm import load

    from mola.testing.model import TinyModelSpec, make_tiny_model

    model_dir = make_tiny_model(tmp_path / "moe", TinyModelSpec(model_type="qwen3_moe"))
    out = tmp_path / "moe-adapter"
    train_adapter(TrainConfig(model=str(model_dir), data=banana_data, out=out, iters=5, batch_size=2,
                              learning_rate=1e-2, steps_per_report=5), log=lambda line: None)
    saved = mx.load(str(out / "adapters.safetensors"))
    assert saved["model.layers.1.mlp.switch_mlp.up_proj.lora_a"].shape == (8, 8, 64)  # [E, r, in]
    assert "model.layers.1.mlp.gate.lora_a" in saved and "model.layers.1.self_attn.q_proj.lora_a" in saved
    model, tok = load(str(model_dir), adapter_path=str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True)
    from helpers.references import detokenize

    want = detokenize(tok, greedy_tokens(model, prompt, max_tokens=6), stop_at_eos=False)
    (text, _), = served_answers(model_dir, {"t": out}, [prompt], max_tokens=6, max_expert_lora_rank=8)["t"]
    assert text == want
