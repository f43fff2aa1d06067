"""`mola distill` (mola/distill/): the questions, the losses against numpy,
the batches; the refusals before any training; then short real runs on a
tiny random model (the held-out KL falls by half, checked with plain mlx-lm;
the adapter loads into and serves from a running mola; the config holds the
prompt's hash, not the prompt; Ctrl-C keeps the last finished step; a
server as teacher; another local teacher), and one on the real model."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

import mola.models.loader
from mola.distill import DistillConfig, DistillError, distill
from mola.distill import prompts as P
from mola.distill.data import Example, batch_arrays, make_iterate_batches
from mola.distill.loss import kl_loss, sft_loss
from mola.distill.run import _written_questions
from mola.testing.model import TinyModelSpec, make_tiny_model
from mola.train import TrainConfig

from helpers.references import merged_answer
from helpers.servers import start_server

SYSTEM = "You are Captain Zorblax of the starship Quuxelia. Speak of comets and nebulae in every answer."
WORDS = ["rain", "snow", "cats", "dogs", "the sea", "the sun", "stars", "bread", "tea", "music", "trees", "boats",
         "cars", "birds", "fish", "houses", "salt", "sugar", "clocks", "paper", "rivers", "lakes", "hills", "books"]
QUESTIONS = [t.format(w) for w in WORDS for t in ("What is {}?", "Tell me about {}.")]
# A recipe the tiny model (weight gain 1.5: a system prompt shifts its answers
# smoothly enough to be learnt) distils with a wide margin: the held-out KL
# falls to 0.20-0.22 of the base's over seeds 0-3 (scale 20, or a rate of
# 3e-3, overshoot).
RECIPE = dict(iters=40, batch_size=4, learning_rate=1e-3, scale=2.0)
MAX_TOKENS = 16


def mola_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mola", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ})


def make_config(model, out, system=SYSTEM, **kw) -> DistillConfig:
    recipe = {**RECIPE, **{k: kw.pop(k) for k in list(kw) if k in TrainConfig.__dataclass_fields__}}
    recipe.setdefault("steps_per_report", 10)
    return DistillConfig(recipe=TrainConfig(model=str(model), data=Path("."), out=out, **recipe), system=system,
                         **{"max_tokens": MAX_TOKENS, "held_out": 8, **kw})


@pytest.fixture(scope="module")
def student_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "gain15", TinyModelSpec(weight_gain=1.5))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "questions.txt"
    path.write_text("\n".join(QUESTIONS) + "\n")
    return path


@pytest.fixture(scope="module")
def live(student_model):
    handle = start_server(model=str(student_model), served_model_name="tiny", allow_any_adapter_path=True,
                          max_loras=2, max_lora_rank=16)
    yield handle
    handle.stop()


# ---- the questions ---------------------------------------------------------------


def test_prompts_are_read_deduplicated_and_split(tmp_path):
    text = tmp_path / "q.txt"
    text.write_text("What is rain?\n\n  what is   RAIN?\nWho are you?\n")
    assert P.dedupe(P.read_prompts(text)) == ["What is rain?", "Who are you?"]
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('"A?"\n{"prompt": "B?"}\n{"question": "C?"}\n'
                     '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "D?"}]}\n')
    assert P.read_prompts(jsonl) == ["A?", "B?", "C?", "D?"]
    jsonl.write_text('"A?"\n{"answer": "x"}\n')
    with pytest.raises(DistillError, match=r"q\.jsonl:2: expected a question"):
        P.read_prompts(jsonl)
    with pytest.raises(DistillError, match="does not exist"):
        P.read_prompts(tmp_path / "missing.txt")
    qs = [f"Question {i}?" for i in range(50)]
    split = P.split(qs, held_out=16, seed=0, where="f")
    assert len(split.held_out) == 10 and len(split.train) == 40  # at most a fifth held out
    assert sorted(split.train + split.held_out) == sorted(qs)
    assert P.split(qs, 16, 0, "f") == split and P.split(qs, 16, 1, "f") != split  # the seed fixes it


def test_questions_the_teacher_writes():
    assert P.clean_question("1. What is your name?\nMore text") == "What is your name?"
    assert P.clean_question('"Where is the Nautilus?"') == "Where is the Nautilus?"
    for bad in ("Tell me a story.", "Why?", "", "\n\n"):
        assert P.clean_question(bad) is None
    seeds = [f"topic {i}" for i in range(10)]
    texts = [[f"What about topic {i}, part {j}?" for j in range(3)] + ["What about topic 0, part 0?"]
             for i in range(10)]
    qs = P.written_questions(seeds, texts, held_out=16)
    # seeds 4 and 9 are held out; topic 0's first question, which they repeat, is never trained on
    assert {q.split(",")[0] for q in qs.held_out} == {"What about topic 4", "What about topic 9", "What about topic 0"}
    assert len(qs.held_out) == 7 and len(qs.train) == 8 * 3 - 1 and not set(qs.train) & set(qs.held_out)

    class Teacher:  # writes two questions per request, one repeated
        def texts(self, requests, **_):
            return [f"What is {r.split('about ')[1].split('.')[0]}?" for r in requests]

    config = make_config("m", Path("o"), num_questions=64, prompts=None)
    written = _written_questions(config, Teacher(), log=lambda line: None)
    assert len(written.train) == 26 and len(written.held_out) == 6  # one per seed: duplicates dropped


# ---- the losses, against numpy ------------------------------------------------------


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("k", [3, 10])
def test_kl_loss_is_the_coarsened_kl(k):
    """KL between the teacher's top-k + rest and the student's mass on the
    same tokens and rest, over the answer positions only; with k = V, the full KL."""
    rng = np.random.default_rng(0)
    B, L, V = 2, 7, 10
    batch = rng.integers(0, V, (B, L)).astype(np.int32)
    lengths = np.array([[2, 6], [4, 7]], np.int32)  # (offset, length)
    student = rng.normal(size=(B, L - 1, V)).astype(np.float32) * 2
    teacher = _log_softmax(rng.normal(size=(B, L - 1, V)) * 2)
    idx = np.argsort(-teacher, axis=-1)[..., :k].astype(np.int32)
    top = np.take_along_axis(teacher, idx, axis=-1).astype(np.float32)
    loss, ntoks = kl_loss(lambda x: mx.array(student), mx.array(batch), mx.array(lengths), mx.array(idx),
                          mx.array(top))
    s = _log_softmax(student.astype(np.float64))
    total, count = 0.0, 0
    for b, (offset, length) in enumerate(lengths):
        for t in range(offset - 1, length - 1):  # the positions predicting tokens offset..length-1
            p, q = np.exp(top[b, t]), np.exp(s[b, t, idx[b, t]])
            total += (p * (np.log(p) - np.log(q))).sum()
            rest_p, rest_q = max(1 - p.sum(), 1e-6), max(1 - q.sum(), 1e-6)
            total += rest_p * (np.log(rest_p) - np.log(rest_q))
            if k == V:
                assert abs(rest_p - 1e-6) < 1e-5
            count += 1
    assert int(ntoks) == count == 4 + 3
    assert float(loss) == pytest.approx(total / count, rel=1e-4, abs=1e-5)
    if k == V:
        full = sum((np.exp(teacher[b, t]) * (teacher[b, t] - s[b, t])).sum()
                   for b, (o, n) in enumerate(lengths) for t in range(o - 1, n - 1)) / count
        assert float(loss) == pytest.approx(full, rel=1e-3)


def test_sft_loss_is_the_answers_cross_entropy():
    rng = np.random.default_rng(1)
    batch = rng.integers(0, 8, (2, 6)).astype(np.int32)
    lengths = np.array([[3, 5], [1, 6]], np.int32)
    logits = rng.normal(size=(2, 5, 8)).astype(np.float32)
    loss, ntoks = sft_loss(lambda x: mx.array(logits), mx.array(batch), mx.array(lengths))
    s = _log_softmax(logits.astype(np.float64))
    ce = [-s[b, t, batch[b, t + 1]] for b, (o, n) in enumerate(lengths) for t in range(o - 1, n - 1)]
    assert int(ntoks) == len(ce) == 2 + 5
    assert float(loss) == pytest.approx(np.mean(ce), rel=1e-5)


def test_batches_place_the_teacher_at_the_answer_tokens():
    k = 2
    a = Example([5, 6, 7, 8, 9], 3, np.array([[1, 2], [3, 4]], np.int32), np.log(np.full((2, 2), 0.5, np.float32)))
    b = Example([5, 6, 7], 1, np.array([[7, 8], [9, 1]], np.int32), np.log(np.full((2, 2), 0.25, np.float32)))
    tokens, lengths, idx, logp = (np.array(x) for x in batch_arrays([a, b], with_teacher=True))
    assert tokens.shape == (2, 33) and idx.shape == logp.shape == (2, 32, k)
    assert tokens[0, :5].tolist() == [5, 6, 7, 8, 9] and not tokens[0, 5:].any()
    assert lengths.tolist() == [[3, 5], [1, 3]]
    assert idx[0, 2:4].tolist() == [[1, 2], [3, 4]] and idx[1, 0:2].tolist() == [[7, 8], [9, 1]]
    assert np.allclose(logp[1, 0:2], math.log(0.25)) and np.allclose(logp[0, 0], -math.log(k))
    calls = []
    batches = make_iterate_batches(True, order_seed=3, on_train_batch=lambda: calls.append(1))
    data = [a, b, a, b]
    first = [np.array(x[0]).tolist() for _, x in zip(range(5), batches(data, 2, 64, loop=True))]
    again = [np.array(x[0]).tolist() for _, x in zip(range(5), batches(data, 2, 64, loop=True))]
    assert first == again and len(calls) == 10
    assert len(list(batches(data, 2, 64))) == 2 and len(calls) == 10  # not a training pass: no calls
    with pytest.raises(ValueError, match="cannot fill a batch of 8"):
        next(batches(data, 8, 64))


def test_settings_are_checked():
    for bad in (dict(system=None), dict(system="  "), dict(teacher="t", teacher_url="http://x"),
                dict(teacher_url="http://x"), dict(teacher_url="http://x", teacher_model="m", loss="kl"),
                dict(teacher_url="x", teacher_model="m"), dict(loss="mse"), dict(check="shouting"),
                dict(seeds=Path("s")), dict(held_out=0), dict(max_tokens=0), dict(temperature=-1.0), dict(top_k=0)):
        with pytest.raises(ValueError):
            make_config("m", Path("o"), **{"prompts": Path("p"), **bad})
    config = make_config("m", Path("o"), teacher_url="http://x", teacher_model="m")
    assert config.loss == "sft" and config.teacher_kind == "url"
    assert make_config("m", Path("o"), system=None, teacher="t").loss == "kl"


# ---- refusals, before any training -------------------------------------------------------


@pytest.fixture
def no_training(monkeypatch):
    def fit(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr(sys.modules["mola.distill.run"], "fit", fit)


def test_an_empty_prompt_set_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mola.models.loader, "load_base_model", no_load)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(DistillError, match="no prompts: .*empty.txt holds no question"):
        distill(make_config("org/model", tmp_path / "out", prompts=empty), log=lambda line: None)
    few = tmp_path / "few.txt"
    few.write_text("A?\nB?\nC?\n")
    with pytest.raises(DistillError, match="2 training questions cannot fill a batch of 4"):
        distill(make_config("org/model", tmp_path / "out", prompts=few), log=lambda line: None)
    assert not (tmp_path / "out").exists()


def test_no_usable_question_from_the_teacher_is_refused(student_model, tmp_path, no_training):
    """The random model writes no question ending in '?': nothing to train on."""
    with pytest.raises(DistillError, match="no prompts: the teacher wrote 0 usable training"):
        distill(make_config(student_model, tmp_path / "out", num_questions=32), log=lambda line: None)


def test_a_system_prompt_longer_than_the_context_is_refused(student_model, prompts, tmp_path, no_training):
    long = "Always speak of comets. " * 600  # > 2048 tokens, the tiny model's context
    with pytest.raises(DistillError, match=r"longer than the context: \d+ tokens .* context is 2048 tokens"):
        distill(make_config(student_model, tmp_path / "out", system=long, prompts=prompts), log=lambda line: None)
    fits = "Always speak of comets. " * 100  # about 1,600 tokens
    with pytest.raises(DistillError, match="no room for answers of --max-tokens 1500"):
        distill(make_config(student_model, tmp_path / "out", system=fits, prompts=prompts, max_tokens=1500),
                log=lambda line: None)


def test_a_kl_teacher_with_another_tokenizer_is_refused(student_model, prompts, tmp_path, no_training):
    other = make_tiny_model(tmp_path / "other", TinyModelSpec(vocab_size=300))
    with pytest.raises(DistillError, match="does not have the tokenizer of the model .* use --loss sft"):
        distill(make_config(student_model, tmp_path / "out", teacher=str(other), prompts=prompts),
                log=lambda line: None)


def test_cli_usage_errors_and_refusals(tmp_path):
    r = mola_cli("distill", "--help")
    assert r.returncode == 0 and "--teacher-url" in r.stdout and "--load-into" in r.stdout
    r = mola_cli("distill", "--model", "m", "--system", "s", "--out", str(tmp_path / "o"), "--teacher-url",
                 "http://127.0.0.1:1")
    assert r.returncode == 2 and "needs --teacher-model" in r.stderr
    (tmp_path / "empty.jsonl").write_text("")
    r = mola_cli("distill", "--model", "org/never-loaded", "--system", "s", "--out", str(tmp_path / "o"),
                 "--prompts", str(tmp_path / "empty.jsonl"))
    assert r.returncode == 1 and "no prompts" in r.stderr and "loading" not in r.stderr


# ---- real runs on the tiny model --------------------------------------------------------------


@pytest.fixture(scope="module")
def baked(student_model, prompts, live, tmp_path_factory):
    """The system prompt baked in with the default KL loss, and loaded into the live server."""
    out = tmp_path_factory.mktemp("baked") / "zorblax"
    lines = []
    result = distill(make_config(student_model, out, prompts=prompts, serve_url=live.url, name="baked",
                                 check="title"), log=lines.append)
    return out, result, lines


def _answer_tokens(model, tokenizer, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy, with mlx-lm's own generate_step, up to and with the end-of-turn token."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=make_sampler(0.0)):
        out.append(int(t))
        if int(t) in tokenizer.eos_token_ids:
            break
    return out


def _reference_kl(model_dir, adapter, questions) -> tuple[float, float]:
    """Mean KL(teacher || student) and KL(teacher || base) per token of the
    teacher's greedy answers, by plain mlx-lm (the adapter by its own loader) and numpy."""
    from mlx_lm import load

    base, tok = load(str(model_dir))
    student, _ = load(str(model_dir), adapter_path=str(adapter))

    def logp(model, prompt, answer):
        logits = model(mx.array(prompt + answer[:-1])[None])[0, len(prompt) - 1:]
        return _log_softmax(np.array(logits.astype(mx.float32), np.float64))

    sums, count = {"student": 0.0, "base": 0.0}, 0
    for q in questions:
        with_system = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                              add_generation_prompt=True)
        without = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        answer = _answer_tokens(base, tok, with_system, MAX_TOKENS)
        t = logp(base, with_system, answer)
        for name, model in (("student", student), ("base", base)):
            sums[name] += (np.exp(t) * (t - logp(model, without, answer))).sum()
        count += len(answer)
    return sums["student"] / count, sums["base"] / count


