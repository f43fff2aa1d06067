"""Shared fixtures: tiny models and adapters built offline into tmp dirs, real
mola servers on 127.0.0.1 and HTTP clients of them, and engines without a
server (one with the adapters in slots, one for the registry's tests)."""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
if "MOLA_GGUF_CACHE" not in os.environ:  # GGUF conversions cached per session, never in ~/.cache/mola
    import tempfile

    os.environ["MOLA_GGUF_CACHE"] = SESSION_GGUF_CACHE = tempfile.mkdtemp(prefix="mola-test-gguf-cache-")
    # the twins' entries (KBs to MBs), not the real model's (113 MiB kept, 540 float32): no test waits on those
    os.environ.setdefault("MOLA_GGUF_CACHE_BYTES", "64MiB")
else:
    SESSION_GGUF_CACHE = None

from helpers.blas import preload_openblas  # noqa: E402 (before MLX loads)

preload_openblas()

import httpx
import mlx.core as mx
import pytest

from mola.config import AdapterSpec
from mola.engine.engine import Engine, EngineConfig
from mola.models.loader import load_base_model
from mola.testing.adapter import make_random_adapter
from mola.testing.model import TinyModelSpec, make_tiny_model

from helpers.engines import EngineRunner
from helpers.servers import ServerHandle, start_server
from helpers.startups import pytest_runtest_setup, pytest_terminal_summary  # noqa: F401 (hooks: MOLA_COUNT_STARTS=1)

# Adapters of the shared tiny model: different ranks, targets and layers.
ADAPTER_SPECS = {
    "a": dict(rank=4, keys=("self_attn.q_proj", "self_attn.v_proj"), seed=1),
    "b": dict(rank=8, keys=("self_attn.q_proj", "mlp.down_proj"), num_layers=1, seed=2),
    "c": dict(
        rank=16,
        keys=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
        seed=3, scale=1.0,
    ),
}


TEMPLATE_DATE = (2026, 12, 1)  # the day chat templates see (below)


@pytest.fixture(scope="session", autouse=True)
def fixed_template_date():
    """Chat templates that print today's date (gpt-oss's harmony: "Current
    date: ...", through transformers' strftime_now) see TEMPLATE_DATE, so
    that a prompt, and what a random model answers to it, is the same on
    every day. (In-process servers only: a `mola serve` process sees the day.)"""
    from datetime import datetime

    import transformers.utils.chat_template_utils as templates

    class Fixed(datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(*TEMPLATE_DATE, tzinfo=tz)

    patch = pytest.MonkeyPatch()
    patch.setattr(templates, "datetime", Fixed)
    yield
    patch.undo()


def pytest_sessionfinish(session, exitstatus):
    # MLX wants every thread's streams cleared before the process exits.
    mx.clear_streams()
    if SESSION_GGUF_CACHE is not None:
        import shutil

        shutil.rmtree(SESSION_GGUF_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec())


@pytest.fixture(scope="session")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_random_adapter(root / name, tiny_model, **spec)
        for name, spec in ADAPTER_SPECS.items()
    }


@pytest.fixture(scope="session")
def quantized_model(tmp_path_factory):
    spec = TinyModelSpec(quantize_bits=4, quantize_group_size=32)
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-q4", spec)


@pytest.fixture(scope="session")
def smollm_gguf():
    """The real model's GGUF file (SmolLM2-135M-Instruct, Q4_1), fetched into mola's
    cache once. Skipped when it cannot be had, unless MOLA_REQUIRE_REAL_MODEL=1 (CI
    fetches it first), which makes that a failure."""
    from mola.models.fetch import FetchError, ensure_smollm

    try:
        return ensure_smollm()
    except FetchError as e:
        if os.environ.get("MOLA_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"MOLA_REQUIRE_REAL_MODEL=1 but the real model cannot be had: {e.message}")
        pytest.skip(f"the real model cannot be had: {e.message}")


@pytest.fixture(scope="session")
def smollm(smollm_gguf):
    """The real model loaded by mola (dequantized float32)."""
    from mola.models.loader import load_base_model

    return load_base_model(str(smollm_gguf), dtype="float32")


@pytest.fixture(scope="session")
def llama_cpp(smollm_gguf):
    """llama.cpp's forward in numpy on the real model (tests/llama_cpp_reference.py)."""
    from llama_cpp_reference import LlamaCppReference

    return LlamaCppReference(smollm_gguf)


@pytest.fixture(scope="module")
def server(tiny_model, adapters) -> ServerHandle:
    """A mola server on 127.0.0.1 serving the tiny model and adapters a, b, c."""
    handle = start_server(
        model=str(tiny_model),
        served_model_name="tiny",
        adapters=tuple(AdapterSpec(name, str(path)) for name, path in adapters.items()),
        allow_any_adapter_path=True,
        max_loras=4,
        max_lora_rank=16,
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    """An HTTP client of the module's ``server`` (this file's, or the module's own)."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def runner(tiny_model, adapters, request):
    """A started engine on the tiny model with adapters a, b, c in slots, and a
    blocking way to run sequences to the end (helpers.engines.EngineRunner); answers
    of the requesting module's MAX_TOKENS unless a request says otherwise."""
    r = EngineRunner(tiny_model, adapters=list(adapters.items()), max_tokens=request.module.MAX_TOKENS)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def engine(tiny_model):
    """A started engine on the tiny model with four slots, for a module's
    registry and loader tests (each builds a fresh registry over it:
    helpers.engines.run_registry)."""
    engine = Engine(lambda: load_base_model(str(tiny_model)), EngineConfig(max_loras=4, max_lora_rank=16))
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def echo_demo(tmp_path_factory):
    """The demo's echo base (it copies the user's message), built into a
    cache of its own, and its committed adapters (upper, title, count)."""
    from mola.demo.echo import ensure_demo

    return ensure_demo(tmp_path_factory.mktemp("echo-cache"))
