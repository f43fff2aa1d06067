"""The training data, checked line by line before any model loads: a folder
with train.jsonl (and optionally valid.jsonl), one example per line in a
format mlx-lm's tuner reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError
from .config import DEFAULT_BATCH_SIZE

# The data formats mlx-lm's tuner reads: name -> (required keys, optional keys).
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "chat": (("messages",), ("tools",)),
    "completions": (("prompt", "completion"), ("tools",)),
    "text": (("text",), ()),
}
ROLES = ("system", "developer", "user", "assistant", "tool")
DATA_FILES = ("train.jsonl", "valid.jsonl")


@dataclass
class DataFile:
    path: Path
    format: str
    examples: list[dict]


@dataclass
class DataSet:
    train: DataFile
    valid: DataFile | None

    @property
    def format(self) -> str:
        return self.train.format


def _format_of(obj: dict) -> str | None:
    if "messages" in obj:
        return "chat"
    if "prompt" in obj or "completion" in obj:
        return "completions"
    if "text" in obj:
        return "text"
    return None


def _check_example(obj, where: str) -> str:
    """The example's format; raises DataError naming ``where`` (file:line)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    fmt = _format_of(obj)
    if fmt is None:
        found = ", ".join(sorted(obj)) or "none"
        raise DataError(
            f"{where}: no data keys: expected \"messages\" (chat), \"prompt\" and \"completion\" "
            f"(completions) or \"text\"; found keys: {found}"
        )
    required, optional = FORMATS[fmt]
    missing = [k for k in required if k not in obj]
    if missing:
        raise DataError(f"{where}: the {fmt} format needs {' and '.join(repr(k) for k in required)}; "
                        f"missing {', '.join(repr(k) for k in missing)}")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        allowed = ", ".join(repr(k) for k in required + optional)
        raise DataError(f"{where}: unknown key(s) {', '.join(repr(k) for k in unknown)} "
                        f"for the {fmt} format (it takes {allowed})")
    if fmt == "chat":
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: \"messages\" must be a non-empty list of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise DataError(f"{where}: messages[{i}] must be an object with \"role\" and \"content\"")
            role = m.get("role")
            if role not in ROLES:
                raise DataError(f"{where}: messages[{i}] has role {role!r}; expected one of {', '.join(ROLES)}")
            content = m.get("content")
            if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
                raise DataError(f"{where}: messages[{i}] (role {role}) needs a string \"content\"")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: the conversation has no assistant message to learn from")
    elif fmt == "completions":
        for k in ("prompt", "completion"):
            if not isinstance(obj[k], str):
                raise DataError(f"{where}: \"{k}\" must be a string, got {type(obj[k]).__name__}")
        if not obj["completion"]:
            raise DataError(f"{where}: \"completion\" is empty")
    else:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise DataError(f"{where}: \"text\" must be a non-empty string")
    if "tools" in obj and not (isinstance(obj["tools"], list) and all(isinstance(t, dict) for t in obj["tools"])):
        raise DataError(f"{where}: \"tools\" must be a list of tool objects")
    return fmt


def read_data_file(path: Path) -> DataFile:
    """Parse and check one JSONL file: every line one example of one format.
    Blank lines are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    examples: list[dict] = []
    fmt = first_line = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        line_fmt = _check_example(obj, where)
        if fmt is None:
            fmt, first_line = line_fmt, lineno
        elif line_fmt != fmt:
            raise DataError(
                f"{where}: this example is in the {line_fmt} format but line {first_line} is in the "
                f"{fmt} format; one file must use one format"
            )
        examples.append(obj)
    if not examples:
        raise DataError(f"{path} is empty: it holds no examples")
    return DataFile(path=path, format=fmt, examples=examples)


def check_data(data_dir: Path, batch_size: int = DEFAULT_BATCH_SIZE) -> DataSet:
    """Check a data directory as mlx-lm will read it; raises DataError naming
    the file, line and problem."""
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise DataError(f"the data directory {data_dir} does not exist")
    if not data_dir.is_dir():
        raise DataError(f"{data_dir} is not a directory; --data takes a directory holding train.jsonl "
                        "(and optionally valid.jsonl)")
    train_path = data_dir / "train.jsonl"
    if not train_path.is_file():
        raise DataError(f"{data_dir} has no train.jsonl (one JSON example per line)")
    train = read_data_file(train_path)
    valid = read_data_file(data_dir / "valid.jsonl") if (data_dir / "valid.jsonl").is_file() else None
    for f in (train, valid):
        if f is not None and len(f.examples) < batch_size:
            raise DataError(f"{f.path} has {len(f.examples)} example(s); a batch size of {batch_size} needs "
                            f"at least {batch_size} (lower --batch-size or add examples)")
    return DataSet(train=train, valid=valid)