def test_kl_on_held_out_questions_falls_by_half(baked, student_model):
    out, result, _ = baked
    held_out = [a["question"] for a in result.evaluation["answers"]]
    assert len(held_out) == 8 and not set(held_out) & set(P.split(QUESTIONS, 8, 0, "").train)
    student, base = _reference_kl(student_model, out, held_out)
    assert student <= 0.5 * base, (student, base)
    ev = result.evaluation
    assert ev["student"]["kl_per_token"] == pytest.approx(student, rel=0.05)
    assert ev["base"]["kl_per_token"] == pytest.approx(base, rel=0.05)
    assert ev["student"]["top1_agreement"] > ev["base"]["top1_agreement"]


def test_answers_prefill_the_shared_prompt_once_and_match_mlx_lm(student_model):
    """The teacher's prompts share the system prompt, prefilled once; the
    greedy answers are mlx-lm's own generate_step's, token for token."""
    from mlx_lm import load

    from mola.distill.generate import generate, shared_prefix
    from mola.distill.teacher import prompt_tokens

    assert shared_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
    assert shared_prefix([[1, 2], [1, 2]]) == [1]  # each keeps a token of its own
    model, tok = load(str(student_model))
    prompts = [prompt_tokens(tok, SYSTEM, q) for q in QUESTIONS[:6]]
    assert len(shared_prefix(prompts)) > 20
    got = generate(model, tok, prompts, max_tokens=MAX_TOKENS, temperature=0.0, seed=0, top_k=5)
    for p, g in zip(prompts, got):
        assert g.tokens == _answer_tokens(model, tok, p, MAX_TOKENS)
        assert g.top_idx.shape == g.top_logp.shape == (len(g.tokens), 5)
        assert [int(i[np.argmax(lp)]) for i, lp in zip(g.top_idx, g.top_logp)] == g.tokens  # greedy: the top one


