"""Test helpers: a real server in a thread, references computed another way
(plain mlx-lm on merged weights), and OpenAI schema validation."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import httpx
import mlx.core as mx
import uvicorn

from mola.config import ServeConfig
from mola.engine.engine import Engine
from mola.models.loader import load_base_model
from mola.adapters.formats import read_adapter
from mola.server.app import create_app
from mola.server.startup import build_state

SCHEMAS = Path(__file__).parent / "data" / "openai_schemas.json"


# Prompts of several lengths for the engine's and the runner's tests, and
# their answers' length.
ENGINE_QUESTIONS = [
    "Hello there",
    "What is the capital of France? Please answer in one word.",
    "hi",
    "Write a poem about autumn leaves falling softly on the quiet street, then explain it.",
]
ENGINE_MAX_TOKENS = 10

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    url: str
    engine: Engine
    server: uvicorn.Server
    thread: threading.Thread
    config: ServeConfig

    @property
    def app(self):
        return self.server.config.app

    @property
    def state(self):
        return self.app.state.mola

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.stop()


class _Server(uvicorn.Server):
    """uvicorn's server, setting ``ready`` once it listens (or failed to)."""

    def __init__(self, config: uvicorn.Config, ready: threading.Event):
        super().__init__(config)
        self.ready = ready

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()


def start_server(**kwargs) -> ServerHandle:
    """Start engine + uvicorn (127.0.0.1, a free port) in this process; the
    event loop runs on a thread of its own."""
    config = ServeConfig.from_settings(host="127.0.0.1", port=free_port(), log_level="warning", **kwargs)
    engine = Engine(lambda: load_base_model(config.model, dtype=config.dtype), config.engine)
    loaded = engine.start()
    box: dict = {}
    ready = threading.Event()  # uvicorn listens, or the loop ended before it could

    async def main():
        app = create_app(await build_state(config, engine, loaded))
        box["server"] = server = _Server(uvicorn.Config(app, host=config.host, port=config.port,
                                                        log_level="warning"), ready)
        await server.serve()

    def run():
        try:
            asyncio.run(main())
        except BaseException as e:  # reported below
            box["error"] = e
        finally:
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(timeout=30)
    if not ("server" in box and box["server"].started):
        engine.stop()
        raise RuntimeError(f"the test server did not start: {box.get('error')}")
    return ServerHandle(f"http://127.0.0.1:{config.port}", engine, box["server"], thread, config)


