"""Where the adapter goes: the output path checked before training, the
finished adapter moved into place atomically, and the hot load into a
running mola (--serve-url)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import OutputPathError, TrainError


def check_output(out: Path, force: bool = False, protect: tuple[Path, ...] = ()) -> None:
    """The adapter directory can be written: not a file, not an existing
    non-empty directory (unless ``force``), under a writable directory, and
    not a directory holding the data or model (``protect``) when forced."""
    out = Path(out)
    if out.suffix == ".gguf":
        return _check_file_output(out, force)
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise OutputPathError(f"the output path {out} is a file; --out takes a directory for the adapter "
                              "(or a FILE.gguf)")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise OutputPathError(f"the output directory {out} already exists and is not empty; "
                                  "choose another --out or pass --force to replace it")
        resolved = out.resolve()
        if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
            raise OutputPathError(f"refusing to replace {out}")
        for p in protect:
            p = Path(p).resolve()
            if p == resolved or resolved in p.parents:
                raise OutputPathError(f"refusing to replace {out}: it holds {p}")
    _check_parent(out)


def _check_file_output(out: Path, force: bool) -> None:
    """A .gguf output: not a directory, not an existing file unless ``force``."""
    if out.is_dir():
        raise OutputPathError(f"the output path {out} is a directory; a .gguf output is a file")
    if out.exists() and not force:
        raise OutputPathError(f"the output file {out} already exists; choose another --out or pass "
                              "--force to replace it")
    _check_parent(out)


def _check_parent(out: Path) -> None:
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(f"cannot create {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot create {out}: {parent} is not writable")


def place(tmp: Path, out: Path) -> None:
    """Move the finished adapter into ``out``, replacing what was there."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.resolve().name}.old-", dir=out.resolve().parent))
        os.replace(out, old / "x")
        try:
            os.replace(tmp, out)
        except OSError:
            os.replace(old / "x", out)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
        return
    os.replace(tmp, out)


def hot_load(url: str, name: str, path: Path, api_key: str | None = None, timeout: float = 120.0) -> dict:
    """POST /v1/adapters {"name", "path"} to a running mola; the adapter object
    it answers. Raises TrainError with the server's message."""
    import urllib.error
    import urllib.request

    endpoint = url.rstrip("/") + "/v1/adapters"
    body = json.dumps({"name": name, "path": str(Path(path).resolve())}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except Exception:
            message = e.reason
        hint = ""
        if e.code == 403:
            hint = (" (start the server with an --adapter-dir that holds the adapter, or with "
                    "--allow-any-adapter-path)")
        elif e.code == 409:
            hint = " (choose another --name, or unload the old one first)"
        raise TrainError(f"the adapter was written to {path}, but {endpoint} refused to load it: "
                         f"HTTP {e.code}: {message}{hint}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise TrainError(f"the adapter was written to {path}, but {endpoint} could not be reached: "
                         f"{reason}") from None
