"""What the directory formats share: their adapter_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import InvalidAdapter

CONFIG_FILE = "adapter_config.json"


def read_config(path: Path) -> dict:
    """The adapter's config as a dict, or InvalidAdapter naming what is wrong."""
    config_file = path / CONFIG_FILE
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise InvalidAdapter(f"Adapter at {path} has no {CONFIG_FILE}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidAdapter(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{config_file} must hold a JSON object.")
    return config
