"""Server configuration: one frozen dataclass, checked when it is made, and
the config file (TOML or YAML) that can declare it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from .engine.config import DEFAULT_EXPERT_RANK, DEFAULT_PROMPT_CACHE_BYTES, EngineConfig, SpeculativeConfig
from .errors import InvalidAdapterName
from .lora.names import check_adapter_id
from .lora.resolvers import ResolverSpec, parse_resolver
from .models import DTYPE_CHOICES

DEMO_CHOICES = ("chat", "echo")  # what `mola serve` with no model serves (mola.demo)
# How a thinking model's reasoning is split from its answer (mola/server/reasoning.py);
# auto: from the chat template.
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", "gpt_oss", "none")


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
    host: str = "127.0.0.1"
    port: int = 8000
    max_loras: int = 8  # adapter slots decoded together (resident adapters)
    max_lora_rank: int = 64  # largest adapter rank a slot holds
    # Mixtures of experts: how many of the slots can also carry LoRA on the
    # experts (None: 4, or max_loras if fewer), and its largest rank there.
    # An expert slot weighs E times a dense one (README: "MoE models").
    max_expert_loras: int | None = None
    max_expert_lora_rank: int = DEFAULT_EXPERT_RANK
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
    max_num_seqs: int = 32  # rows in one decode batch
    prefill_step_size: int = 512  # prompt tokens prefilled per engine step
    # KV state of earlier prompts and outputs kept for reuse, per adapter
    # identity (bytes, or a size such as "512MB" or "2GiB"); 0 turns it off.
    prompt_cache_bytes: int | str = DEFAULT_PROMPT_CACHE_BYTES
    max_model_len: int | None = None  # context limit; None: the model's own
    # Weights at load: "keep" leaves quantized layers quantized; "float16",
    # "bfloat16", "float32" dequantize to that dtype; "auto": GGUF files float32
    # on a CPU (MLX's quantized matmul is slow there) and kept on a GPU, mlx-lm
    # directories as they are.
    dtype: str = "auto"
    # max_tokens when a request sets none and the model declares no context
    # limit (otherwise the default is whatever room the context has left).
    default_max_tokens: int = 2048
    # Split a thinking model's reasoning from its answer: "auto" (from the chat
    # template), "qwen3", "deepseek_r1", "gpt_oss" or "none" (all of it is content).
    reasoning_parser: str = "auto"
    log_level: str = "info"
    cache_dir: Path | None = None  # where the demo is fetched and built (default ~/.cache/mola)
    # Access: with api_key, every /v1 route needs "Authorization: Bearer KEY";
    # with admin_key, loading and unloading adapters needs that key instead.
    # /health and /metrics stay open unless protect_metrics.
    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)
    protect_metrics: bool = False
    # Request bodies larger than this are refused (413) before being read whole.
    max_request_bytes: int = 4 * 1024 * 1024
    # Backpressure: requests waiting beyond the running batch; past it, 429.
    max_queue: int = 256
    # A request running longer than this many seconds ends (finish_reason
    # "length"; one still queued gets a 503). None: no limit.
    request_timeout: float | None = None
    # Responses kept in memory for previous_response_id (least recently used
    # evicted first); 0 keeps none.
    max_stored_responses: int = 1024
    # On SIGTERM: stop accepting, let running requests finish up to this long.
    shutdown_timeout: float = 30.0
    # Serve a base sharded over the ranks of an mx.distributed group (started
    # by mlx.launch); rank 0 serves HTTP, the others follow its steps.
    distributed: bool = False
    # Speculative decoding: "ngram" (prompt lookup) or "draft" (draft_model,
    # with the same tokenizer); None: off. Its knobs: the most tokens a row
    # drafts per step, the n-gram sizes prompt lookup matches, and the batch
    # size above which no step speculates.
    speculative: str | None = None
    draft_model: str | None = None
    num_draft_tokens: int = 8
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_max_batch: int = 8
    speculate_always: bool = False  # whenever a row drafts, not only when the measured costs say it pays
    engine: EngineConfig = field(init=False)

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")
        names = [a.name for a in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"adapter names given more than once: {', '.join(dupes)}")
        if self.served_model_name is not None and self.served_model_name in names:
            raise ValueError(f"adapter name '{self.served_model_name}' is also the base model's name")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if isinstance(self.adapter_cache_bytes, str):
            object.__setattr__(self, "adapter_cache_bytes", parse_bytes(self.adapter_cache_bytes))
        for name in ("max_cpu_loras", "adapter_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not (isinstance(self.max_adapter_wait, (int, float)) and self.max_adapter_wait > 0):
            raise ValueError(f"max_adapter_wait must be > 0 seconds, got {self.max_adapter_wait!r}")
        if self.max_expert_loras is not None and not 0 <= self.max_expert_loras <= self.max_loras:
            raise ValueError(f"max_expert_loras must be in 0..max_loras ({self.max_loras}), "
                             f"got {self.max_expert_loras}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {self.max_stored_responses}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        for name in ("api_key", "admin_key"):
            key = getattr(self, name)
            if key is not None and (not isinstance(key, str) or len(key) < 8):
                raise ValueError(f"{name} must be a string of at least 8 characters")
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
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"unknown log level {self.log_level!r}")
        object.__setattr__(self, "adapter_resolvers", tuple(
            r if isinstance(r, ResolverSpec) else parse_resolver(r) for r in self.adapter_resolvers))
        if isinstance(self.prompt_cache_bytes, str):
            object.__setattr__(self, "prompt_cache_bytes", parse_bytes(self.prompt_cache_bytes))
        if self.draft_model is not None and self.speculative is None:
            raise ValueError("--draft-model is used by --speculative draft; give both")
        spec = None
        if self.speculative is not None:  # raises on its own bad values
            spec = SpeculativeConfig(method=self.speculative, num_draft_tokens=self.num_draft_tokens,
                                     prompt_lookup_min=self.prompt_lookup_min,
                                     prompt_lookup_max=self.prompt_lookup_max,
                                     max_batch=self.speculative_max_batch, draft_model=self.draft_model,
                                     cost_aware=not self.speculate_always)
        # Raises on its own bad values (max_loras, ranks, batch sizes).
        object.__setattr__(
            self,
            "engine",
            EngineConfig(
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                expert_slots=self.max_expert_loras,
                max_expert_rank=self.max_expert_lora_rank,
                max_num_seqs=self.max_num_seqs,
                prefill_step_size=self.prefill_step_size,
                prompt_cache_bytes=self.prompt_cache_bytes,
                speculative=spec,
            ),
        )


FIELDS = {f.name for f in dataclasses.fields(ServeConfig) if f.init}
SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(value: str) -> int:
    """A size in bytes: "1073741824", "512MB", "1.5G", "2GiB" (K, M, G are
    powers of 10, as mlx_lm.server reads them; KiB, MiB, GiB powers of 2)."""
    text = str(value).strip()
    number = text.rstrip("BbKkMmGgIi ")
    unit = text[len(number):].strip().upper()
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in SIZE_UNITS or not amount >= 0 or amount == float("inf"):
        raise ValueError(f"expected a size in bytes such as 1000000, 512MB or 2GiB, got {value!r}")
    return int(amount * SIZE_UNITS[unit])


def parse_adapter_arg(value: str) -> AdapterSpec:
    """NAME=PATH -> AdapterSpec."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"expected NAME=PATH, got {value!r}")
    return AdapterSpec(name.strip(), path.strip())


