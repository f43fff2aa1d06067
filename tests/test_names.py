"""The adapter id grammar (mola/registry/names.py), enforced on every way a name
is made: REST, vLLM's route, --adapter, the config file, mola train --name;
names with '/' through the URL routes, raw and %2F-encoded; the base
model's name."""

from __future__ import annotations

import pytest

from mola.cli import build_parser, config_from_args
from mola.cli.config_file import load_config_file
from mola.config import AdapterSpec
from mola.errors import InvalidAdapterName
from mola.registry.names import check_adapter_id, is_entry_name
from mola.train import TrainConfig

from helpers.schemas import validate_schema
from helpers.scripted import InProcessServer, tokenizer_model

VALID = ["a", "upper", "org/name", "org/name:v2", "A-b_c.d", "x" * 128, "a.b/c-d/e_f", "v1.0", ".hidden"]
# name -> words of the rule its message must name
INVALID = {
    "": "1 to 128 characters",
    "x" * 129: "1 to 128 characters",
    "..": "'..' segment",
    ".": "'.' or '..' segment",
    "../evil": "'..' segment",
    "a/../../b": "'..' segment",
    "../../etc/passwd": "'..' segment",
    "a/./b": "'.' or '..' segment",
    "/abs": "start or end with '/'",
    "trailing/": "start or end with '/'",
    "a//b": "empty segment",
    "a b": "whitespace",
    " a": "whitespace",
    "a\tb": "whitespace",
    "a\nb": "whitespace",
    "a\x00b": "control character",
    "a\x7fb": "control character",
    "naïve": "ASCII letters, digits and . _ - : /",
    "a\\b": "ASCII letters, digits and . _ - : /",
    "a%2Fb": "ASCII letters, digits and . _ - : /",
    "a?b": "ASCII letters, digits and . _ - : /",
}


@pytest.mark.parametrize("name", VALID)
def test_valid_ids(name):
    assert check_adapter_id(name) == name


@pytest.mark.parametrize("name,rule", INVALID.items())
def test_invalid_ids_name_the_rule(name, rule):
    with pytest.raises(InvalidAdapterName, match=rule.replace(".", r"\.").replace("?", r"\?")) as e:
        check_adapter_id(name, param="lora_name")
    assert e.value.param == "lora_name"


def test_non_strings_and_entry_names():
    for value in (None, 5, ["a"]):
        with pytest.raises(InvalidAdapterName, match="must be a string"):
            check_adapter_id(value)
    assert is_entry_name("alpha") and is_entry_name("v1.0")
    assert not any(map(is_entry_name, ["org/name", "..", ".hidden", "a b"]))


def test_adapter_spec_cli_config_and_train_refuse_bad_names(tmp_path, capsys):
    with pytest.raises(ValueError, match="'..' segment"):
        AdapterSpec("../x", "/p")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--adapter", "a b=/p"])
    assert "argument --adapter: Invalid adapter name 'a b': it holds whitespace" in capsys.readouterr().err
    assert config_from_args(build_parser().parse_args(["serve", "--adapter", "org/x=/p"])).adapters[0].name == "org/x"
    cfg = tmp_path / "mola.toml"
    cfg.write_text('[[adapters]]\nname = "a//b"\npath = "/p"\n')
    with pytest.raises(ValueError, match="empty segment"):
        load_config_file(cfg)
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(ValueError, match="'..' segment"):
        TrainConfig(model="m", data=data, out=tmp_path / "out", name="..")
    with pytest.raises(ValueError, match=r"whitespace.*\(set --name\)"):  # the output's name, to be served
        TrainConfig(model="m", data=data, out=tmp_path / "my adapter", serve_url="http://127.0.0.1:1")


@pytest.fixture(scope="module")
def server(tiny_model, adapters):
    """The app in process over a scripted engine: names are the protocol's, no model runs."""
    handle = InProcessServer(tokenizer_model(tiny_model), served_model_name="tiny", allow_any_adapter_path=True,
                             max_loras=2, max_lora_rank=16)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def chat(model):
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("name,rule", [("../../etc/passwd", "'..' segment"), ("..", "'..' segment"),
                                       ("a/../../b", "'..' segment"), ("a b", "whitespace"),
                                       ("x" * 129, "1 to 128"), ("", "1 to 128"), ("/a", "start or end")])
def test_rest_and_vllm_refuse_bad_names_with_400(client, adapters, name, rule):
    path = str(adapters["a"])
    for route, body, param in (("/v1/adapters", {"name": name, "path": path}, "name"),
                               ("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, "lora_name")):
        r = client.post(route, json=body)
        assert r.status_code == 400, (route, r.text)
        validate_schema("ErrorResponse", r.json())
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_adapter_name"
        assert rule in error["message"], error["message"]
    listed = {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert name not in listed


def test_hub_style_names_through_every_route(client, adapters, server):
    for name in ("org/raw", "org/enc"):
        r = client.post("/v1/adapters", json={"name": name, "path": str(adapters["a"])})
        assert r.status_code == 200 and r.json()["id"] == name
        r = client.post("/v1/chat/completions", json=chat(name))
        assert r.status_code == 200 and r.json()["model"] == name
    assert client.get("/v1/adapters/org/raw").json()["name"] == "org/raw"
    assert client.get("/v1/adapters/org%2Fenc").json()["name"] == "org/enc"
    assert client.get("/v1/models/org%2Fraw").json()["parent"] == "tiny"
    r = client.delete("/v1/adapters/org/raw")  # raw '/'
    assert r.status_code == 200 and r.json()["id"] == "org/raw"
    r = client.delete("/v1/adapters/org%2Fenc")  # %2F-encoded
    assert r.request.url.raw_path == b"/v1/adapters/org%2Fenc"
    assert r.status_code == 200 and r.json()["id"] == "org/enc"
    assert client.post("/v1/chat/completions", json=chat("org/enc")).status_code == 404
    assert client.delete("/v1/adapters/org%2Fenc").status_code == 404


def test_the_base_models_name_is_not_an_adapters(client, adapters):
    r = client.post("/v1/adapters", json={"name": "tiny", "path": str(adapters["a"])})
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_exists"
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(adapters["a"])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    assert client.delete("/v1/adapters/tiny").status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "tiny"}).status_code == 404
    r = client.post("/v1/chat/completions", json=chat("tiny"))
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_an_adapter_dir_entry_named_like_the_base_is_not_served_as_an_adapter(tiny_model, adapters, tmp_path):
    import shutil

    root = tmp_path / "dir"
    shutil.copytree(adapters["a"], root / "tiny")
    shutil.copytree(adapters["b"], root / "bad name")  # not a valid id: skipped, not fatal
    handle = InProcessServer(tokenizer_model(tiny_model), served_model_name="tiny", adapter_dirs=(str(root),),
                             max_loras=2, max_lora_rank=16)
    try:
        with handle.client() as c:
            models = c.get("/v1/models").json()["data"]
            assert [(m["id"], m["parent"]) for m in models] == [("tiny", None)]
            assert c.post("/v1/chat/completions", json=chat("bad name")).status_code == 404
    finally:
        handle.stop()
