"""Token ids -> text deltas for one choice, with stop strings.

Stop strings are matched on the decoded text, so they are found across token
boundaries; the matched string and everything after it is never emitted. Text
that could still turn out to be the start of a stop string is held back until
it is decided. Tokens in ``skip`` (special tokens under skip_special_tokens, and
the token that ends the output) add no text.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip: frozenset[int] = frozenset()):
        self._detok = tokenizer.detokenizer  # mlx-lm's streaming detokenizer
        self._skip = skip  # token ids that add no text (special tokens, the one that ends the output)
        self._stop = [s for s in (stop or []) if s]
        self._longest = max((len(s) for s in self._stop), default=0)
        self._pending = ""  # decoded, not yet emitted (may start a stop string)
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found
        self.stop_string: str | None = None  # which one (the earliest in the text)

    def add(self, tokens: list[int]) -> str:
        """Feed new tokens; returns the text that is safe to emit now."""
        if self.stopped:
            return ""
        for t in tokens:
            if t not in self._skip:
                self._detok.add_token(t)
        self._pending += self._detok.last_segment
        return self._release(final=False)

    def finish(self) -> str:
        """No more tokens: flush what the detokenizer and the hold-back keep."""
        if self.stopped:
            return ""
        self._detok.finalize()
        self._pending += self._detok.last_segment
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self._stop:
            out, self._pending = self._pending, ""
            self.text += out
            return out
        cut = self._find_stop()
        if cut is not None:
            self.stop_string = min((s for s in self._stop if self._pending.find(s) == cut), key=len)
            out = self._pending[:cut]
            self._pending = ""
            self.stopped = True
        elif final:
            out, self._pending = self._pending, ""
        else:
            keep = self._partial_stop_len()
            out = self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(out):]
        self.text += out
        return out

    def _find_stop(self) -> int | None:
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of pending text that begins a stop string."""
        tail = self._pending[-self._longest:]
        for n in range(min(len(tail), self._longest), 0, -1):
            piece = tail[-n:]
            if any(s.startswith(piece) for s in self._stop):
                return n
        return 0
