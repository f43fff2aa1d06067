"""The devtools scripts, run as a user runs them, into tmp directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm import load

from mola.adapters.formats import read_adapter

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT.parent / "shared" / "openai-openapi" / "openapi.yaml"


def run(script, *args):
    r = subprocess.run([sys.executable, str(ROOT / "devtools" / script), *map(str, args)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_tiny_model_and_adapter(tmp_path):
    model_dir = tmp_path / "m"
    run("make_tiny_model.py", model_dir, "--hidden-size", 32, "--layers", 3, "--vocab-size", 300)
    model, tok = load(str(model_dir))
    assert len(model.layers) == 3 and tok.has_chat_template
    run("make_random_adapter.py", tmp_path / "ad", "--model", model_dir, "--rank", 3,
        "--keys", "self_attn.k_proj,mlp.up_proj", "--num-layers", 2)
    weights = read_adapter(tmp_path / "ad")
    assert weights.rank == 3
    assert sorted(weights.modules) == [
        f"model.layers.{i}.{k}" for i in (1, 2) for k in ("mlp.up_proj", "self_attn.k_proj")
    ]


@pytest.mark.skipif(not SPEC.is_file(), reason="OpenAI's openapi.yaml is not beside this checkout")
def test_vendored_openai_schemas_are_current(tmp_path):
    out = tmp_path / "schemas.json"
    run("extract_openai_schemas.py", "--spec", SPEC, "--out", out)
    vendored = json.loads((ROOT / "tests" / "data" / "openai_schemas.json").read_text())
    assert json.loads(out.read_text()) == vendored
