"""The teacher: a local model with the system prompt (the base itself, or
--teacher), or any OpenAI-compatible server (--teacher-url). Either answers
questions in the student's tokens; a local one also gives its distributions."""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..errors import DistillError
from .generate import Generated, generate

REMOTE_CONCURRENCY = 8  # requests in flight to a --teacher-url


def chat_messages(system: str | None, question: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": question}]


def prompt_tokens(tokenizer, system: str | None, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template(chat_messages(system, question), add_generation_prompt=True))


def end_of_turn(tokenizer) -> int:
    """The token the chat template ends an assistant turn with (one of the
    model's end-of-generation tokens), else the tokenizer's EOS."""
    head = prompt_tokens(tokenizer, None, "a")
    full = list(tokenizer.apply_chat_template(chat_messages(None, "a") + [{"role": "assistant", "content": "b"}]))
    tail = full[len(head):] if full[:len(head)] == head else []
    content = list(tokenizer.encode("b", add_special_tokens=False))
    if tail[:len(content)] == content and len(tail) > len(content) and tail[len(content)] in tokenizer.eos_token_ids:
        return tail[len(content)]
    return tokenizer.eos_token_id


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


@contextlib.contextmanager
def without_adapter(model):
    """The model as its base: every mlx-lm LoRA layer's scale 0 for the while."""
    layers = [m for _, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "scale")]
    scales = [m.scale for m in layers]
    try:
        for m in layers:
            m.scale = 0.0
        yield model
    finally:
        for m, s in zip(layers, scales):
            m.scale = s


class LocalTeacher:
    """A local model with the system prompt. ``is_student_base``: it is the
    student's own base model, whose LoRA layers are turned off while it teaches."""

    def __init__(self, model, tokenizer, system: str | None, student_tokenizer, is_student_base: bool,
                 context: int | None = None):
        self.model = model
        self.context = context  # the model's context length, when it declares one
        self.tokenizer = tokenizer
        self.system = system
        self.student_tokenizer = student_tokenizer
        self.is_student_base = is_student_base
        self.same_tokenizer = is_student_base or same_tokenizer(tokenizer, student_tokenizer)

    def weights(self):
        return without_adapter(self.model) if self.is_student_base else contextlib.nullcontext()

    def prompt(self, question: str) -> list[int]:
        return prompt_tokens(self.tokenizer, self.system, question)

    def answers(self, questions: list[str], *, max_tokens: int, temperature: float, seed: int, top_k: int = 0,
                log: Callable[[str], None] | None = None, what: str = "the teacher's answers") -> list[Generated]:
        """Answers in the student's tokens (top-k distributions only with the same tokenizer)."""
        with self.weights():
            out = generate(self.model, self.tokenizer, [self.prompt(q) for q in questions], max_tokens=max_tokens,
                           temperature=temperature, seed=seed, top_k=top_k if self.same_tokenizer else 0,
                           log=log, what=what)
        if self.same_tokenizer:
            return out
        eos = set(self.tokenizer.eos_token_ids)
        texts = [self.tokenizer.decode([t for t in g.tokens if t not in eos]) for g in out]
        return [retokenize(self.student_tokenizer, text, g.stopped) for text, g in zip(texts, out)]

    def texts(self, requests: list[str], *, max_tokens: int, temperature: float, seed: int) -> list[str]:
        eos = set(self.tokenizer.eos_token_ids)
        with self.weights():
            out = generate(self.model, self.tokenizer, [self.prompt(r) for r in requests], max_tokens=max_tokens,
                           temperature=temperature, seed=seed)
        return [self.tokenizer.decode([t for t in g.tokens if t not in eos]) for g in out]


def retokenize(tokenizer, text: str, stopped: bool) -> Generated:
    """A text answer in ``tokenizer``'s tokens, its end-of-turn token last when it stopped."""
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    return Generated(tokens=tokens + ([end_of_turn(tokenizer)] if stopped else []), stopped=stopped)


class RemoteTeacher:
    """An OpenAI-compatible server (POST URL/v1/chat/completions) with the system prompt."""

    def __init__(self, url: str, model: str, system: str | None, student_tokenizer, api_key: str | None = None,
                 timeout: float = 300.0):
        self.url = url.rstrip("/")
        self.model_id = model
        self.system = system
        self.student_tokenizer = student_tokenizer
        self.api_key = api_key
        self.timeout = timeout

    def complete(self, question: str, max_tokens: int, temperature: float, seed: int) -> tuple[str, bool]:
        """(the answer's text, whether it ended by itself)."""
        import urllib.error
        import urllib.request

        endpoint = self.url + ("/chat/completions" if self.url.endswith("/v1") else "/v1/chat/completions")
        body = {"model": self.model_id, "messages": chat_messages(self.system, question),
                "max_tokens": max_tokens, "temperature": temperature, "seed": seed}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(endpoint, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                choice = json.loads(response.read())["choices"][0]
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except Exception:
                message = e.reason
            raise DistillError(f"the teacher at {endpoint} refused a request: HTTP {e.code}: {message}") from None
        except (urllib.error.URLError, OSError) as e:
            raise DistillError(f"the teacher at {endpoint} could not be reached: {getattr(e, 'reason', e)}") from None
        except (KeyError, IndexError, ValueError):
            raise DistillError(f"the teacher at {endpoint} did not answer as an OpenAI-compatible server") from None
        return choice["message"].get("content") or "", choice.get("finish_reason") == "stop"

    def _map(self, questions, max_tokens, temperature, seed, log, what) -> list[tuple[str, bool]]:
        with ThreadPoolExecutor(REMOTE_CONCURRENCY) as pool:
            futures = [pool.submit(self.complete, q, max_tokens, temperature, seed + i)
                       for i, q in enumerate(questions)]
            out = []
            for i, f in enumerate(futures, start=1):
                out.append(f.result())
                if log and (i % 64 == 0 or i == len(futures)):
                    log(f"[mola] {what}: {i}/{len(futures)}")
            return out

    def answers(self, questions: list[str], *, max_tokens: int, temperature: float, seed: int, top_k: int = 0,
                log: Callable[[str], None] | None = None, what: str = "the teacher's answers") -> list[Generated]:
        return [retokenize(self.student_tokenizer, text, stopped)
                for text, stopped in self._map(questions, max_tokens, temperature, seed, log, what)]

    def texts(self, requests: list[str], *, max_tokens: int, temperature: float, seed: int) -> list[str]:
        return [text for text, _ in self._map(requests, max_tokens, temperature, seed, None, "")]
