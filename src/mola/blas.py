"""OpenBLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheel bundles a reference BLAS (float32 GEMM at ~5 GFLOP/s on
a 2-core machine). When the system has OpenBLAS (Debian: libopenblas0-pthread),
mola re-executes itself once with it preloaded (~150 GFLOP/s there, about 20x
decode throughput at batch 32). It says so at start-up; ``--no-openblas`` or
``MOLA_OPENBLAS=0`` turns it off. Nothing changes on macOS or on a GPU.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

ENV_SWITCH = "MOLA_OPENBLAS"  # "0": never preload
MARKER = "MOLA_OPENBLAS_ACTIVE"  # set in the re-executed process

CANDIDATES = [
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
]


def find_openblas() -> str | None:
    arch = platform.machine()
    for pattern in CANDIDATES:
        path = pattern.format(arch=arch)
        if Path(path).exists():
            return path
    return None


def runs_on_cpu() -> bool:
    try:
        import mlx.core as mx

        return mx.default_device() == mx.cpu
    except Exception:
        return False


def blas_in_use(on_cpu: bool | None = None) -> str:
    """What MLX's CPU matmuls run on: "openblas" (preloaded), "reference"
    (the BLAS bundled in MLX's Linux wheel, ~30x slower), "accelerate"
    (macOS), or "gpu" when MLX computes on a GPU."""
    if not (runs_on_cpu() if on_cpu is None else on_cpu):
        return "gpu"
    if sys.platform == "darwin":
        return "accelerate"
    if os.environ.get(MARKER) or "openblas" in os.environ.get("LD_PRELOAD", ""):
        return "openblas"
    return "reference"


SLOW_BLAS = ("[mola] warning: CPU matmuls run on the reference BLAS bundled with MLX's Linux wheel, "
             "about 30x slower than OpenBLAS. {how}")


def maybe_reexec_with_openblas(argv: list[str], enabled: bool = True) -> None:
    """Re-execute ``python -m mola argv`` with OpenBLAS preloaded when that
    helps and has not happened yet; returns if it does not apply, saying so
    when the CPU's matmuls stay on the slow reference BLAS."""
    if os.environ.get(MARKER):
        print(f"[mola] CPU matmuls use OpenBLAS ({os.environ[MARKER]}); "
              "--no-openblas turns this off", file=sys.stderr, flush=True)
        return
    if sys.platform != "linux" or blas_in_use() != "reference":
        return
    lib = find_openblas()
    if not enabled or os.environ.get(ENV_SWITCH) == "0":
        how = f"{lib} is there: drop --no-openblas / {ENV_SWITCH}=0 to use it." if lib else ""
        print(SLOW_BLAS.format(how=how).rstrip(), file=sys.stderr, flush=True)
        return
    if lib is None:
        how = ("Install OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread) and mola "
               "preloads it at start.")
        print(SLOW_BLAS.format(how=how), file=sys.stderr, flush=True)
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD")) if p)
    env[MARKER] = lib
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "mola", *argv], env)