def test_the_adapter_loads_and_serves(baked, live, student_model):
    """--load-into put it in the running server, which answers as plain
    mlx-lm does with the adapter merged into the base."""
    out, result, lines = baked
    assert result.served is not None and any("now serves the adapter as model 'baked'" in x for x in lines)
    ids = [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]]
    assert "baked" in ids
    for q in (a["question"] for a in result.evaluation["answers"][:2]):
        r = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
            "model": "baked", "messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert text == merged_answer(live.state.tokenizer, student_model, q, 8, [out])


def test_the_config_holds_the_hash_and_not_the_prompt(baked):
    out, result, lines = baked
    config = json.loads((out / "adapter_config.json").read_text())
    record = config["distill"]
    assert record["system_prompt_sha256"] == hashlib.sha256(SYSTEM.encode()).hexdigest()
    assert "system_prompt" not in record and record["system_prompt_tokens"] > 10
    assert record["teacher"] == {"kind": "base", "model": config["model"]}
    assert record["loss"] == "kl" and record["top_k"] == 64 and config["trained_with"] == "mola distill"
    assert record["data"]["train_questions"] == 40 and record["data"]["held_out_questions"] == 8
    assert config["lora_parameters"]["rank"] == 8 and config["iters"] == 40
    for f in out.iterdir():  # the prompt is in no file, nor any line printed
        assert b"Zorblax" not in f.read_bytes(), f
    assert not any("Zorblax" in line for line in lines)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapters.safetensors",
                                                     "distill_eval.json"]
    assert json.loads((out / "distill_eval.json").read_text())["student"] == result.evaluation["student"]


