"""SIGTERM: stop taking new work, let running requests finish, exit 0
(mola/serve.py), with `mola serve` as a separate process on 127.0.0.1: one
base, and two bases (every engine drains)."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from helpers.servers import start_mola_serve
from mola.testing.model import TinyModelSpec, make_tiny_model


def test_sigterm_drains_running_requests_then_exits_zero(tiny_model):
    drains(["--model", str(tiny_model)], [tiny_model.name])


def test_sigterm_drains_every_base(tiny_model, tmp_path):
    """Two bases, a request running on each: both finish in full."""
    other = make_tiny_model(tmp_path / "other", TinyModelSpec(hidden_size=96, intermediate_size=160, seed=5))
    drains(["--model", str(tiny_model), "--model", f"other={other}"], [tiny_model.name, "other"])


def drains(args: list[str], models: list[str]) -> None:
    """A request streaming on each of ``models``, SIGTERM: each finishes, the process exits 0."""
    proc, url = start_mola_serve(args)
    said, lines = threading.Event(), []  # mola's output; ``said`` once it is shutting down

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "shutting down" in line:
                said.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        bodies = [{"model": m, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 600, "ignore_eos": True, "stream": True} for m in models]
        events: list[list] = [[] for _ in models]
        streaming = [threading.Event() for _ in models]  # three chunks have come: the request runs

        def stream(i):
            with httpx.Client(timeout=60) as c:
                with c.stream("POST", url + "/v1/chat/completions", json=bodies[i]) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events[i].append(line[6:])
                            if len(events[i]) >= 3:
                                streaming[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(models))]
        for t in threads:
            t.start()
        for i, running in enumerate(streaming):
            assert running.wait(60), events[i]
        proc.send_signal(signal.SIGTERM)
        assert said.wait(30), "".join(lines)
        try:  # no new work: refused connection, or 503 while draining
            r = httpx.post(url + "/v1/chat/completions", json={**bodies[0], "stream": False}, timeout=5)
            assert r.status_code == 503
        except httpx.HTTPError:
            pass
        for t in threads:
            t.join(timeout=60)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out
    for model, got in zip(models, events):
        assert got[-1] == "[DONE]", model
        chunks = [json.loads(e) for e in got[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length", model
        usage = [c["usage"] for c in chunks if c.get("usage")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text, model  # the running request finished in full despite the SIGTERM
        assert not usage or usage[-1]["completion_tokens"] == 600, model
