"""Server configuration: one frozen dataclass, checked when it is made.

ServeConfig holds the server's settings, and the engine's as one EngineConfig
(mola/engine/config.py) kept nowhere else. `mola serve`'s flags and
config-file keys are flat (--max-loras, --num-draft-tokens, ...):
ServeConfig.from_settings takes them by those names, and ENGINE_SETTINGS and
SPECULATIVE_SETTINGS say which engine field each sets. Reading a config file
is the command line's (mola/cli/config_file.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from .cache import parse_bytes
from .engine.config import EngineConfig, SpeculativeConfig
from .errors import InvalidAdapterName
from .registry.names import check_adapter_id
from .registry.resolvers import ResolverSpec, parse_resolver
from .models import DTYPE_CHOICES

DEMO_CHOICES = ("chat", "echo")  # what `mola serve` with no model serves (mola.demo)
# How a thinking model's reasoning is split from its answer (mola/frontend/reasoning.py);
# auto: from the chat template.
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "gpt_oss", "none")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# The flat settings (flags, config-file keys) that set the engine -> the
# EngineConfig field each sets (mola/engine/config.py says what they mean).
ENGINE_SETTINGS = {
    "max_loras": "max_loras",  # adapter slots decoded together (resident adapters)
    "max_lora_rank": "max_lora_rank",  # largest adapter rank a slot holds
    # Mixtures of experts: how many of the slots can also carry LoRA on the
    # experts, and its largest rank there (docs/moe.md).
    "max_expert_loras": "expert_slots",
    "max_expert_lora_rank": "max_expert_rank",
    "max_num_seqs": "max_num_seqs",  # rows in one decode batch
    "prefill_step_size": "prefill_step_size",  # prompt tokens prefilled per engine step
    # KV state kept for reuse (bytes, or a size such as "512MB" or "2GiB"); 0 turns it off.
    "prompt_cache_bytes": "prompt_cache_bytes",
    # What the batches' KV caches may hold (a size, or "auto"; 0: no budget), and
    # how requests are admitted against it ("optimistic" or "reserve").
    "kv_cache_bytes": "kv_cache_bytes",
    "kv_admission": "kv_admission",
    # Keys and values quantized to 8 or 4 bits (mlx-lm's QuantizedKVCache), in groups of kv_group_size.
    "kv_bits": "kv_bits",
    "kv_group_size": "kv_group_size",
}
# Speculative decoding's -> SpeculativeConfig's fields. "speculative" names the
# method ("ngram" or "draft"; not given: off); speculate_always sets
# cost_aware to False.
SPECULATIVE_SETTINGS = {
    "speculative": "method",
    "draft_model": "draft_model",
    "num_draft_tokens": "num_draft_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "speculative_max_batch": "max_batch",
}


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter named at start."""

    name: str
    path: str  # a local path or a hub id
    scale: float = 1.0  # multiplies the adapter's own scale (its default strength)

    def __post_init__(self):
        try:
            check_adapter_id(self.name)
        except InvalidAdapterName as e:
            raise ValueError(e.message) from None
        if not self.path:
            raise ValueError(f"adapter '{self.name}' has no path")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale):
            raise ValueError(f"adapter '{self.name}': scale must be a finite number, got {self.scale!r}")


@dataclass(frozen=True)
class ModelSpec:
    """A base model declared by name (--model NAME=PATH, a [[models]] entry of
    the config file), served beside the default one with adapters of its own;
    loaded on its first request (mola/bases/control.py). Unset settings are the
    server's."""

    name: str  # the id clients use for it
    model: str  # any source --model takes: an mlx-lm directory, a hub id, a GGUF file
    adapters: tuple[AdapterSpec, ...] = ()
    adapter_dirs: tuple[str, ...] = ()
    dtype: str | None = None
    max_loras: int | None = None
    max_num_seqs: int | None = None
    prompt_cache_bytes: int | str | None = None
    keep_alive: float | None = None  # seconds idle before it unloads (None: the server's --keep-alive)
    pin: bool = False  # loaded at start and never unloaded

    def __post_init__(self):
        try:
            check_adapter_id(self.name)
        except InvalidAdapterName as e:
            raise ValueError(f"model name: {e.message}") from None
        object.__setattr__(self, "adapters", tuple(
            a if isinstance(a, AdapterSpec) else AdapterSpec(**a) for a in self.adapters))
        object.__setattr__(self, "adapter_dirs", tuple(self.adapter_dirs))
        if "/" in self.name or not self.model:
            raise ValueError(f"a model is declared as NAME=PATH with no '/' in NAME; got {self.name!r}")
        if isinstance(self.prompt_cache_bytes, str):
            object.__setattr__(self, "prompt_cache_bytes", parse_bytes(self.prompt_cache_bytes))
        if self.dtype is not None and self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"model '{self.name}': unknown dtype {self.dtype!r}")
        if self.keep_alive is not None and not self.keep_alive > 0:
            raise ValueError(f"model '{self.name}': keep_alive must be > 0 seconds, got {self.keep_alive}")