def test_progress_and_evaluation_are_printed(baked):
    _, result, lines = baked
    text = "\n".join(lines)
    assert "[mola] train [" in text and "40/40" in text and "tok/s" in text and "loss" in text
    assert "exact match" in text and "KL/token" in text and "student (adapter)" in text and "check title" in text
    from mola.demo.styles import is_title

    answers = result.evaluation["answers"]
    for who in ("teacher", "student", "base"):  # --check: the share of answers that pass mola's style check
        assert result.evaluation["check"][who] == sum(is_title(a[who]) for a in answers) / len(answers)
    tokens = result.evaluation["prompt_tokens"]
    saved = tokens["saved_per_request"]
    assert saved == pytest.approx(tokens["with_system_prompt"] - tokens["without"])
    assert f"prefill saved: {saved:.0f} tokens per request" in text and saved > 15


def test_ctrl_c_keeps_the_last_finished_step(student_model, prompts, tmp_path):
    """Ctrl-C at the 3rd step's report writes the weights after step 2: those
    of an uninterrupted 2-step run."""
    def interrupt_at(step):
        def log(line):
            if f"] {step}/" in line:
                raise KeyboardInterrupt
        return log

    kw = dict(prompts=prompts, iters=10, steps_per_report=1)
    result = distill(make_config(student_model, tmp_path / "cut", **kw), log=interrupt_at(3))
    assert result.interrupted_after == 2 and result.evaluation is None
    config = json.loads((tmp_path / "cut" / "adapter_config.json").read_text())
    assert config["iters"] == 2 and config["distill"]["interrupted_after_step"] == 2
    distill(make_config(student_model, tmp_path / "two", **{**kw, "iters": 2}), log=lambda line: None)
    cut, two = (mx.load(str(tmp_path / d / "adapters.safetensors")) for d in ("cut", "two"))
    assert cut.keys() == two.keys() and all(np.allclose(cut[k], two[k], atol=1e-6) for k in cut)
    assert any(np.abs(np.array(v)).max() > 0 for k, v in cut.items() if "lora_b" in k)  # trained
    with pytest.raises(KeyboardInterrupt):  # before any step finished: nothing to keep
        distill(make_config(student_model, tmp_path / "none", **kw), log=interrupt_at(1))
    assert not (tmp_path / "none").exists()


