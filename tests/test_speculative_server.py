"""Speculative decoding through the HTTP API (mola serve --speculative):
answers, usage, log-probabilities, stop strings, n > 1 and streams are the
same as a server without speculation gives, on the echo demo and its
adapters; the metrics count drafted and accepted tokens; the flags."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mola.cli import build_parser, config_from_args
from mola.config import AdapterSpec

from helpers.schemas import sse_events
from helpers.servers import start_server

MESSAGES = ["the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def servers(echo_demo):
    base, adapters = echo_demo
    common = dict(model=str(base), served_model_name="mola-demo", max_loras=4, max_lora_rank=16,
                  adapters=tuple(AdapterSpec(n, str(adapters[n])) for n in ("upper", "title")))
    spec = start_server(**common, speculative="ngram", speculate_always=True, prompt_cache_bytes=0)
    plain = start_server(**common, prompt_cache_bytes=0)
    yield spec, plain
    spec.stop()
    plain.stop()


def bodies() -> list[dict]:
    out = []
    for m in MESSAGES:
        for model in ("mola-demo", "upper"):
            base = {"model": model, "messages": [{"role": "user", "content": m}], "max_tokens": 40}
            out += [
                {**base, "temperature": 0},
                {**base, "temperature": 0, "stop": ["ov", "OWN"]},  # found inside a step's tokens
                {**base, "temperature": 0, "logprobs": True, "top_logprobs": 2, "max_tokens": 7},
                {**base, "temperature": 0.9, "seed": 11, "n": 3},
                {**base, "temperature": 0, "frequency_penalty": 0.4, "stream": True,
                 "stream_options": {"include_usage": True}},
            ]
    return out


async def ask_all(url: str, jobs: list[dict], at_once: int = 5) -> list:
    """Answers to ``jobs``, ``at_once`` requests in flight (a batch that speculates)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        rs = []
        for i in range(0, len(jobs), at_once):
            wave = jobs[i:i + at_once]
            rs += await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in wave))
    out = []
    for b, r in zip(jobs, rs):
        assert r.status_code == 200, r.text
        out.append(stream_answer(r.text) if b.get("stream") else r.json())
    return out


def stream_answer(text: str) -> dict:
    events = [e for e in sse_events(text) if e != "[DONE]"]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events
              if e["choices"] and e["choices"][0]["finish_reason"]]
    return {"content": content, "finish": finish, "usage": usage(events[-1]["usage"])}


def usage(u: dict) -> tuple:
    """Token counts (the prompt cache's share depends on timing, not on speculation)."""
    return u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]


def comparable(answer: dict) -> dict:
    if "content" in answer:  # a stream
        return answer
    logprobs = [[(c["token"], round(c["logprob"], 3), [t["token"] for t in c["top_logprobs"]])
                 for c in ch["logprobs"]["content"]] if ch.get("logprobs") else None
                for ch in answer["choices"]]
    return {"choices": [(ch["message"]["content"], ch["finish_reason"]) for ch in answer["choices"]],
            "logprobs": logprobs, "usage": usage(answer["usage"])}


@pytest.mark.slow
def test_answers_are_those_of_a_server_without_speculation(servers):
    spec, plain = servers
    jobs = bodies()
    got = asyncio.run(ask_all(spec.url, jobs))
    want = asyncio.run(ask_all(plain.url, jobs))
    for job, g, w in zip(jobs, got, want):
        assert comparable(g) == comparable(w), job
    stopped = [g for job, g in zip(jobs, got) if job.get("stop") and g["choices"][0]["finish_reason"] == "stop"]
    assert len(stopped) == 2
    metrics = httpx.get(spec.url + "/metrics").text
    accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("mola_speculative_accepted_tokens_total"))
    assert accepted > 30


def test_the_flags_make_the_engine_config(tmp_path):
    args = build_parser().parse_args(["serve", "--speculative", "ngram", "--num-draft-tokens", "12",
                                      "--prompt-lookup-min", "1", "--prompt-lookup-max", "5",
                                      "--speculative-max-batch", "4", "--speculate-always"])
    spec = config_from_args(args).engine.speculative
    assert (spec.method, spec.num_draft_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            spec.max_batch, spec.cost_aware) == ("ngram", 12, 1, 5, 4, False)
    assert config_from_args(build_parser().parse_args(["serve"])).engine.speculative is None
    plain_flags = build_parser().parse_args(["serve", "--speculative", "ngram"])
    assert config_from_args(plain_flags).engine.speculative.cost_aware
    args = build_parser().parse_args(["serve", "--speculative", "draft", "--draft-model", "small"])
    assert config_from_args(args).engine.speculative.draft_model == "small"


@pytest.mark.parametrize("argv, words", [
    (["--speculative", "draft"], "needs a --draft-model"),
    (["--draft-model", "small"], "--speculative draft"),
    (["--speculative", "ngram", "--draft-model", "small"], "draft only"),
    (["--speculative", "ngram", "--num-draft-tokens", "0"], "num_draft_tokens must be at least 1, got 0"),
    (["--speculative", "ngram", "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"],
     "prompt_lookup_max (2)"),
])
def test_bad_flags_are_refused_naming_them(argv, words, capsys):
    with pytest.raises(SystemExit):
        from mola.cli import main

        main(["serve", *argv])
    assert words in capsys.readouterr().err
