"""`mola serve --config FILE`: the settings a TOML, YAML or JSON file declares,
by the names of mola serve's flags (mola.config.SETTINGS), with relative paths
taken from the file's directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import SETTINGS, AdapterSpec, ModelSpec
from ..registry.resolvers import parse_resolver

SUFFIXES = (".toml", ".yaml", ".yml", ".json")


def load_config_file(path: str | Path) -> dict:
    """The settings in a TOML (.toml), YAML (.yaml/.yml) or JSON file, for
    ServeConfig.from_settings, with relative paths taken from the file's directory."""
    path = Path(path).expanduser()
    data = {k.replace("-", "_"): v for k, v in _read(path).items()}
    unknown = sorted(set(data) - SETTINGS)
    if unknown:
        raise ValueError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    return _resolve_paths(data, path.parent)


def _read(path: Path) -> dict:
    """The file's top-level table."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}") from None
    if path.suffix not in SUFFIXES:
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
    return data


def _resolve_paths(data: dict, base: Path) -> dict:
    """The settings that name paths, read from ``base``."""
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
    if "models" in data:
        data["models"] = _models_from_file(data["models"], base)
    if "image_model" in data:  # [image_model] name, path (docs/images.md)
        image = data["image_model"]
        if not isinstance(image, dict) or set(image) != {"name", "path"} or not isinstance(image["path"], str):
            raise ValueError(f"'image_model' must be a table with a name and a path; got {image!r}")
        data["image_model"] = {**image, "path": _resolve_relative(image["path"], base)}
    if "image_adapters" in data:
        data["image_adapters"] = _adapters_from_file(data["image_adapters"], base)
    if "cache_dir" in data and data["cache_dir"] is not None:
        data["cache_dir"] = Path(_resolve_relative(str(data["cache_dir"]), base))
    return data


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


MODEL_KEYS = {"name", "model", "adapters", "adapter_dirs", "dtype", "max_loras", "max_num_seqs",
              "prompt_cache_bytes", "keep_alive", "pin"}


def _models_from_file(raw, base: Path) -> tuple[ModelSpec, ...]:
    """[[models]] entries: each a base with its own adapters and settings."""
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise ValueError("'models' must be a list of tables ([[models]] with name, model, adapters, ...)")
    specs = []
    for entry in raw:
        entry = {k.replace("-", "_"): v for k, v in entry.items()}
        if set(entry) - MODEL_KEYS or not isinstance(entry.get("name"), str) or not isinstance(entry.get("model"), str):
            raise ValueError(f"a [[models]] entry takes a name and a model, and {', '.join(sorted(MODEL_KEYS - {'name', 'model'}))}; got {entry!r}")
        nested = _resolve_paths({k: entry.pop(k) for k in ("model", "adapters", "adapter_dirs") if k in entry}, base)
        specs.append(ModelSpec(**entry, **nested))
    return tuple(specs)


def merge_adapters(first: tuple[AdapterSpec, ...], then: tuple[AdapterSpec, ...]) -> tuple[AdapterSpec, ...]:
    """``then`` overrides ``first`` by name; order: first's, then new ones."""
    by_name = {a.name: a for a in first}
    by_name.update({a.name: a for a in then})
    return tuple(by_name.values())