def start_mola_serve(args, env=None, timeout=120):
    """`mola serve ARGS` in a process of its own on 127.0.0.1, once /health answers 200."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mola", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout, proc.kill)
    return proc, url


def wait_healthy(proc, url: str, timeout: float, kill) -> None:
    """Wait until ``url``/health answers 200; fail with the process's output
    if it exits first, and ``kill`` it after ``timeout`` seconds."""
    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"mola serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        return status_is(url + "/health", 200)

    try:
        wait_until(healthy, timeout, "mola serve to become healthy", every=0.2)
    except TimeoutError:
        kill()
        raise AssertionError("mola serve did not become healthy") from None


def status_is(url: str, status: int) -> bool:
    """Whether GET ``url`` answers ``status`` now (False when nothing listens yet)."""
    try:
        return httpx.get(url, timeout=1).status_code == status
    except httpx.HTTPError:
        return False


def wait_until(predicate, timeout: float = 10.0, what: str = "the condition", every: float = 0.01):
    """Poll ``predicate()`` until it holds (returns its value); TimeoutError
    after ``timeout`` seconds. For states that nothing signals to a test:
    another process (a server's /health), the snapshot the engine thread
    republishes after each step, counters the server's event loop keeps.
    Where an event exists (a callback, a stream's next line, a Condition),
    wait on it instead."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(every)
    return value


async def settle(predicate, timeout: float = 10.0, every: float = 0.002):
    """wait_until on an event loop: poll ``predicate()`` (a coroutine
    function too) between the loop's other work until it holds, for states
    that no future signals (a prefetch done, a request in line, a slot
    cleared by a spawned task, a server's counters)."""
    async def holds() -> bool:
        value = predicate()
        return await value if inspect.isawaitable(value) else value

    async def poll():
        while not await holds():
            await asyncio.sleep(every)
    await asyncio.wait_for(poll(), timeout)


def stop_mola_serve(proc) -> tuple[int, str]:
    """SIGINT, as Ctrl-C; the exit status and everything it printed."""
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


# ---- references ---------------------------------------------------------------


def merged_model(model_dir, adapter_dirs=(), scales=None, dequantize=False):
    """Plain mlx-lm model with each adapter merged into the base weights:
    W' = W + scale * (A @ B)^T (for experts, per expert: W[e] += scale *
    (A[e] @ B[e])^T). With ``dequantize``, quantized layers are made float
    first (mlx-lm's own dequantize_model)."""
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    model, tokenizer = load(str(model_dir))
    if dequantize:
        model = dequantize_model(model)
    modules = dict(model.named_modules())
    for i, adapter in enumerate(adapter_dirs):
        weights = read_adapter(adapter)
        extra = 1.0 if scales is None else scales[i]
        for path, m in weights.modules.items():
            lin = modules[path]
            delta = (extra * m.scale) * (m.a @ m.b)  # [in, out], experts [E, in, out]
            lin.weight = lin.weight + delta.swapaxes(-1, -2).astype(lin.weight.dtype)
    mx.eval(model.parameters())
    return model, tokenizer


def merged_answer(tokenizer, model_dir, question: str, max_tokens: int, adapter_dirs=(), scales=None) -> str:
    """The greedy answer to one user message by plain mlx-lm on the base with
    the adapters merged into its weights, EOS ignored (as ``ignore_eos``)."""
    model, _ = merged_model(model_dir, list(adapter_dirs), scales)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    tokens, _ = reference_decode(model, prompt, max_tokens)
    return detokenize(tokenizer, tokens, stop_at_eos=False)


def greedy_tokens(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with mlx-lm's own generate_step (no mola code)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    out = []
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=make_sampler(0.0))
    for token, _ in steps:
        out.append(int(token))
    return out


# ---- structured outputs -------------------------------------------------------


def grammar_walks(compiled, tokenizer, rng, num=30, max_tokens=300) -> list[str]:
    """Texts of random walks through the grammar: each step draws a token
    the mask allows (EOS, when allowed, with probability 1/2)."""
    import numpy as np

    eos = set(tokenizer.eos_token_ids)
    texts = []
    for _ in range(num):
        m = compiled.matcher.deep_copy()
        tokens = []
        for _ in range(max_tokens):
            allowed = np.nonzero(np.frombuffer(m.compute_logit_bias(), dtype=np.uint8))[0]
            ends = [t for t in allowed if t in eos]
            others = [t for t in allowed if t not in eos]
            if ends and (not others or rng.random() < 0.5):
                break
            token = int(rng.choice(others))
            assert m.consume_token(token)
            tokens.append(token)
        else:
            continue  # ran out of budget: a prefix, nothing to check
        assert m.is_accepting()
        texts.append(tokenizer.decode(tokens))
    assert len(texts) >= num // 4
    return texts


# ---- OpenAI schemas ---------------------------------------------------------


@lru_cache(maxsize=None)
def _validator(name: str):
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    data = json.loads(SCHEMAS.read_text())
    doc = {"components": {"schemas": data["schemas"]}}
    registry = Registry().with_resource("urn:openai", Resource(doc, specification=DRAFT202012))
    schema = {"$ref": f"urn:openai#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_schema(name: str, payload: dict) -> None:
    """Raise jsonschema.ValidationError unless ``payload`` fits OpenAI's schema."""
    _validator(name).validate(payload)


@lru_cache(maxsize=None)
def _stream_event_schemas() -> dict[str, str]:
    """Event type ("response.output_text.delta") -> its schema's name, from
    the members of ResponseStreamEvent."""
    schemas = json.loads(SCHEMAS.read_text())["schemas"]
    out = {}
    for member in schemas["ResponseStreamEvent"]["anyOf"]:
        name = member["$ref"].rsplit("/", 1)[1]
        for kind in schemas[name]["properties"]["type"]["enum"]:
            out[kind] = name
    return out


def validate_stream_event(event: dict) -> str:
    """Validate a Responses stream event against ResponseStreamEvent and
    against the member schema its type names; returns that name."""
    name = _stream_event_schemas()[event["type"]]
    validate_schema("ResponseStreamEvent", event)
    validate_schema(name, event)
    return name


def sse_events(text: str) -> list:
    """Parse an SSE body into its JSON payloads; the final [DONE] as a string."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def typed_events(text: str) -> list[dict]:
    """Parse a typed SSE body (Responses API): each block is `event: TYPE`
    then `data: JSON` whose "type" is TYPE; no [DONE]."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        head, data = block.strip().split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == head[len("event: "):], block
        events.append(event)
    return events


def reference_decode(model, prompt: list[int], max_tokens: int, bias=None, frequency_penalty=0.0,
                     presence_penalty=0.0, top_k: int = 0):
    """Greedy decoding step by step with a plain mlx-lm model and KV cache,
    applying logit biases and OpenAI's penalties naively in numpy. Returns
    (tokens, [(logprob of token, [(id, logprob)] top_k)]) with raw-model
    log-probabilities."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    tokens, lps = [], []
    counts: dict[int, int] = {}
    for _ in range(max_tokens):
        raw = np.array(logits.astype(mx.float32))
        logp = raw - np.log(np.exp(raw - raw.max()).sum()) - raw.max()
        adjusted = raw.copy()
        for t, b in (bias or {}).items():
            adjusted[t] += b
        for t, c in counts.items():
            adjusted[t] -= frequency_penalty * c + presence_penalty
        token = int(np.argmax(adjusted))
        top = [(int(i), float(logp[i])) for i in np.argsort(-logp)[:top_k]]
        tokens.append(token)
        lps.append((float(logp[token]), top))
        counts[token] = counts.get(token, 0) + 1
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return tokens, lps


# ---- an engine without the server ----------------------------------------------


def run_registry(engine, scenario, max_loras: int = 1, **registry_args) -> None:
    """Run ``scenario(registry)`` (async, bounded at 60 s) on a fresh registry
    of ``max_loras`` slots whose loader writes into ``engine``."""
    from mola.adapters.loader import AdapterLoader
    from mola.engine.client import AsyncEngine
    from mola.registry.registry import AdapterRegistry

    async def main():
        loader = AdapterLoader(AsyncEngine(engine), engine.loaded.config)
        registry = AdapterRegistry("tiny", loader, max_loras, **registry_args)
        try:
            await asyncio.wait_for(scenario(registry), timeout=60)
        finally:
            registry.close()
            loader.close()
    asyncio.run(main())


def runner_stats(engine):
    """A copy of the runner's counters, taken on the engine thread (the only
    thread that may read the runner)."""
    import dataclasses

    return engine.call(lambda: dataclasses.replace(engine.runner.stats)).result(timeout=30)


def num_unfinished(engine) -> int:
    """Sequences the scheduler holds, counted on the engine thread."""
    return engine.call(lambda: engine.scheduler.num_unfinished).result(timeout=30)



class EngineRunner:
    """A real engine on a model directory, adapters in slots, and a blocking
    way to run sequences to the end."""

    def __init__(self, model_dir, adapters=(), max_tokens: int = 10, draft_model=None, dtype: str = "auto", **config):
        from mola.engine.engine import EngineConfig
        from mola.models.loader import load_draft_model

        def load():
            loaded = load_base_model(str(model_dir), dtype=dtype)
            if draft_model is not None:  # as mola serve --draft-model loads it
                loaded.draft = load_draft_model(str(draft_model), loaded).model
            return loaded

        self.max_tokens = max_tokens
        self.done: dict = {}
        self.num_tokens: dict[int, int] = {}  # seq_id -> tokens generated so far
        self.logprobs: dict = {}  # seq_id -> [(logprob, [(id, logprob)])], for rows that ask
        self.cond = threading.Condition()
        self.engine = Engine(
            load,
            EngineConfig(**{"max_loras": 4, "max_lora_rank": 16, **config}),
            self._on_outputs,
        )
        self.loaded = self.engine.start()
        self.slots: dict[str, int] = {}
        self.versions: dict[str, int] = {}
        for name, path in adapters:
            self.add(name, self.read(path))

    def read(self, path):
        """The adapter at ``path`` as the server reads it (with the base's config)."""
        config = self.loaded.config
        return read_adapter(path, dtype=self.engine.geometry.dtype, model_type=config.get("model_type"),
                            model_config=config)

    def add(self, name: str, weights) -> None:
        """Validate ``weights`` (LoRAWeights) and write them into the next slot."""
        from mola.adapters.weights import validate

        geometry = self.engine.geometry
        validate(weights, geometry.targets, geometry.max_rank, geometry.max_expert_rank)
        slot = self.slots.get(name, len(self.slots) + 1)
        self.engine.call(lambda: self.engine.packs.fill_from(slot, weights)).result()
        self.slots[name] = slot
        self.versions[name] = self.versions.get(name, 0) + 1  # the prompt cache's key changes

    def _on_outputs(self, outputs):
        with self.cond:
            for out in outputs:
                self.num_tokens[out.seq_id] = self.num_tokens.get(out.seq_id, 0) + len(out.tokens)
                if out.logprobs:
                    self.logprobs.setdefault(out.seq_id, []).extend(out.logprobs)
                if out.finish_reason is not None:
                    self.done[out.seq_id] = out
            self.cond.notify_all()

    def submit(self, prompt, adapter=None, lora_scale=1.0, constraint=None, adapter_start=None, **params):
        from mola.engine.sequence import SamplingParams, Sequence

        params = {"max_tokens": self.max_tokens, "temperature": 0.0, **params}
        key = None if adapter is None else (adapter, self.versions[adapter])  # as Lease.key
        seq = Sequence(prompt=list(prompt), params=SamplingParams(**params), slot=self.slots.get(adapter, 0),
                       lora_scale=lora_scale, adapter_key=key, constraint=constraint, adapter_start=adapter_start)
        self.engine.add(seq)
        return seq

    def wait(self, seqs, timeout=60):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(s.seq_id in self.done for s in seqs):
                assert self.cond.wait(deadline - time.monotonic()), "engine timed out"
        return [s.output for s in seqs]

    def wait_decoding(self, seqs, timeout=60):
        """Wait until each of ``seqs`` has generated a token (it is in the
        decode batch), told by the engine's outputs."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(self.num_tokens.get(s.seq_id) for s in seqs):
                assert self.cond.wait(deadline - time.monotonic()), "engine timed out"

    def run(self, prompt, adapter=None, **params):
        return self.wait([self.submit(prompt, adapter, **params)])[0]

    def prompt(self, question):
        return self.loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )

    def stop(self):
        self.engine.stop()


def detokenize(tokenizer, tokens, stop_at_eos=True) -> str:
    """Text of ``tokens`` as mlx-lm's streaming detokenizer makes it, EOS
    tokens left out (and, with stop_at_eos, everything after the first), and
    the other special tokens too (the server's skip_special_tokens)."""
    detok = tokenizer.detokenizer
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for t in tokens:
        if t in tokenizer.eos_token_ids:
            if stop_at_eos:
                break
            continue
        if t not in special:
            detok.add_token(t)
    detok.finalize()
    return detok.text


# ---- tokenizers of other model families --------------------------------------------------

# Chat templates in the style of other families, enough for mlx-lm to pick
# their tool parser (mlx_lm.tokenizer_utils._infer_tool_parser).
MISTRAL_TEMPLATE = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- for tc in message.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}<|im_end|>
{%- elif message.role == 'assistant' %}{{ message.content }}<|im_end|>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""
MISTRAL_V3_TEMPLATE = MISTRAL_TEMPLATE.replace(
    "{%- for tc in message.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}",
    '[TOOL_CALLS][{%- for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": '
    '{{ tc.function.arguments | tojson }}}{{ ", " if not loop.last }}{% endfor %}]')
PYTHONIC_TEMPLATE = "{% for m in messages %}<|tool_call_start|>{{ m.content }}<|tool_call_end|>{% endfor %}"


def with_chat_template(model_dir, out_dir, template: str):
    """A copy of a model directory whose tokenizer has another chat template."""
    import shutil

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    (Path(out_dir) / "chat_template.jinja").write_text(template)
    return Path(out_dir)


def with_added_tokens(model_dir, out_dir, tokens: list[str], special: bool = False,
                      eos: tuple[str, ...] = (), template: str | None = None, seed: int = 0):
    """A copy of a tiny model directory whose tokenizer has ``tokens`` added
    (special or not, as a real model declares them), the embedding and output
    rows grown with random ones, ``eos`` among its end-of-sequence ids, and
    (if given) another chat ``template``."""
    import shutil

    import numpy as np
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in tokens], special_tokens=special)
    tok.save_pretrained(str(out_dir))
    config = json.loads((out_dir / "config.json").read_text())
    weights = dict(mx.load(str(out_dir / "model.safetensors")))
    rng = np.random.default_rng(seed)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[key]
        extra = rng.normal(0, float(np.std(np.array(w))), (len(tok) - w.shape[0], w.shape[1]))
        weights[key] = mx.concatenate([w, mx.array(extra, dtype=w.dtype)])
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    ids = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    config.update(vocab_size=len(tok), eos_token_id=ids + [tok.convert_tokens_to_ids(t) for t in eos])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if template is not None:
        (out_dir / "chat_template.jinja").write_text(template)
    return out_dir


def together(runner: EngineRunner, submit):
    """``submit()`` while the engine thread waits on a gate: it takes every
    sequence before its next step, so the schedule (who runs with whom, who
    is preempted) is the same every run."""
    gate = threading.Event()
    runner.engine.call(gate.wait)
    try:
        return submit()
    finally:
        gate.set()