@dataclass(frozen=True)
class ImageModelSpec:
    """The diffusion base POST /v1/images/generations serves (docs/images.md): an mflux
    FLUX.2-klein directory (or an mflux model name), resident beside the text base."""

    name: str  # the id clients send as ``model``
    path: str

    def __post_init__(self):
        try:
            check_adapter_id(self.name)
        except InvalidAdapterName as e:
            raise ValueError(f"image model name: {e.message}") from None
        if not self.path:
            raise ValueError(f"image model '{self.name}' has no path")


IMAGE_DTYPES = ("bfloat16", "float16", "float32")
@dataclass(frozen=True)
class HTTPConfig:
    """How the server speaks HTTP: where it listens, who may call it, what it
    takes and how it stops."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Access: with api_key, every /v1 route needs "Authorization: Bearer KEY";
    # with admin_key, loading and unloading adapters needs that key instead.
    # /health and /metrics stay open unless protect_metrics.
    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)
    protect_metrics: bool = False
    ui: bool = True  # serve the playground page at / (False: / is a 404)
    # Request bodies larger than this are refused (413) before being read whole.
    max_request_bytes: int = 4 * 1024 * 1024
    # The body of PUT /v1/adapters/{name}/weights (an adapter's safetensors) may be this large.
    max_adapter_push_bytes: int = 1 << 30
    # On SIGTERM: stop accepting, let running requests finish up to this long.
    shutdown_timeout: float = 30.0

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        for name in ("api_key", "admin_key"):
            key = getattr(self, name)
            if key is not None and (not isinstance(key, str) or len(key) < 8):
                raise ValueError(f"{name} must be a string of at least 8 characters")


@dataclass(frozen=True)
class BasesConfig:
    """The base models besides --model, and what stays resident (docs/bases.md)."""

    # Further base models, each with its adapters, loaded on their first
    # request; with no model, the first of them is the default base.
    models: tuple[ModelSpec, ...] = ()
    # What stays resident: at most this many bases loaded, and their weights
    # and slot packs within this many bytes (None: no limit); reaching a limit
    # unloads the least recently used idle base.
    max_loaded_models: int | None = None
    models_memory_bytes: int | str | None = None
    # A base idle this many seconds unloads (None: never; a model's own keep_alive wins).
    keep_alive: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "models", tuple(
            m if isinstance(m, ModelSpec) else ModelSpec(**m) for m in self.models))
        if isinstance(self.models_memory_bytes, str):
            object.__setattr__(self, "models_memory_bytes", parse_bytes(self.models_memory_bytes))
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be at least 1, got {self.max_loaded_models}")
        if self.keep_alive is not None and not self.keep_alive > 0:
            raise ValueError(f"keep_alive must be > 0 seconds, got {self.keep_alive}")


@dataclass(frozen=True)
class VisionConfig:
    """Images in chat requests (docs/vision.md): what one request's images may
    be, checked before any is decoded (mola/frontend/images_in.py). Request
    bodies are also bounded by max_request_bytes, and base64 takes 4/3 of an
    image's bytes: raise it with max_image_bytes."""

    # Fetch http(s) image URLs (default off: they are refused with a 400 naming this flag).
    allow_remote_images: bool = False
    max_image_bytes: int | str = 20 * 1024 * 1024  # an image file's bytes (a size such as "20MB")
    max_image_pixels: int = 40_000_000  # width x height of one image, read from its header before decoding
    max_images_per_request: int = 16  # images in one request, over all its messages
    max_vision_tokens: int = 16384  # prompt tokens one request's images may take (its processor counts them)

    def __post_init__(self):
        if isinstance(self.max_image_bytes, str):
            object.__setattr__(self, "max_image_bytes", parse_bytes(self.max_image_bytes))
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request", "max_vision_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# `mola serve`'s bases flags and config-file keys: BasesConfig's fields, by the same names.
BASES_SETTINGS = frozenset(f.name for f in dataclasses.fields(BasesConfig))
# `mola serve`'s HTTP flags and config-file keys: HTTPConfig's fields, by the same names.
HTTP_SETTINGS = frozenset(f.name for f in dataclasses.fields(HTTPConfig))
# `mola serve`'s flags and config-file keys for images in chat: VisionConfig's fields, by the same names.
VISION_SETTINGS = frozenset(f.name for f in dataclasses.fields(VisionConfig))
# `mola serve`'s image flags and config-file keys -> the ImagesConfig field each sets.
IMAGE_SETTINGS = {"image_model": "model", "image_adapters": "adapters", "image_dtype": "dtype",
                  "image_max_batch": "max_batch", "image_max_lora_rank": "max_lora_rank"}


