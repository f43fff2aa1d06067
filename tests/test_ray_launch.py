"""Ray's start-up, bounded (mola/ray/launch.py): a stalled ``ray.init`` is
given up after its timeout, a failing one is retried, and the error names
what each try did; a start that succeeds late in its tries returns. Ray
itself is replaced by a stand-in module (its ``init`` and ``shutdown``), so
this runs in the fast tier with or without Ray installed."""

from __future__ import annotations

import threading
import types

import pytest

from mola.ray.launch import RayStart, RayStartFailed, start_ray


def fake_ray(monkeypatch, outcomes: list):
    """``ray`` whose init does, try by try, what ``outcomes`` says: "ok",
    "stall" (blocks until the test ends) or an exception to raise."""
    calls = {"init": 0, "shutdown": 0}
    release = threading.Event()

    def init(address=None, **kwargs):
        outcome = outcomes[calls["init"]]
        calls["init"] += 1
        if outcome == "stall":
            release.wait()
        elif isinstance(outcome, BaseException):
            raise outcome

    def shutdown():
        calls["shutdown"] += 1

    monkeypatch.setitem(__import__("sys").modules, "ray", types.SimpleNamespace(init=init, shutdown=shutdown))
    return calls, release


def test_stalls_and_failures_are_bounded_and_named(monkeypatch):
    calls, release = fake_ray(monkeypatch, ["stall", ConnectionError("GCS gone"), "stall"])
    try:
        with pytest.raises(RayStartFailed) as e:
            start_ray(RayStart(attempts=3, timeout=0.2))
    finally:
        release.set()
    message = str(e.value)
    assert "try 1: no answer within 0.2 s" in message
    assert "try 2: ConnectionError('GCS gone')" in message
    assert "try 3: no answer within 0.2 s" in message
    assert calls == {"init": 3, "shutdown": 3}


def test_a_later_try_that_starts_returns(monkeypatch):
    calls, release = fake_ray(monkeypatch, [RuntimeError("timed out"), "ok"])
    try:
        assert start_ray(RayStart(attempts=3, timeout=5)) >= 0
    finally:
        release.set()
    assert calls == {"init": 2, "shutdown": 1}


@pytest.mark.parametrize("bad", [dict(attempts=0), dict(timeout=0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="attempts"):
        RayStart(**bad)


def folder_named_ray() -> types.ModuleType:
    """What a `ray` folder in the working directory imports as: a namespace package with no serve in it."""
    module = types.ModuleType("ray")
    module.__path__ = []
    return module


@pytest.mark.parametrize("ray_module", [None, folder_named_ray()], ids=["not installed", "a folder in the way"])
def test_replicas_without_ray_serve_is_a_message(monkeypatch, capsys, ray_module):
    from mola.config import ServeConfig
    from mola.ray.command import serve_replicas

    import sys

    monkeypatch.setitem(sys.modules, "ray", ray_module)
    monkeypatch.setitem(sys.modules, "ray.serve", None)  # even where another test imported it
    assert serve_replicas(ServeConfig(model="unused"), 2) == 1
    assert "--replicas needs Ray Serve: pip install 'mola[ray]'" in capsys.readouterr().err
