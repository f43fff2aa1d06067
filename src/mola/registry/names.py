"""The grammar of adapter ids: what a name given to an adapter may be.

An adapter id is served as a model id: it goes into URLs
(``DELETE /v1/adapters/{name}``), logs, metrics labels and ``/v1/models``.
So it is kept to:

- ASCII letters, digits and ``. _ - : /``;
- segments between ``/`` that are neither empty nor ``.`` or ``..`` (no
  leading or trailing ``/``, no ``//``; clients rewrite dot segments in URLs);
- at most 128 characters.

Hub-style ``org/name`` (and ``org/name:v2``) ids fit.
"""

from __future__ import annotations

import re

from ..errors import InvalidAdapterName

MAX_ADAPTER_ID_CHARS = 128
_ALLOWED = re.compile(r"[A-Za-z0-9._:/-]+")
_BAD_CHAR = re.compile(r"[^A-Za-z0-9._:/-]")


def check_adapter_id(name: object, *, param: str = "name") -> str:
    """``name`` if it is a valid adapter id; else InvalidAdapterName naming the rule it breaks."""

    def bad(rule: str) -> InvalidAdapterName:
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        return InvalidAdapterName(f"Invalid adapter name {shown}: {rule}.", param=param)

    if not isinstance(name, str):
        raise bad("an adapter name must be a string")
    if not 1 <= len(name) <= MAX_ADAPTER_ID_CHARS:
        raise bad(f"an adapter name has 1 to {MAX_ADAPTER_ID_CHARS} characters, this one {len(name)}")
    if not _ALLOWED.fullmatch(name):
        char = _BAD_CHAR.search(name).group()
        kind = ("whitespace" if char.isspace() else "a control character" if not char.isprintable()
                else "the character")
        raise bad(f"it holds {kind} {char!r}; adapter names use only ASCII letters, digits "
                  "and . _ - : /")
    if name.startswith("/") or name.endswith("/"):
        raise bad("an adapter name does not start or end with '/'")
    segments = name.split("/")
    if "" in segments:
        raise bad("an adapter name has no empty segment ('//')")
    if ".." in segments or "." in segments:
        raise bad("an adapter name has no '.' or '..' segment")
    return name


def is_entry_name(name: str) -> bool:
    """Whether ``name`` is a valid adapter id that can name one entry of an
    adapter directory: a single segment, not hidden."""
    try:
        check_adapter_id(name)
    except InvalidAdapterName:
        return False
    return "/" not in name and not name.startswith(".")
