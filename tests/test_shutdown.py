"""SIGTERM: stop taking new work, let running requests finish, exit 0
(mola/serve.py), with `mola serve` as a separate process on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from helpers import start_mola_serve


def test_sigterm_drains_running_requests_then_exits_zero(tiny_model):
    proc, url = start_mola_serve(["--model", str(tiny_model)])
    said, lines = threading.Event(), []  # mola's output; ``said`` once it is shutting down

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "shutting down" in line:
                said.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        body = {"model": tiny_model.name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 600, "ignore_eos": True, "stream": True}
        events: list = []
        streaming = threading.Event()  # three chunks have come: the request runs

        def stream():
            with httpx.Client(timeout=60) as c:
                with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) >= 3:
                                streaming.set()

        t = threading.Thread(target=stream)
        t.start()
        assert streaming.wait(60), events
        proc.send_signal(signal.SIGTERM)
        assert said.wait(30), "".join(lines)
        try:  # no new work: refused connection, or 503 while draining
            r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=5)
            assert r.status_code == 503
        except httpx.HTTPError:
            pass
        t.join(timeout=60)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text  # the running request finished in full despite the SIGTERM