@dataclass(frozen=True)
class ImagesConfig:
    """Images (docs/images.md): a FLUX.2-klein base kept resident by one worker
    thread, its LoRAs named at start (``adapters``: chosen by a request's model)
    or by path in a request (under the server's adapter_dirs), applied unmerged
    per row of one batched denoising loop. No ``model``: no images served."""

    model: ImageModelSpec | None = None
    adapters: tuple[AdapterSpec, ...] = ()
    dtype: str = "bfloat16"  # mflux's compute dtype (its ModelConfig.precision, one per process)
    max_batch: int = 4  # images denoised together (also how many different LoRA sets one batch holds)
    max_lora_rank: int = 64  # the largest rank of a LoRA (or a stack's summed ranks)

    def __post_init__(self):
        if isinstance(self.model, dict):
            object.__setattr__(self, "model", ImageModelSpec(**self.model))
        object.__setattr__(self, "adapters", tuple(
            a if isinstance(a, AdapterSpec) else AdapterSpec(**a) for a in self.adapters))
        names = [a.name for a in self.adapters] + ([self.model.name] if self.model is not None else [])
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"image model or adapter names given more than once: {', '.join(dupes)}")
        if self.adapters and self.model is None:
            raise ValueError("image_adapters need an image_model (--image-model NAME=PATH)")
        if self.dtype not in IMAGE_DTYPES:
            raise ValueError(f"unknown image_dtype {self.dtype!r}; choose one of {', '.join(IMAGE_DTYPES)}")
        for name in ("max_batch", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"image_{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ServeConfig:
    # The base model: a local directory, a Hugging Face hub id or a GGUF file.
    # None serves the embedded demo (mola.demo: SmolLM2-135M-Instruct, fetched
    # once, with three adapters; the echo demo when it cannot be fetched).
    model: str | None = None
    # Which demo a model of None serves: "chat" (falling back to the echo demo,
    # saying why, when its model cannot be fetched) or "echo".
    demo: str = "chat"
    # The id clients use for the base model (default: the directory's name).
    served_model_name: str | None = None
    # Adapters named at start; each is checked and loaded before serving.
    adapters: tuple[AdapterSpec, ...] = ()
    # Directories whose entries (subdirectories, .gguf files) are adapters,
    # named after the entry and loaded on first use.
    adapter_dirs: tuple[str, ...] = ()
    # Let REST loads name any path (default: only under adapter_dirs, or a
    # path named at start).
    allow_any_adapter_path: bool = False
    # Follow symlinks inside adapter_dirs wherever they lead (default: a path
    # must still resolve under an adapter dir once symlinks are followed).
    allow_adapter_symlinks: bool = False
    # Where unknown model ids are looked for, in order (off by default):
    # "dir:PATH" (PATH/<id>) or "hf:ORG/*" / "hf:ORG/A,ORG/B" (hub repos).
    adapter_resolvers: tuple[ResolverSpec | str, ...] = ()
    # The host tier: adapters kept read, checked and prepared in host memory,
    # so that loading one into a slot is only the copy. At most this many
    # (None: no limit by count) and this many bytes (None: no limit by size);
    # neither set: no host tier. Adapters with requests running or waiting
    # are never dropped from it.
    max_cpu_loras: int | None = None
    adapter_cache_bytes: int | str | None = None  # bytes, or a size such as "4GB"
    # A request that has waited this many seconds for its adapter's slot gets
    # the next slot that frees, ahead of busier adapters (one of which stops
    # taking new requests so that it frees its slot).
    max_adapter_wait: float = 2.0
    max_model_len: int | None = None  # context limit; None: the model's own
    # Weights at load: "keep" leaves quantized layers quantized (a GGUF file's
    # codecs as models/codecs.py's table says); "float16", "bfloat16", "float32"
    # dequantize to that dtype; "auto": GGUF files float32 on a CPU (MLX's
    # quantized matmul is slow there) where that fits in memory, else kept, and
    # kept on a GPU; mlx-lm directories as they are.
    dtype: str = "auto"
    # max_tokens when a request sets none and the model declares no context
    # limit (otherwise the default is whatever room the context has left).
    default_max_tokens: int = 2048
    # Split a thinking model's reasoning from its answer: "auto" (from the chat
    # template), "qwen3", "deepseek_r1", "gpt_oss" or "none" (all of it is content).
    reasoning_parser: str = "auto"
    log_level: str = "info"
    cache_dir: Path | None = None  # where the demo is fetched and built (default ~/.cache/mola)
    # Backpressure: requests waiting beyond the running batch; past it, 429.
    max_queue: int = 256
    # A request running longer than this many seconds ends (finish_reason
    # "length"; one still queued gets a 503). None: no limit.
    request_timeout: float | None = None
    # Responses kept in memory for previous_response_id (least recently used
    # evicted first); 0 keeps none.
    max_stored_responses: int = 1024
    # Serve a base sharded over the ranks of an mx.distributed group (started
    # by mlx.launch); rank 0 serves HTTP, the others follow its steps.
    distributed: bool = False
    # Further base models, and what stays resident (BASES_SETTINGS).
    bases: BasesConfig = field(default_factory=BasesConfig)
    # Images (docs/images.md): the image base and its LoRAs (IMAGE_SETTINGS).
    images: ImagesConfig = field(default_factory=ImagesConfig)
    # HTTP: the address, the keys, the page, body limits and shutdown (HTTP_SETTINGS).
    http: HTTPConfig = field(default_factory=HTTPConfig)
    # Images in chat requests: their bounds, and remote URLs (VISION_SETTINGS).
    vision: VisionConfig = field(default_factory=VisionConfig)
    # The engine: adapter slots and ranks, the batch, the prompt cache and
    # speculative decoding (ENGINE_SETTINGS, SPECULATIVE_SETTINGS).
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        self._check_server()
        self._check_adapters()
        self._check_choices()
        self._check_models()

    def _check_models(self) -> None:
        """The declared bases' names and their adapters' unique (their limits: BasesConfig)."""
        models = self.bases.models
        names = [m.name for m in models] + [self.served_model_name] * (self.served_model_name is not None)
        adapters = [a.name for a in self.adapters] + [a.name for m in models for a in m.adapters]
        clashes = sorted({n for n in names if names.count(n) > 1} | (set(names) & set(adapters))
                         | {n for n in adapters if adapters.count(n) > 1})
        if clashes:
            raise ValueError(f"model or adapter names given more than once: {', '.join(clashes)}")

    def for_base(self, spec: ModelSpec, is_default: bool = False) -> ServeConfig:
        """The settings one declared base is served with: this server's, with
        the model's own (the default base also takes the top-level adapters)."""
        own = {"max_loras": spec.max_loras, "max_num_seqs": spec.max_num_seqs,
               "prompt_cache_bytes": spec.prompt_cache_bytes}
        own = {k: v for k, v in own.items() if v is not None}
        if "max_loras" in own:
            own["expert_slots"] = min(self.engine.expert_slots, own["max_loras"])
        if not is_default:  # a draft model drafts for the default base only
            own["speculative"] = None
        top = (self.adapters, self.adapter_dirs) if is_default else ((), ())
        return dataclasses.replace(
            self, model=spec.model, served_model_name=spec.name, adapters=spec.adapters + top[0],
            adapter_dirs=spec.adapter_dirs + top[1], dtype=spec.dtype or self.dtype,
            bases=dataclasses.replace(self.bases, models=(), keep_alive=spec.keep_alive or self.bases.keep_alive),
            engine=dataclasses.replace(self.engine, **own))

    def _check_server(self) -> None:
        """The limits and the timeouts (the address and the keys: HTTPConfig)."""
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {self.max_stored_responses}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")

    def _check_adapters(self) -> None:
        """Adapter names, the host tier, admission and the resolvers."""
        names = [a.name for a in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"adapter names given more than once: {', '.join(dupes)}")
        if self.served_model_name is not None and self.served_model_name in names:
            raise ValueError(f"adapter name '{self.served_model_name}' is also the base model's name")
        if isinstance(self.adapter_cache_bytes, str):
            object.__setattr__(self, "adapter_cache_bytes", parse_bytes(self.adapter_cache_bytes))
        for name in ("max_cpu_loras", "adapter_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not (isinstance(self.max_adapter_wait, (int, float)) and self.max_adapter_wait > 0):
            raise ValueError(f"max_adapter_wait must be > 0 seconds, got {self.max_adapter_wait!r}")
        object.__setattr__(self, "adapter_resolvers", tuple(
            r if isinstance(r, ResolverSpec) else parse_resolver(r) for r in self.adapter_resolvers))

    def _check_choices(self) -> None:
        """The demo, the dtype, the reasoning parser and the log level."""
        if self.demo not in DEMO_CHOICES:
            raise ValueError(f"unknown demo {self.demo!r}; choose one of {', '.join(DEMO_CHOICES)}")
        if self.demo != "chat" and self.model is not None:
            raise ValueError(f"demo {self.demo!r} is served in place of a model; it cannot go with "
                             f"model {self.model!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"unknown log level {self.log_level!r}")

    @classmethod
    def from_settings(cls, **settings) -> ServeConfig:
        """A ServeConfig from settings named as `mola serve`'s flags and
        config-file keys: its own fields, the engine's (ENGINE_SETTINGS,
        SPECULATIVE_SETTINGS, speculate_always), the images' (IMAGE_SETTINGS),
        HTTP's (HTTP_SETTINGS), the bases' (BASES_SETTINGS) and images in chat's (VISION_SETTINGS)."""
        engine_keys = set(ENGINE_SETTINGS) | set(SPECULATIVE_SETTINGS) | {"speculate_always"}
        engine = {k: settings.pop(k) for k in engine_keys & set(settings)}
        images = {IMAGE_SETTINGS[k]: settings.pop(k) for k in set(IMAGE_SETTINGS) & set(settings)}
        http = {k: settings.pop(k) for k in HTTP_SETTINGS & set(settings)}
        bases = {k: settings.pop(k) for k in BASES_SETTINGS & set(settings)}
        vision = {k: settings.pop(k) for k in VISION_SETTINGS & set(settings)}
        return cls(**settings, engine=engine_config(**engine), images=ImagesConfig(**images),
                   http=HTTPConfig(**http), bases=BasesConfig(**bases), vision=VisionConfig(**vision))


def engine_config(speculate_always: bool = False, **settings) -> EngineConfig:
    """The EngineConfig the engine's flat settings describe (unset ones keep
    EngineConfig's and SpeculativeConfig's defaults)."""
    if isinstance(settings.get("prompt_cache_bytes"), str):
        settings["prompt_cache_bytes"] = parse_bytes(settings["prompt_cache_bytes"])
    if settings.get("kv_cache_bytes") == "auto":
        settings["kv_cache_bytes"] = None
    elif isinstance(settings.get("kv_cache_bytes"), str):
        settings["kv_cache_bytes"] = parse_bytes(settings["kv_cache_bytes"])
    experts, max_loras = settings.get("max_expert_loras"), settings.get("max_loras", EngineConfig.max_loras)
    if experts is not None and not 0 <= experts <= max_loras:
        raise ValueError(f"max_expert_loras must be in 0..max_loras ({max_loras}), got {experts}")
    spec = None
    if settings.get("speculative") is not None:  # raises on its own bad values
        spec = SpeculativeConfig(cost_aware=not speculate_always, **{
            SPECULATIVE_SETTINGS[k]: v for k, v in settings.items() if k in SPECULATIVE_SETTINGS})
    elif settings.get("draft_model") is not None:
        raise ValueError("--draft-model is used by --speculative draft; give both")
    # Raises on its own bad values (max_loras, ranks, batch sizes).
    return EngineConfig(speculative=spec, **{
        ENGINE_SETTINGS[k]: v for k, v in settings.items() if k in ENGINE_SETTINGS})


# Every setting a flag or config-file key can give.
SETTINGS = ({f.name for f in dataclasses.fields(ServeConfig)} - {"engine", "images", "http", "bases", "vision"}
            | set(ENGINE_SETTINGS) | set(SPECULATIVE_SETTINGS) | {"speculate_always"} | set(IMAGE_SETTINGS)
            | HTTP_SETTINGS | BASES_SETTINGS | VISION_SETTINGS)
