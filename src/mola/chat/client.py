"""The chat's side of the HTTP API: streamed chat completions (SSE read with
httpx as they arrive) and the model list. Every failure is a ServerError
carrying the server's own message (OpenAI's error envelope), or what went
wrong with the connection; never a traceback."""

from __future__ import annotations

import json
from typing import Iterator
from urllib.parse import quote

import httpx


class ServerError(Exception):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status


def _message(response: httpx.Response) -> str:
    """The server's error message, from OpenAI's envelope when there is one."""
    try:
        return response.json()["error"]["message"]
    except Exception:
        return f"HTTP {response.status_code}: {response.text[:200] or response.reason_phrase}"


class ChatClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A long prompt may take a while to prefill: no read deadline shorter than that.
        self.http = httpx.Client(base_url=self.url, headers=headers,
                                 timeout=httpx.Timeout(timeout, connect=10.0))

    def close(self) -> None:
        self.http.close()

    def _get(self, path: str) -> dict:
        try:
            r = self.http.get(path)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.url}: {e}") from None
        if r.status_code != 200:
            raise ServerError(_message(r), r.status_code)
        return r.json()

    def models(self) -> list[dict]:
        """The model cards the server lists: the base (parent None), then adapters."""
        return self._get("/v1/models")["data"]

    def card(self, model_id: str) -> dict | None:
        """The server's card for ``model_id`` (None: it does not list it)."""
        try:
            return self._get(f"/v1/models/{quote(model_id, safe='/')}")
        except ServerError as e:
            if e.status == 404:
                return None
            raise

    def context_use(self, model: str, messages: list[dict]) -> tuple[int, int | None]:
        """(tokens, the model's context length or None): the conversation with
        the generation prompt, as vLLM's /tokenize counts it (0 before anything is said)."""
        if not messages:  # no template renders an empty conversation
            return 0, self._get(f"/v1/models/{quote(model, safe='/')}").get("max_model_len")
        body = {"model": model, "messages": messages, "add_generation_prompt": True}
        try:
            r = self.http.post("/tokenize", json=body)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach {self.url}: {e}") from None
        if r.status_code != 200:
            raise ServerError(_message(r), r.status_code)
        counted = r.json()
        return counted["count"], counted.get("max_model_len")

    def stream(self, body: dict) -> Iterator[str]:
        """The answer's text as it decodes. Leaving the loop early (Ctrl-C)
        closes the connection, which makes the server free the row."""
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise ServerError(_message(r), r.status_code)
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:  # failed mid-stream
                        raise ServerError(event["error"].get("message", str(event["error"])))
                    for choice in event.get("choices", ()):
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            yield text
        except httpx.HTTPError as e:
            raise ServerError(f"the connection to {self.url} failed: {e}") from None
