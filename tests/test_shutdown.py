"""SIGTERM: stop taking new work, let running requests finish, exit 0
(mola/serve.py), with `mola serve` as a separate process on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from helpers import free_port


def test_sigterm_drains_running_requests_then_exits_zero(tiny_model):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mola", "serve", "--model", str(tiny_model), "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        body = {"model": tiny_model.name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 600, "ignore_eos": True, "stream": True}
        events: list = []

        def stream():
            with httpx.Client(timeout=60) as c:
                with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])

        t = threading.Thread(target=stream)
        t.start()
        while len(events) < 3:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # no new work: refused connection, or 503 while draining
            r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=5)
            assert r.status_code == 503
        except httpx.HTTPError:
            pass
        t.join(timeout=60)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text  # the running request finished in full despite the SIGTERM
    assert "shutting down" in out
