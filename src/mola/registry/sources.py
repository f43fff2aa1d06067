"""Where adapters may come from: one resolver and one check for every way an
adapter is reached (REST, vLLM's routes, an --adapter-dir entry by name, the
config file, --adapter).

The policy: the real path of an adapter (symlinks followed) must lie under
one of the ``--adapter-dir`` roots, or be the real path of an adapter named at
start (``--adapter``, the config file: trusted as the operator wrote them).
``--allow-adapter-symlinks`` also accepts a path that lies under a root as
written, wherever symlinks in it lead (a path with a ``..`` part must still
resolve under a root). ``--allow-any-adapter-path`` lifts the check. A hub id
(``org/name``) that is not a local path goes through huggingface-hub's cache.

A path named in a request (``{"path": ...}`` in its ``adapters``) is checked
by the same policy, before anything at it is opened or even looked for, and
is never a hub id; its :func:`content_version` (the stat of its files) tells
an edited adapter from the one cached. The roots of ``--adapter-resolver
dir:PATH`` are allowed roots too, but not scanned.

Each entry of an adapter directory (a subdirectory, or a ``.gguf`` file) whose
name is a valid adapter id is an adapter named after it, found on first use.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import AdapterPathNotAllowed, AdapterPathNotFound, InvalidRequest
from .names import is_entry_name

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


def _under(path: Path, roots) -> bool:
    return any(path == root or root in path.parents for root in roots)


class AdapterSources:
    def __init__(
        self,
        adapter_dirs: list[str | Path] = (),
        named_paths: list[str | Path] = (),
        allow_any_path: bool = False,
        allow_symlinks: bool = False,
        resolver_dirs: list[str | Path] = (),
    ):
        given = [Path(os.path.abspath(Path(d).expanduser())) for d in adapter_dirs]
        self.adapter_dirs = [d.resolve() for d in given]  # the real roots, scanned
        written = [Path(os.path.abspath(Path(d).expanduser())) for d in resolver_dirs]
        self.resolver_dirs = [d.resolve() for d in written]  # real roots, not scanned
        self._roots = [*self.adapter_dirs, *self.resolver_dirs]
        self._written_roots = {*given, *written, *self._roots}  # for --allow-adapter-symlinks
        self.allow_any_path = allow_any_path
        self.allow_symlinks = allow_symlinks
        self._named = {Path(p).expanduser().resolve() for p in named_paths}

    def allow(self, path: str | Path) -> None:
        """Allow one more path (an adapter named at start)."""
        self._named.add(Path(path).expanduser().resolve())

    def allowed(self, path: Path) -> Path | None:
        """The one check: the real path of ``path`` if the policy allows it, else None."""
        real = path.resolve()
        if self.allow_any_path or real in self._named or _under(real, self._roots):
            return real
        written = Path(os.path.abspath(path))
        if self.allow_symlinks and ".." not in path.parts and _under(written, self._written_roots):
            return real
        return None

    def resolve(self, given: str) -> str:
        """A local path (checked against the policy) or a hub snapshot path."""
        if not isinstance(given, str) or not given.strip():
            raise InvalidRequest("An adapter path must be a non-empty string.", param="path")
        try:
            path = Path(given).expanduser()
            exists = path.exists()
            real = self.allowed(path) if exists else None
        except (RuntimeError, OSError, ValueError) as e:  # "~nobody/x", NUL bytes, loops
            raise AdapterPathNotFound(f"The adapter path {given!r} is not usable: {e}") from None
        if exists:
            if real is None:
                raise AdapterPathNotAllowed(self._refusal(given, path))
            return str(real)
        if looks_like_hub_id(given):
            return self._from_hub(given)
        raise AdapterPathNotFound(f"The adapter path does not exist: {given}")

    def resolve_request_path(self, given: str) -> str:
        """The checked real path of an adapter named by path in a request.
        The policy comes first, whether or not anything is there, so that a
        client learns nothing about paths outside it (the 403 names the
        policy; the paths go to the log); then the path must exist. Never a
        hub id."""
        if not isinstance(given, str) or not given.strip():
            raise InvalidRequest("An adapter path must be a non-empty string.", param="adapters")
        try:
            path = Path(given).expanduser()
            real = self.allowed(path)
            exists = real is not None and real.exists()
        except (RuntimeError, OSError, ValueError) as e:  # "~nobody/x", NUL bytes, loops
            raise AdapterPathNotFound(f"The adapter path {given!r} is not usable: {e}") from None
        if real is None:
            log.warning("adapter path %r refused: it resolves to %s, outside the adapter directories",
                        given, path.resolve())
            raise AdapterPathNotAllowed(
                f"The adapter path {given!r} is outside the directories this server loads adapters "
                "from (its --adapter-dir and dir: resolvers, symlinks followed)."
            )
        if not exists:
            raise AdapterPathNotFound(f"The adapter path does not exist: {given}")
        return str(real)

    def find_in(self, root: Path, name: str) -> str | None:
        """The checked real path of adapter id ``name`` under ``root`` (a
        directory, or a ``.gguf`` file), if there is one: ``org/name`` is
        ``root/org/name``. A candidate that resolves outside the policy
        raises AdapterPathNotAllowed without naming paths (they go to the log)."""
        for candidate in (root / name, root / f"{name}.gguf"):
            try:
                if not candidate.exists():
                    continue
                real = self.allowed(candidate)
            except (OSError, RuntimeError, ValueError):  # names too long, loops
                return None
            if real is None:
                log.warning("adapter %s refused: %s resolves to %s, outside the adapter directories",
                            name, candidate, candidate.resolve())
                raise AdapterPathNotAllowed(
                    f"The adapter '{name}' is an entry of an adapter directory that resolves (through "
                    "a symlink) outside the allowed adapter directories, so this server refuses "
                    "it; --allow-adapter-symlinks lets the server follow such links."
                )
            return str(real)
        return None

    def _refusal(self, given: str, path: Path) -> str:
        roots = ", ".join(map(str, self._roots)) or "none configured"
        message = (f"The adapter path {given} (resolving to {path.resolve()}) is outside the allowed "
                   f"adapter directories ({roots}); start the server with --adapter-dir covering it, "
                   "or with --allow-any-adapter-path")
        if _under(Path(os.path.abspath(path)), self._written_roots) and ".." not in path.parts:
            message += ("; it lies in an adapter directory but a symlink leads out of it, which "
                        "--allow-adapter-symlinks accepts")
        return message + "."

    def _from_hub(self, repo: str) -> str:
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(repo, allow_patterns=HUB_PATTERNS)
        except Exception as e:  # offline and not cached, unknown repo, gated, ...
            raise AdapterPathNotFound(
                f"The adapter '{repo}' is neither a local path nor available from the "
                f"Hugging Face hub or its local cache: {type(e).__name__}: {e}"
            ) from None

    def discover(self, name: str) -> str | None:
        """The checked real path of the adapter-directory entry ``name``, if
        there is one. An entry the policy refuses (a symlink out of the
        adapter directories) raises AdapterPathNotAllowed, naming the policy
        but not the paths (whoever asks by name need not be an admin)."""
        if not is_entry_name(name):
            return None
        for root in self.adapter_dirs:
            found = self.find_in(root, name)
            if found is not None:
                return found
        return None

    def scan(self) -> dict[str, str]:
        """Every entry of every adapter directory that the policy allows:
        name -> checked real path (the first root wins)."""
        found: dict[str, str] = {}
        for root in self.adapter_dirs:
            if not root.is_dir():
                log.warning("adapter directory %s does not exist", root)
                continue
            for entry in sorted(root.iterdir()):
                name = entry.stem if entry.suffix == ".gguf" and entry.is_file() else entry.name
                if entry.name.startswith(".") or not (entry.is_dir() or entry.suffix == ".gguf"):
                    continue
                if name in found:
                    continue
                if not is_entry_name(name):
                    log.warning("adapter directory entry %s skipped: %r is not a valid adapter id", entry, name)
                    continue
                try:
                    real = self.allowed(entry)
                except (OSError, RuntimeError) as e:  # symlink loops
                    log.warning("adapter directory entry %s skipped: %s", entry, e)
                    continue
                if real is None:
                    log.warning("adapter directory entry %s skipped: it resolves to %s, outside the "
                                "adapter directories", entry, entry.resolve())
                    continue
                found[name] = str(real)
        return found


ADAPTER_FILES = ("adapter_config.json", "*.safetensors", "*.gguf")


def content_version(real: str | Path) -> tuple:
    """What tells one version of the adapter files at ``real`` from another,
    without opening them: (name, size, mtime, inode) of the file, or of each
    adapter file of the directory. An edit, or a file replaced by a rename,
    changes it."""
    path = Path(real)
    files = [path] if path.is_file() else sorted({f for pattern in ADAPTER_FILES for f in path.glob(pattern)})
    version = []
    for f in files:
        try:
            st = f.stat()
        except OSError:  # vanished meanwhile: a different version
            continue
        version.append((f.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(version)