def _resolve_relative(value: str, base: Path) -> str:
    """A path relative to the config file's directory, when it names a local
    path; hub ids and absolute paths are kept."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    candidate = base / p
    if candidate.exists() or value.startswith("."):
        return str(candidate.resolve())
    return value


def _adapters_from_file(raw, base: Path) -> tuple[AdapterSpec, ...]:
    items = []
    if isinstance(raw, dict):  # name: path  or  name: {path, scale}
        raw = [{"name": k, **(v if isinstance(v, dict) else {"path": v})} for k, v in raw.items()]
    if not isinstance(raw, list):
        raise ValueError("'adapters' must be a list of {name, path, scale} tables or a name -> path mapping")
    for entry in raw:
        if not isinstance(entry, dict) or set(entry) - {"name", "path", "scale"}:
            raise ValueError(f"an adapter entry takes name, path and scale; got {entry!r}")
        if not isinstance(entry.get("path"), str) or not isinstance(entry.get("name"), str):
            raise ValueError(f"an adapter entry needs a name and a path; got {entry!r}")
        items.append(AdapterSpec(entry["name"], _resolve_relative(entry["path"], base),
                                 entry.get("scale", 1.0)))
    return tuple(items)


def load_config_file(path: str | Path) -> dict:
    """ServeConfig fields from a TOML (.toml) or YAML (.yaml/.yml) file, with
    relative paths taken from the file's directory."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}") from None
    if path.suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ValueError(f"config file {path} must end in .toml, .yaml, .yml or .json")
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as e:  # tomllib, json and yaml parse errors
        raise ValueError(f"config file {path} does not parse: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table/mapping at the top")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise ValueError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    base = path.parent
    for key in ("model", "draft_model"):
        if isinstance(data.get(key), str):
            data[key] = _resolve_relative(data[key], base)
    if "adapters" in data:
        data["adapters"] = _adapters_from_file(data["adapters"], base)
    if "adapter_dirs" in data:
        dirs = data["adapter_dirs"]
        if isinstance(dirs, str):
            dirs = [dirs]
        if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
            raise ValueError("'adapter_dirs' must be a list of paths")
        # Absolute but as written: --allow-adapter-symlinks compares paths with these.
        data["adapter_dirs"] = tuple(os.path.abspath(base / Path(d).expanduser()) for d in dirs)
    if "adapter_resolvers" in data:
        specs = data["adapter_resolvers"]
        specs = [specs] if isinstance(specs, str) else specs
        if not isinstance(specs, list):
            raise ValueError("'adapter_resolvers' must be a list such as [\"dir:adapters\", \"hf:my-org/*\"]")
        data["adapter_resolvers"] = tuple(parse_resolver(spec, base) for spec in specs)
    if "cache_dir" in data and data["cache_dir"] is not None:
        data["cache_dir"] = Path(_resolve_relative(str(data["cache_dir"]), base))
    return data


def merge_adapters(first: tuple[AdapterSpec, ...], then: tuple[AdapterSpec, ...]) -> tuple[AdapterSpec, ...]:
    """``then`` overrides ``first`` by name; order: first's, then new ones."""
    by_name = {a.name: a for a in first}
    by_name.update({a.name: a for a in then})
    return tuple(by_name.values())
