"""The loop a person types in. Lines are read with the standard library's
readline (editing, and a history kept in ``chat_history`` under mola's cache
directory); a line that starts with ``/`` is a command, anything else is the
next question, whose answer streams as it decodes.

Ctrl-C while an answer streams stops it (the connection closes and the server
frees the row; what came so far stays in the conversation, marked
interrupted); at the prompt it clears the line. Ctrl-D (or /quit) leaves."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from .client import ChatClient, ServerError
from .session import Session, parse_scale

HELP = """\
/model ID          answer with another model id (a base model or an adapter, of any base the server
                   serves); the conversation stays
/adapter off|on|X  the adapter's strength for this chat (lora_scale): off = 0 (the base model's
                   answer), on = the adapter's own, X = a number such as 0.5
/adapters          list the model ids the server offers
/system TEXT       set the system prompt (/system alone removes it)
/reset             forget the conversation (the system prompt, model and strength stay)
/save FILE         write the conversation to FILE as JSON
/context           how much of the model's context the conversation fills (its prompt tokens)
/help              this list, and /context
/quit              leave (as Ctrl-D does); Ctrl-C stops an answer"""


def _history_file() -> Path:
    from ..cache import default_cache_dir

    return default_cache_dir() / "chat_history"


def _readline(history: Path | None):
    """readline when the standard library has it (line editing, history)."""
    try:
        import readline
    except ImportError:  # Windows without pyreadline: plain input()
        return None
    if history is not None:
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
            readline.read_history_file(history)
        except OSError:
            pass
    readline.set_history_length(1000)
    return readline


class Repl:
    def __init__(self, client: ChatClient, session: Session, out=sys.stdout, err=sys.stderr):
        self.client = client
        self.session = session
        self.out = out
        self.err = err
        self.commands: dict[str, Callable[[str], bool]] = {
            "/model": self.model, "/adapter": self.adapter, "/adapters": self.adapters,
            "/system": self.system, "/reset": self.reset, "/save": self.save, "/help": self.help,
            "/context": self.context,
            "/quit": lambda arg: False, "/exit": lambda arg: False,
        }

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def error(self, text: str) -> None:
        print(f"error: {text}", file=self.err, flush=True)

    def loop(self) -> int:
        while True:
            try:
                if not self.step():
                    return 0
            except KeyboardInterrupt:  # at the prompt, or during a command: a fresh line
                self.say("")

    def step(self) -> bool:
        """Read one line and act on it; False to leave."""
        try:
            line = input(f"{self.session.label}> ").strip()
        except EOFError:  # Ctrl-D
            self.say("")
            return False
        if not line:
            return True
        if line.startswith("/"):
            name, _, arg = line.partition(" ")
            command = self.commands.get(name)
            if command is None:
                self.error(f"unknown command {name}; /help lists them")
                return True
            return command(arg.strip())
        self.answer(line)
        return True

    def answer(self, text: str) -> None:
        session = self.session
        session.ask(text)
        pieces: list[str] = []
        try:
            for piece in self.client.stream(session.request()):
                pieces.append(piece)
                print(piece, end="", file=self.out, flush=True)
        except KeyboardInterrupt:
            self.say(" [stopped]")
            if pieces:
                session.answered("".join(pieces), interrupted=True)
            else:
                session.unask()
            return
        except ServerError as e:
            if pieces:
                self.say("")
            self.error(e.message)
            session.unask()
            return
        self.say("")
        session.answered("".join(pieces))

    # ---- commands: each returns False to leave -------------------------------------

    def model(self, arg: str) -> bool:
        if not arg:
            self.say(f"talking to {self.session.model}; /model ID switches (/adapters lists them)")
            return True
        try:
            card = self.client.card(arg)
            base = card if card is None or card.get("parent") is None else self.client.card(card["parent"])
            before = self.client.card(self.session.model) if card is not None else None
        except ServerError as e:
            self.error(e.message)
            return True
        self.session.model = arg
        self.say(f"now talking to {arg}{_describe(card, base, before)}; the conversation goes on")
        return True

    def adapter(self, arg: str) -> bool:
        try:
            self.session.lora_scale = parse_scale(arg)
        except ValueError as e:
            self.error(str(e))
            return True
        scale = self.session.lora_scale
        self.say("the adapter at its own strength" if scale is None else f"lora_scale {scale:g}")
        return True

    def adapters(self, arg: str) -> bool:
        try:
            cards = self.client.models()
        except ServerError as e:
            self.error(e.message)
            return True
        several = sum(card.get("parent") is None for card in cards) > 1
        for card in cards:
            mark = "*" if card["id"] == self.session.model else " "
            if card.get("parent") is not None:
                kind = f"adapter on {card['parent']}"
            else:
                kind = "base model" + (f", {card['status']}" if several and card.get("status") else "")
            self.say(f"{mark} {card['id']}  ({kind})")
        return True

    def system(self, arg: str) -> bool:
        self.session.system = arg or None
        self.say("system prompt set" if arg else "system prompt removed")
        return True

    def reset(self, arg: str) -> bool:
        self.session.reset()
        self.say("conversation cleared")
        return True

    def save(self, arg: str) -> bool:
        if not arg:
            self.error("/save takes a file name")
            return True
        try:
            path = self.session.save(arg)
        except OSError as e:
            self.error(f"cannot write {arg}: {e.strerror or e}")
            return True
        self.say(f"saved {len(self.session.turns)} messages to {path}")
        return True

    def context(self, arg: str) -> bool:
        """``[123 / 2048 tokens]``: the conversation as the next question's prompt
        (without it), counted by the server's /tokenize."""
        try:
            count, limit = self.client.context_use(self.session.model, self.session.messages())
        except ServerError as e:
            self.error(f"cannot count the context: {e.message}")
            return True
        self.say(f"[{count} / {limit} tokens]" if limit else f"[{count} tokens]")
        return True

    def help(self, arg: str) -> bool:
        self.say(HELP)
        return self.context(arg)


def _base(card: dict | None) -> str | None:
    return None if card is None else card.get("parent") or card["id"]


def _describe(card: dict | None, base: dict | None, before: dict | None) -> str:
    """What /model says of the model it switches to (``base``: its base's
    card): unlisted, or on another base than the one before, loaded or not."""
    if card is None:
        return " (the server does not list it; a resolver may still find it)"
    if before is None or base is None or _base(before) == base["id"]:
        return ""
    state = "" if base.get("status", "loaded") == "loaded" else ", not loaded yet: its first answer loads it"
    what = "another base model" if card is base else f"an adapter on another base model, {base['id']}"
    return f" ({what}{state})"


def run_chat(client: ChatClient, session: Session, history: Path | None = None) -> int:
    """The interactive chat; its exit status."""
    readline = _readline(history if history is not None else _history_file())
    try:
        return Repl(client, session).loop()
    finally:
        if readline is not None:
            try:
                readline.write_history_file(history if history is not None else _history_file())
            except OSError:
                pass
