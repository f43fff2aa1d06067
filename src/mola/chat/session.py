"""One conversation: what was said, to which model id, at which adapter
strength. Plain data; the REPL changes it and the client sends it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Session:
    model: str  # the model id the next answer comes from: the base or an adapter
    lora_scale: float | None = None  # None: the adapter's own strength; 0: the base
    system: str | None = None  # the system prompt, sent first
    max_tokens: int | None = None
    temperature: float | None = None
    # user and assistant messages; an assistant message also records the
    # model id and lora_scale that answered (and "interrupted" when Ctrl-C cut it)
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        """The conversation as OpenAI chat messages."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": t["role"], "content": t["content"]} for t in self.turns]

    def request(self) -> dict:
        """The body of the next chat completion (streamed)."""
        body = {"model": self.model, "messages": self.messages(), "stream": True}
        for key in ("lora_scale", "max_tokens", "temperature"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return body

    def ask(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})

    def answered(self, text: str, interrupted: bool = False) -> None:
        turn = {"role": "assistant", "content": text, "model": self.model}
        if self.lora_scale is not None:
            turn["lora_scale"] = self.lora_scale
        if interrupted:
            turn["interrupted"] = True
        self.turns.append(turn)

    def unask(self) -> None:
        """Drop the last question (it got no answer)."""
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()

    def reset(self) -> None:
        """Forget what was said (the system prompt, model and scale stay)."""
        self.turns.clear()

    @property
    def label(self) -> str:
        """The prompt's name for the model and scale: ``upper``, ``upper@0.5``."""
        return self.model if self.lora_scale is None else f"{self.model}@{self.lora_scale:g}"

    def to_json(self) -> dict:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return {"model": self.model, "lora_scale": self.lora_scale, "messages": head + list(self.turns)}

    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        path.write_text(json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return path


def parse_scale(arg: str) -> float | None:
    """``/adapter`` argument -> lora_scale: off = 0, on = None (the adapter's
    own strength), or a number; ValueError otherwise."""
    word = arg.strip().lower()
    if word == "off":
        return 0.0
    if word == "on":
        return None
    try:
        value = float(word)
    except ValueError:
        raise ValueError(f"/adapter takes off, on or a number, not {arg.strip()!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"/adapter takes a finite number, not {arg.strip()!r}")
    return value
