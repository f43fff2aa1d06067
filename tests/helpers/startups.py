"""Counting what a test file starts (MOLA_COUNT_STARTS=1 python -m pytest):
engines (each loads a model: in-process servers, EngineRunners, the shared
fixtures) and subprocesses (`mola serve`, `mola train`, `mlx.launch`...), per file, printed at the end of the run
and written to $MOLA_COUNT_STARTS_FILE as JSON when that is set. A pytest
plugin, registered by tests/conftest.py."""

from __future__ import annotations

import collections
import json
import os

import pytest

ENABLED = bool(os.environ.get("MOLA_COUNT_STARTS"))
_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_current = ["(collection)"]


def _counting(owner, name: str, kind: str):
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        _counts[_current[0]][kind] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


if ENABLED:
    from mola.engine.engine import Engine

    import helpers.servers

    _counting(Engine, "start", "engines")
    _counting(helpers.servers.subprocess, "Popen", "subprocesses")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current[0] = item.nodeid.split("::")[0]


def pytest_terminal_summary(terminalreporter):
    if not ENABLED:
        return
    rows = sorted(_counts.items(), key=lambda kv: -sum(kv[1].values()))
    terminalreporter.write_sep("=", "engines and processes started, per file")
    for path, c in rows:
        terminalreporter.write_line(f"{c['engines']:4d} engines {c['subprocesses']:4d} subprocesses  {path}")
    if os.environ.get("MOLA_COUNT_STARTS_FILE"):
        with open(os.environ["MOLA_COUNT_STARTS_FILE"], "w") as f:
            json.dump({p: dict(c) for p, c in rows}, f, indent=1)
