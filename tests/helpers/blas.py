"""OpenBLAS for the test process: MLX's CPU matmuls run on it, as they do
under `mola serve` (mola/blas.py re-executes mola with it preloaded, about
20x the float32 GEMM of the reference BLAS bundled in MLX's Linux wheel).
The test process loads it itself, before MLX loads, and puts it in
LD_PRELOAD for the processes it starts (`mola serve`, `mola train`), which
then need no re-execution of their own. ``MOLA_OPENBLAS=0`` keeps the
reference BLAS, whose products do not depend on a batch's shape: the tests
that check bit-identical results there (test_kv_bits, test_images,
test_models_gguf_moe) check them within the last bits on OpenBLAS, and
.ci/run runs them again on the reference BLAS."""

from __future__ import annotations

import ctypes
import os
import sys

from mola.blas import ENV_SWITCH, blas_in_use, find_openblas


def preload_openblas() -> str | None:
    """Load OpenBLAS into this process (the path, or None where it is not
    there, switched off, or MLX has loaded its BLAS already)."""
    if sys.platform != "linux" or os.environ.get(ENV_SWITCH) == "0" or blas_in_use(on_cpu=True) != "reference":
        return None
    if "mlx.core" in sys.modules:  # too late: MLX has bound its BLAS's symbols
        return None
    lib = find_openblas()
    if lib is None:
        return None
    # One thread (read when the library loads): the tests' models are small, the test process runs an
    # engine thread beside the event loop's, and a second BLAS thread spins more than it computes
    # (nine of the slowest files: 55 s on one thread, 70 s on two, 100 s on the reference BLAS).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)  # its symbols come before those of MLX's own libblas
    os.environ["LD_PRELOAD"] = ":".join(p for p in (lib, os.environ.get("LD_PRELOAD")) if p)
    return lib