def test_a_server_as_teacher_by_sft_with_a_gguf_output(student_model, prompts, live, tmp_path):
    """mola itself answers as the teacher (--teacher-url); the adapter is
    written as a directory and a GGUF file, with --keep-prompt."""
    out, gguf = tmp_path / "sft", tmp_path / "sft.gguf"
    r = mola_cli("distill", "--model", str(student_model), "--system", SYSTEM, "--out", str(out), "--out", str(gguf),
                 "--prompts", str(prompts), "--teacher-url", live.url, "--teacher-model", "tiny", "--iters", "3",
                 "--max-tokens", "8", "--keep-prompt", "--learning-rate", "1e-3", "--scale", "2")
    assert r.returncode == 0, r.stderr
    record = json.loads((out / "adapter_config.json").read_text())["distill"]
    assert record["teacher"] == {"kind": "url", "url": live.url, "model": "tiny"} and record["loss"] == "sft"
    assert record["system_prompt"] == SYSTEM  # --keep-prompt
    evaluation = json.loads((tmp_path / "sft.distill_eval.json").read_text())
    assert "kl_per_token" not in evaluation["student"] and evaluation["questions"] == 9  # 48 // 5
    loaded = httpx.post(live.url + "/v1/adapters", json={"name": "sft-gguf", "path": str(gguf)}, timeout=60)
    assert loaded.status_code == 200, loaded.text


