"""`mola chat` (mola/chat/) driven as a person drives it: in a pseudo-terminal
(pexpect) against a live server on the tiny model. Every answer is checked
against the same conversation sent to the server as one plain HTTP request;
Ctrl-C mid-answer, /save, Ctrl-D and the exit status are checked too."""

from __future__ import annotations

import json
import os
import re
import sys
import threading

import httpx
import pexpect
import pytest

from mola.chat.session import Session, parse_scale

from helpers.servers import wait_until

MAX_TOKENS = 12


def spawn(*args, env=None, tmp_path=None) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "mola", "chat", *map(str, args)], encoding="utf-8",
                          timeout=60, dimensions=(50, 400),
                          env={**os.environ, "TERM": "dumb", "INPUTRC": os.devnull,
                               "MOLA_CACHE": str(tmp_path), **(env or {})})
    return child


def reference(url: str, messages: list[dict], model: str, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    """The same conversation, sent in one non-streamed request."""
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def shown(text: str) -> str:
    """What a text looks like in the terminal (the tty turns \\n into \\r\\n)."""
    return text.replace("\n", "\r\n")


class Conversation:
    """The chat on one side, the messages it should have sent on the other."""

    def __init__(self, child, url, model):
        self.child, self.url, self.model = child, url, model
        self.messages: list[dict] = []
        self.scale = None

    def prompt(self) -> str:
        return f"{self.model}> " if self.scale is None else f"{self.model}@{self.scale:g}> "

    def ask(self, question: str) -> str:
        self.messages.append({"role": "user", "content": question})
        extra = {} if self.scale is None else {"lora_scale": self.scale}
        answer = reference(self.url, self.messages, self.model, **extra)["choices"][0]["message"]["content"]
        self.child.sendline(question)
        self.child.expect_exact(shown(question) + "\r\n" + shown(answer) + "\r\n" + self.prompt())
        self.messages.append({"role": "assistant", "content": answer})
        return answer

    def command(self, line: str, reply: str) -> None:
        self.child.sendline(line)
        self.child.expect_exact(reply)
        self.child.expect_exact(self.prompt())


def test_a_conversation_across_models_and_scales(server, tmp_path):
    child = spawn("--url", server.url, "tiny", "--max-tokens", MAX_TOKENS, "--temperature", 0,
                  "--history", tmp_path / "history", tmp_path=tmp_path)
    chat = Conversation(child, server.url, "tiny")
    child.expect_exact(f"[mola] chatting with tiny at {server.url}")
    child.expect_exact("tiny> ")
    chat.ask("Where do rivers go?")
    chat.model = "a"
    chat.command("/model a", "now talking to a; the conversation goes on")
    chat.ask("And the sea?")  # answered by a, with the whole conversation
    chat.scale = 0.0
    chat.command("/adapter off", "lora_scale 0")
    chat.ask("Once more?")  # lora_scale 0: the base model's answer
    chat.scale = 0.5
    chat.command("/adapter 0.5", "lora_scale 0.5")
    chat.ask("Half?")
    chat.command("/adapter loud", "error: /adapter takes off, on or a number, not 'loud'")
    chat.scale = None
    chat.command("/adapter on", "the adapter at its own strength")
    chat.command("/adapters", "* a  (adapter on tiny)")
    saved = tmp_path / "chat.json"
    chat.command(f"/save {saved}", f"saved {len(chat.messages)} messages to {saved}")
    data = json.loads(saved.read_text())
    assert [{k: m[k] for k in ("role", "content")} for m in data["messages"]] == chat.messages
    assert [m.get("model") for m in data["messages"][1::2]] == ["tiny", "a", "a", "a"]
    assert [m.get("lora_scale") for m in data["messages"][1::2]] == [None, None, 0.0, 0.5]

    chat.model = "nope"
    chat.command("/model nope", "the server does not list it")
    child.sendline("Anyone there?")  # the server's own message, not a traceback
    child.expect_exact("error: The model 'nope' does not exist.")
    child.expect_exact(chat.prompt())
    chat.model = "tiny"
    chat.command("/model tiny", "now talking to tiny")
    chat.scale = 0.5
    chat.command("/adapter 0.5", "lora_scale 0.5")
    child.sendline("Scaled base?")
    child.expect_exact("error: lora_scale scales an adapter, but 'tiny' is the base model.")
    chat.scale = None
    chat.command("/adapter on", "the adapter at its own strength")

    chat.command("/system Answer briefly.", "system prompt set")
    chat.command("/reset", "conversation cleared")
    chat.messages = [{"role": "system", "content": "Answer briefly."}]
    chat.ask("Fresh start?")
    chat.command("/help", "/save FILE         write the conversation to FILE as JSON")
    chat.command("/frobnicate", "error: unknown command /frobnicate; /help lists them")
    child.sendeof()  # Ctrl-D
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.before
    history = (tmp_path / "history").read_text()
    assert "Where do rivers go?" in history and "/model a" in history


def test_context_use_is_shown(server, tmp_path):
    """/context (and /help) show how much of the model's context the conversation
    fills: its prompt for the next answer, counted by the server's /tokenize, here
    against the tokenizer's own chat template."""
    child = spawn("--url", server.url, "tiny", "--max-tokens", MAX_TOKENS, "--temperature", 0,
                  "--history", tmp_path / "history", tmp_path=tmp_path)
    chat = Conversation(child, server.url, "tiny")
    child.expect_exact("tiny> ")
    tok = server.state.tokenizer

    def used() -> str:
        return f"[{len(tok.apply_chat_template(chat.messages, add_generation_prompt=True))} / 2048 tokens]"

    chat.command("/context", "[0 / 2048 tokens]")  # nothing said yet
    chat.ask("Where do rivers go?")
    chat.command("/context", used())
    chat.command("/system Answer briefly.", "system prompt set")
    chat.messages.insert(0, {"role": "system", "content": "Answer briefly."})
    chat.command("/help", "/context  ")
    chat.command("/help", used())
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.before


def generated_tokens(url: str, model: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf'^mola_generation_tokens_total{{model="{model}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(server, tmp_path, monkeypatch):
    """A long answer (the first of a few prompts that runs 1000 tokens or more
    at temperature 0: seconds of streaming even on a quiet machine, where 300
    tokens could end before Ctrl-C arrived) is cut by
    Ctrl-C: the stream closes, the server frees the row long before the end,
    what came stays in the conversation marked interrupted. (The tiny model's
    random weights write <|endoftext|>, an end-of-generation token, within a few
    hundred tokens: here only <|im_end|> ends an answer.)"""
    tok = server.state.tokenizer
    monkeypatch.setattr(tok, "eos_token_ids", {tok.convert_tokens_to_ids("<|im_end|>")})
    for prompt in ("hello", "Write a poem about the sea.", "Tell me everything.", "Go on and on."):
        full = reference(server.url, [{"role": "user", "content": prompt}], "tiny", max_tokens=1500)
        total = full["usage"]["completion_tokens"]
        if total >= 1000:
            break
    assert total >= 1000, "no prompt gives a long enough answer to cut"
    answer = full["choices"][0]["message"]["content"]

    child = spawn("--url", server.url, "--max-tokens", 1500, "--temperature", 0, "--history",
                  tmp_path / "history", tmp_path=tmp_path)
    child.expect_exact("tiny> ")
    before = generated_tokens(server.url, "tiny")
    child.sendline(prompt)
    child.expect_exact(shown(prompt) + "\r\n" + shown(answer[:3]))
    # Hold the engine thread (no more tokens) until the interrupt is in, so
    # that the answer cannot end first on a busy machine.
    gate = threading.Event()
    held = server.engine.call(lambda: gate.wait(60))
    child.sendintr()  # Ctrl-C
    child.expect_exact(" [stopped]")
    gate.set()
    held.result(timeout=30)
    child.expect_exact("tiny> ")
    wait_until(lambda: server.state.active_sequences == 0, 10, "the cut answer's row to end")
    cut = generated_tokens(server.url, "tiny") - before
    assert 0 < cut < total, (cut, total)

    saved = tmp_path / "cut.json"
    child.sendline(f"/save {saved}")
    child.expect_exact("saved 2 messages")
    last = json.loads(saved.read_text())["messages"][-1]
    assert last["interrupted"] is True and answer.startswith(last["content"]) and len(last["content"]) < len(answer)
    child.expect_exact("tiny> ")
    child.sendintr()  # at the prompt: a fresh line, still in the chat
    child.expect_exact("tiny> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_in_process_server_started_and_stopped(server, tiny_model, adapters, tmp_path):
    """No --url: the chat serves --model/--adapter itself on 127.0.0.1 and
    stops it on exit. Its answers equal those of the test server, which
    serves the same model and adapter."""
    child = spawn("--model", tiny_model, "--adapter", f"a={adapters['a']}", "a", "--max-tokens", MAX_TOKENS,
                  "--temperature", 0, "--history", tmp_path / "history", tmp_path=tmp_path)
    child.expect(r"\[mola\] chatting with a at (http://127\.0\.0\.1:\d+)", timeout=120)
    url = child.match.group(1)
    child.expect_exact("a> ")
    chat = Conversation(child, server.url, "a")
    chat.ask("Where do rivers go?")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)


def test_an_unreachable_server_is_a_message(tmp_path):
    from helpers.servers import free_port

    child = spawn("--url", f"http://127.0.0.1:{free_port()}", tmp_path=tmp_path)
    child.expect_exact("[mola] error: cannot reach")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1 and "Traceback" not in child.before


def test_url_and_a_server_of_its_own_do_not_mix(tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "mola", "chat", "--url", "http://127.0.0.1:1", "--model", "m"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "with --url the server is already running" in r.stderr


def test_the_chat_server_of_its_own_takes_serve_flags():
    from mola.chat.command import serve_args
    from mola.cli import build_parser

    args = build_parser().parse_args(["chat", "upper", "--demo", "echo", "--max-lora-rank", "16"])
    assert serve_args(args) == ["--demo", "echo", "--max-lora-rank", "16"]
    assert serve_args(build_parser().parse_args(["chat"])) == []


def test_session_requests():
    s = Session(model="a", system="Be kind.", max_tokens=5)
    s.ask("hi")
    s.answered("hello")
    s.lora_scale = parse_scale("0.25")
    s.ask("again")
    assert s.request() == {"model": "a", "stream": True, "max_tokens": 5, "lora_scale": 0.25, "messages": [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]}
    assert (parse_scale("off"), parse_scale("on"), s.label) == (0.0, None, "a@0.25")
    for bad in ("nan", "inf", "x"):
        with pytest.raises(ValueError):
            parse_scale(bad)


def test_ctrl_c_during_a_command_leaves_the_chat_running(monkeypatch):
    """In process: a Ctrl-C that lands while a command runs (a slow /save, an
    /adapters call) gives a fresh line, as at the prompt; it does not end the chat."""
    import io

    from mola.chat.repl import Repl

    lines = iter(["/slow", "/quit"])
    seen = []

    def read(prompt):
        seen.append(prompt)
        return next(lines)

    def slow(arg):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", read)
    repl = Repl(client=None, session=Session(model="tiny"), out=io.StringIO(), err=io.StringIO())
    repl.commands["/slow"] = slow
    assert repl.loop() == 0
    assert seen == ["tiny> ", "tiny> "]  # the prompt came back after the interrupted command
