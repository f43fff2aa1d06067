"""mola/blas.py: which BLAS the CPU's matmuls run on, what mola says at start
when it is MLX's slow reference BLAS, and what /health and /metrics report."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mola import blas


@pytest.mark.parametrize("env, platform, on_cpu, want", [
    ({}, "linux", False, "gpu"),
    ({}, "darwin", True, "accelerate"),
    ({blas.MARKER: "/usr/lib/libopenblas.so.0"}, "linux", True, "openblas"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"}, "linux", True, "openblas"),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so"}, "linux", True, "reference"),
    ({}, "linux", True, "reference"),
])
def test_blas_in_use(monkeypatch, env, platform, on_cpu, want):
    for key in (blas.MARKER, "LD_PRELOAD"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "platform", platform)
    assert blas.blas_in_use(on_cpu=on_cpu) == want


def run_reexec(env: dict, enabled: bool = True) -> subprocess.CompletedProcess:
    """maybe_reexec_with_openblas in a child process (it may print, and with
    OpenBLAS found and enabled it would re-execute: these calls never let it)."""
    code = ("import sys; from mola import blas; "
            f"blas.maybe_reexec_with_openblas(['--help'], enabled={enabled}); print('returned')")
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.MARKER, blas.ENV_SWITCH)}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(sys.platform != "linux", reason="the reference BLAS is MLX's Linux wheel's")
def test_the_slow_blas_is_named_with_the_way_out():
    r = run_reexec({blas.ENV_SWITCH: "0"})
    assert r.returncode == 0 and "returned" in r.stdout
    assert "reference BLAS bundled with MLX's Linux wheel" in r.stderr
    if blas.find_openblas():
        assert f"{blas.ENV_SWITCH}=0" in r.stderr  # it is there, only switched off
    else:
        assert "apt-get install libopenblas0-pthread" in r.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS preloading is for Linux")
def test_preloaded_openblas_says_so_and_stays_quiet_about_the_slow_one():
    r = run_reexec({blas.MARKER: "/some/libopenblas.so", "LD_PRELOAD": ""})
    assert "CPU matmuls use OpenBLAS (/some/libopenblas.so)" in r.stderr
    assert "reference BLAS" not in r.stderr


def test_health_and_metrics_name_the_blas(server):
    import httpx

    health = httpx.get(server.url + "/health", timeout=30).json()
    assert {k: health[k] for k in ("status", "blas")} == {"status": "ok", "blas": blas.blas_in_use()}
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert f'mola_blas{{blas="{health["blas"]}"}} 1.0' in metrics