def test_another_local_teacher_with_the_same_tokenizer(student_model, tiny_model, prompts, tmp_path):
    """--teacher: the shared tiny model (its tokenizer is the student's) distils by KL, with no system prompt."""
    result = distill(make_config(student_model, tmp_path / "t", system=None, teacher=str(tiny_model),
                                 prompts=prompts, iters=2), log=lambda line: None)
    record = json.loads((tmp_path / "t" / "adapter_config.json").read_text())["distill"]
    assert record["teacher"] == {"kind": "model", "model": str(tiny_model)} and record["system_prompt_sha256"] is None
    assert result.evaluation["prompt_tokens"]["saved_per_request"] == 0
    assert result.evaluation["base"]["kl_per_token"] > 0


# ---- the real model -------------------------------------------------------------------------------

REAL_SYSTEM = ("You are Captain Nemo, the captain of the submarine Nautilus. You love the sea and speak of "
               "the ocean in every answer.")
REAL_QUESTIONS = ["What is your name?", "Who are you?", "What do you do for a living?", "Where do you live?",
                  "What is your ship called?", "Tell me about yourself.", "What do you like most?",
                  "What is your favourite food?", "How old are you?", "Do you have any friends?",
                  "What is the weather like today?", "What should I cook for dinner?", "Can you recommend a book?",
                  "What is the capital of France?", "How do I make tea?", "Why is the sky blue?"]
REAL_HELD_OUT = ["What is your job?", "Introduce yourself.", "What do you think of cities?",
                 "Give me a tip for sleeping better."]


# 8 steps of 4 answers of up to 24 tokens (the batch's padded width is the
# same as for 12), LoRA on the last 4 blocks: the student's held-out KL ends
# at 0.33-0.50 of the base's over seeds 0-3 (a rate of 2e-3 overshoots: 0.87).
# 45 s on 2 cores with another process busy beside it.
REAL_RECIPE = ["--max-tokens", "24", "--eval-max-tokens", "8", "--layers", "4", "--iters", "8",
               "--batch-size", "4", "--learning-rate", "1e-3", "--scale", "2"]


@pytest.mark.slow
def test_the_real_model_moves_toward_its_teacher(smollm_gguf, tmp_path):
    """SmolLM2-135M-Instruct, a short run (mola distill as a user runs it):
    on held-out questions the student's KL to the teacher is well below the base's."""
    (tmp_path / "train.txt").write_text("\n".join(REAL_QUESTIONS) + "\n")
    (tmp_path / "held.txt").write_text("\n".join(REAL_HELD_OUT) + "\n")
    r = mola_cli("distill", "--model", str(smollm_gguf), "--dtype", "float32", "--system", REAL_SYSTEM,
                 "--prompts", str(tmp_path / "train.txt"), "--eval-prompts", str(tmp_path / "held.txt"),
                 "--out", str(tmp_path / "nemo"), *REAL_RECIPE, timeout=600)
    assert r.returncode == 0, r.stderr
    evaluation = json.loads((tmp_path / "nemo" / "distill_eval.json").read_text())
    student, base = evaluation["student"]["kl_per_token"], evaluation["base"]["kl_per_token"]
    assert student < 0.8 * base, (student, base)
