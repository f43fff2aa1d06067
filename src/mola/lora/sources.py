"""Where adapters may come from.

A path given for an adapter must resolve (symlinks followed) under one of the
``--adapter-dir`` roots or be a path named at start (``--adapter``, the config
file), unless ``--allow-any-adapter-path``. A hub id (``org/name``) that is
not a local path goes through huggingface-hub's cache. Each entry of an
adapter directory (a subdirectory, or a ``.gguf`` file) is an adapter named
after it, found on first use.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import AdapterPathNotAllowed, AdapterPathNotFound, InvalidRequest

log = logging.getLogger("mola.adapters")

HUB_PATTERNS = ["adapter_config.json", "*.safetensors", "*.gguf", "*.json"]


def looks_like_hub_id(value: str) -> bool:
    parts = value.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not value.startswith((".", "/", "~"))
        and ".." not in parts
    )


def valid_entry_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


class AdapterSources:
    def __init__(
        self,
        adapter_dirs: list[str | Path] = (),
        named_paths: list[str | Path] = (),
        allow_any_path: bool = False,
    ):
        self.adapter_dirs = [Path(d).expanduser().resolve() for d in adapter_dirs]
        self.allow_any_path = allow_any_path
        self._named = {Path(p).expanduser().resolve() for p in named_paths}

    def allow(self, path: str | Path) -> None:
        """Allow one more path (an adapter named at start)."""
        self._named.add(Path(path).expanduser().resolve())

    def is_allowed(self, real: Path) -> bool:
        if self.allow_any_path or real in self._named:
            return True
        return any(real == root or root in real.parents for root in self.adapter_dirs)

    def resolve(self, given: str) -> str:
        """A local path (checked against the policy) or a hub snapshot path."""
        if not isinstance(given, str) or not given.strip():
            raise InvalidRequest("An adapter path must be a non-empty string.", param="path")
        try:
            path = Path(given).expanduser()
            exists = path.exists()
            real = path.resolve() if exists else None
        except (RuntimeError, OSError, ValueError) as e:  # "~nobody/x", NUL bytes, loops
            raise AdapterPathNotFound(f"The adapter path {given!r} is not usable: {e}") from None
        if exists:
            if not self.is_allowed(real):
                roots = ", ".join(map(str, self.adapter_dirs)) or "none configured"
                raise AdapterPathNotAllowed(
                    f"The adapter path {given} (resolving to {real}) is outside the allowed "
                    f"adapter directories ({roots}); start the server with --adapter-dir "
                    "covering it, or with --allow-any-adapter-path."
                )
            return str(real)
        if looks_like_hub_id(given):
            return self._from_hub(given)
        raise AdapterPathNotFound(f"The adapter path does not exist: {given}")

    def _from_hub(self, repo: str) -> str:
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(repo, allow_patterns=HUB_PATTERNS)
        except Exception as e:  # offline and not cached, unknown repo, gated, ...
            raise AdapterPathNotFound(
                f"The adapter '{repo}' is neither a local path nor available from the "
                f"Hugging Face hub or its local cache: {type(e).__name__}: {e}"
            ) from None

    def discover(self, name: str) -> Path | None:
        """The entry ``name`` of an adapter directory, if there is one."""
        if not valid_entry_name(name):
            return None
        for root in self.adapter_dirs:
            for candidate in (root / name, root / f"{name}.gguf"):
                try:
                    if candidate.exists():
                        return candidate
                except (OSError, ValueError):  # names too long, NUL bytes
                    return None
        return None

    def scan(self) -> dict[str, Path]:
        """Every entry of every adapter directory: name -> path (first wins)."""
        found: dict[str, Path] = {}
        for root in self.adapter_dirs:
            if not root.is_dir():
                log.warning("adapter directory %s does not exist", root)
                continue
            for entry in sorted(root.iterdir()):
                if entry.name.startswith("."):
                    continue
                name = entry.stem if entry.suffix == ".gguf" and entry.is_file() else entry.name
                if entry.is_dir() or entry.suffix == ".gguf":
                    found.setdefault(name, entry)
        return found
