"""Reasoning parsers and the grammar of thinking (mola/server/reasoning.py):
each parser on exact texts fed whole, a character at a time and cut at every
character boundary; `auto` on the real templates (tests/data/templates/);
random walks through thinking-then-answer grammars, read back by the parser,
whose answer must validate while the thinking is free."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from mola.models.eog import special_token_ids
from mola.frontend.reasoning import (DeepSeekR1, GptOss, HarmonyParser, Qwen3, Split, ThinkParser, detect,
                                   reasoning_format)
from mola.frontend.tools import ToolCallParser
from mola.structured import StructuredOutputs

from helpers.tokenizers import with_added_tokens, with_chat_template

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"]
ANSWER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": ANSWER}}


def run(parser, text: str, cuts=()) -> Split:
    """``text`` fed in pieces cut at ``cuts``, then finish()."""
    out, at = Split(), 0
    for cut in [*cuts, len(text)]:
        out += parser.feed(text[at:cut])
        at = cut
    return out + parser.finish()


def every_split(make, text: str, expected: Split) -> None:
    """The same result whole, a character at a time and cut at every boundary."""
    assert run(make(), text) == expected
    assert run(make(), text, range(1, len(text))) == expected
    for cut in range(len(text) + 1):
        assert run(make(), text, [cut]) == expected, cut


# ---- <think> tags ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nThe user says hi.\n</think>\n\nHello!", "The user says hi.\n", "Hello!"),
    ("The user says hi.\n</think>\n\nHello!", "The user says hi.\n", "Hello!"),  # R1: <think> in the prompt
    ("  <think>a </thin b <think> c</think>x </think> y", "a </thin b <think> c", "x </think> y"),
    ("<think>\nstill thinking when max_tokens ran out", "still thinking when max_tokens ran out", ""),
    ("<thi", "<thi", ""),  # cut off inside the start marker
    ("</think>", "", ""),
    ("", "", ""),
])
def test_think_tags_split_at_every_boundary(text, reasoning, content):
    every_split(lambda: ThinkParser("<think>", "</think>", thinking=True), text, Split(reasoning, content))


def test_thinking_closed_in_the_prompt_is_all_answer():
    text = "Hello <think>not thinking</think> there"
    every_split(lambda: ThinkParser("<think>", "</think>", thinking=False), text, Split("", text))


def test_the_parser_says_when_the_thinking_ends():
    p = ThinkParser("<think>", "</think>", thinking=True)
    assert p.in_reasoning
    p.feed("<think>a</thi")
    assert p.in_reasoning
    p.feed("nk>")
    assert not p.in_reasoning


def test_the_prompt_says_whether_the_output_starts_thinking():
    assert Qwen3.thinks_first(Qwen3, "<|im_start|>assistant\n")
    assert not Qwen3.thinks_first(Qwen3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert DeepSeekR1.thinks_first(DeepSeekR1, "<｜Assistant｜><think>\n")


# ---- harmony -------------------------------------------------------------------------------------

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."
CALL = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}'
CALL_AS_MODELS_WRITE_IT = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
                           '<|message|>{"city": "Rome", "days": 1}<|call|>')


def calls_of(split: Split) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in split.calls]


def without_calls(split: Split) -> Split:
    return Split(split.reasoning, split.content)


@pytest.mark.parametrize("text, reasoning, content", [
    (ANALYSIS + FINAL, "The user wants the weather.", "It is sunny."),
    (ANALYSIS + FINAL + "<|return|>", "The user wants the weather.", "It is sunny."),
    ("<|channel|>final<|message|>Only an answer.<|end|>", "", "Only an answer."),
    (ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|> More.<|end|>" + FINAL,
     "The user wants the weather. More.", "It is sunny."),
    ("<|channel|>analysis<|message|>cut off by max_tokens", "cut off by max_tokens", ""),
    ("<|channel|>analy", "", ""),  # cut off inside a header
    ("no harmony at all", "", "no harmony at all"),
])
def test_harmony_splits_at_every_boundary(text, reasoning, content):
    every_split(lambda: HarmonyParser(tools=False), text, Split(reasoning, content))


@pytest.mark.parametrize("call, expected", [
    (CALL, ("get_weather", {"city": "Paris", "days": 2})),  # as gpt-oss's template renders a call
    (CALL_AS_MODELS_WRITE_IT, ("get_weather", {"city": "Rome", "days": 1})),
])
def test_harmony_tool_calls_at_every_boundary(call, expected):
    text = ANALYSIS + call
    for cuts in [(), range(1, len(text)), *([c] for c in range(len(text) + 1))]:
        split = run(HarmonyParser(tools=True), text, cuts)
        assert without_calls(split) == Split("The user wants the weather.", ""), cuts
        assert calls_of(split) == [expected], cuts
    # without tools in the request, a call's text is the answer
    assert run(HarmonyParser(tools=False), text).content == json.dumps(expected[1])


def test_a_harmony_call_cut_off_is_kept_as_text():
    split = run(HarmonyParser(tools=True), ANALYSIS + CALL[:-5])
    assert split.calls == [] and split.content == CALL[CALL.index("{"):-5]


# ---- auto, on the real templates ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    think = ["<think>", "</think>"]
    return {
        "qwen3": load_tokenizer(with_added_tokens(tiny_model, root / "qwen3", think, template=QWEN3)),
        "deepseek_r1": load_tokenizer(with_added_tokens(tiny_model, root / "r1", think, template=R1)),
        "gpt_oss": load_tokenizer(with_added_tokens(tiny_model, root / "gpt-oss", HARMONY_TOKENS, special=True,
                                                    eos=("<|return|>", "<|call|>"), template=GPT_OSS)),
        "chatml": load_tokenizer(tiny_model),
        # a template that only strips </think> from earlier answers: no thinking model
        "strips": load_tokenizer(with_chat_template(tiny_model, root / "strips", QWEN3.replace(
            "{%- if enable_thinking is defined and enable_thinking is false %}", "{%- if false %}"))),
    }


@pytest.mark.parametrize("name, expected", [("qwen3", Qwen3), ("deepseek_r1", DeepSeekR1), ("gpt_oss", GptOss),
                                            ("chatml", None), ("strips", None)])
def test_auto_picks_the_format_from_the_template(tokenizers, name, expected):
    fmt = reasoning_format("auto", tokenizers[name])
    assert (type(fmt) if fmt else None) is expected
    assert detect(tokenizers[name]) == (expected.name if expected else None)
    assert reasoning_format("none", tokenizers[name]) is None
    with pytest.raises(ValueError, match="'o1'"):
        reasoning_format("o1", tokenizers[name])


def test_harmony_markers_are_read_even_though_special(tokenizers):
    tok = tokenizers["gpt_oss"]
    fmt = GptOss(tok)
    assert fmt.marker_ids == {tok.convert_tokens_to_ids(t) for t in HARMONY_TOKENS}
    assert fmt.marker_ids <= special_token_ids(tok)  # what skip_special_tokens would leave out


def test_the_prompt_tail_decides_per_request(tokenizers):
    tok = tokenizers["qwen3"]
    fmt = Qwen3(tok)
    user = [{"role": "user", "content": "hi"}]
    on = tok.apply_chat_template(user, add_generation_prompt=True)
    off = tok.apply_chat_template(user, add_generation_prompt=True, enable_thinking=False)
    assert fmt.start(tok, on).thinks_first and not fmt.start(tok, off).thinks_first
    r1 = tokenizers["deepseek_r1"]
    assert DeepSeekR1(r1).start(r1, r1.apply_chat_template(user, add_generation_prompt=True)).thinks_first


# ---- thinking grammars: free thinking, then a constrained answer ----------------------------------


def walks(compiled, tokenizer, rng, ends: set[int], num=24, max_tokens=120):
    """Token ids of random walks through a grammar's masks; a token of
    ``ends`` (the markers that close thinking) is drawn with probability 1/8
    when allowed, EOS with 1/2 once allowed."""
    eos = set(tokenizer.eos_token_ids)
    out = []
    for _ in range(num):
        m = compiled.matcher.deep_copy()
        tokens = []
        for _ in range(max_tokens):
            allowed = np.nonzero(np.frombuffer(m.compute_logit_bias(), dtype=np.uint8))[0]
            stop = [t for t in allowed if t in eos]
            marks = [t for t in allowed if t in ends]
            others = [t for t in allowed if t not in eos and t not in ends]
            if stop and (not others or rng.random() < 0.5):
                break
            pool = marks if marks and (not others or rng.random() < 1 / 8) else others
            token = int(rng.choice(pool))
            assert m.consume_token(token)
            tokens.append(token)
        else:
            continue
        assert m.is_accepting()
        out.append(tokens)
    assert len(out) >= num // 2
    return out


def text_of(tokenizer, tokens) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_a_format_after_think_tags_validates_while_the_thinking_is_free(tokenizers, name):
    tok = tokenizers[name]
    fmt = reasoning_format(name, tok)
    reasoning = fmt.start(tok, tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                       add_generation_prompt=True))
    compiled = StructuredOutputs(tok, len(tok._tokenizer)).for_request(response_format=FORMAT,
                                                                       thinking=reasoning.grammar)
    thoughts = set()
    for tokens in walks(compiled, tok, np.random.default_rng(0), {tok.convert_tokens_to_ids("</think>")}):
        split = run(reasoning.parser(), text_of(tok, tokens))
        jsonschema.validate(json.loads(split.content), ANSWER)
        thoughts.add(split.reasoning)
    assert len(thoughts) > 5  # the thinking is free text, different on every walk


def test_a_closed_thinking_constrains_from_the_first_token(tokenizers):
    tok = tokenizers["qwen3"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     enable_thinking=False)
    reasoning = Qwen3(tok).start(tok, prompt)
    compiled = StructuredOutputs(tok, len(tok._tokenizer)).for_request(response_format=FORMAT,
                                                                       thinking=reasoning.grammar)
    assert "thinking" not in compiled.grammar.lark
    for tokens in walks(compiled, tok, np.random.default_rng(1), set(), num=8):
        jsonschema.validate(json.loads(text_of(tok, tokens)), ANSWER)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_qwen3_forced_calls_after_thinking_are_in_its_own_syntax(tokenizers, choice):
    tok = tokenizers["qwen3"]
    reasoning = Qwen3(tok).start(tok, tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                              add_generation_prompt=True))
    compiled = StructuredOutputs(tok, len(tok._tokenizer)).for_request(
        tools=[WEATHER], tool_choice=choice, thinking=reasoning.grammar)
    assert compiled.grammar.json_calls is None  # <tool_call> JSON, as Qwen3's template writes calls
    for tokens in walks(compiled, tok, np.random.default_rng(2), {tok.convert_tokens_to_ids("</think>")}):
        split = run(reasoning.parser(), text_of(tok, tokens))
        tools = ToolCallParser(tok, [WEATHER])
        content, calls = tools.feed(split.content)
        more, more_calls = tools.finish()
        assert not (content + more).strip() and calls + more_calls
        for call in calls + more_calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), ANSWER)


def test_harmony_format_and_calls_follow_the_analysis(tokenizers):
    tok = tokenizers["gpt_oss"]
    fmt = GptOss(tok)
    reasoning = fmt.start(tok, tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                       add_generation_prompt=True))
    s = StructuredOutputs(tok, len(tok._tokenizer))
    end = {tok.convert_tokens_to_ids("<|end|>")}
    analyses = set()
    for tokens in walks(s.for_request(response_format=FORMAT, thinking=reasoning.grammar), tok,
                        np.random.default_rng(3), end):
        split = run(reasoning.parser(), text_of(tok, tokens))
        jsonschema.validate(json.loads(split.content), ANSWER)
        analyses.add(split.reasoning)
    assert len(analyses) > 5
    compiled = s.for_request(tools=[WEATHER], tool_choice="required", thinking=reasoning.grammar)
    for tokens in walks(compiled, tok, np.random.default_rng(4), end):
        split = run(reasoning.parser(tools=True), text_of(tok, tokens))
        assert not split.content and len(split.calls) == 1, text_of(tok, tokens)
        assert split.calls[0]["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(split.calls[0]["function"]["arguments"]), ANSWER)
