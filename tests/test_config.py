"""ServeConfig, the config file and how flags override it (mola/config.py, mola/cli/)."""

from __future__ import annotations

import textwrap

import pytest

from mola.cli import build_parser, config_from_args
from mola.cli.config_file import load_config_file
from mola.config import AdapterSpec, ServeConfig


def parse(*argv):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults():
    c = parse()
    assert (c.model, c.http.host, c.http.port, c.engine.max_loras, c.engine.max_lora_rank) == (None, "127.0.0.1", 8000, 8, 64)
    assert c.engine.max_loras == 8 and c.adapters == () and not c.allow_any_adapter_path


def test_toml_file_with_relative_paths(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "ads" / "sql").mkdir(parents=True)
    f = tmp_path / "mola.toml"
    f.write_text(textwrap.dedent("""
        model = "model"
        served_model_name = "base"
        port = 9001
        max-loras = 3
        adapter_dirs = ["ads"]

        [[adapters]]
        name = "sql"
        path = "ads/sql"
        scale = 0.5

        [[adapters]]
        name = "hub"
        path = "org/some-adapter"
    """))
    c = parse("--config", str(f))
    assert c.model == str(tmp_path / "model")
    assert (c.served_model_name, c.http.port, c.engine.max_loras) == ("base", 9001, 3)
    assert c.adapter_dirs == (str(tmp_path / "ads"),)
    assert c.adapters == (AdapterSpec("sql", str(tmp_path / "ads" / "sql"), 0.5),
                          AdapterSpec("hub", "org/some-adapter"))


def test_an_image_model_and_its_adapters_from_a_file(tmp_path):
    """[image_model] and [image_adapters], paths from the file's directory (docs/images.md)."""
    (tmp_path / "flux").mkdir()
    (tmp_path / "loras").mkdir()
    (tmp_path / "loras" / "ghibli.safetensors").write_bytes(b"")
    f = tmp_path / "mola.toml"
    f.write_text(textwrap.dedent("""
        image_dtype = "float32"

        [image_model]
        name = "klein"
        path = "flux"

        [image_adapters]
        ghibli = {path = "loras/ghibli.safetensors", scale = 0.7}
    """))
    c = parse("--config", str(f))
    assert (c.images.model.name, c.images.model.path, c.images.dtype) == ("klein", str(tmp_path / "flux"), "float32")
    assert c.images.adapters == (AdapterSpec("ghibli", str(tmp_path / "loras" / "ghibli.safetensors"), 0.7),)
    f.write_text('image_model = "klein=flux"\n')
    with pytest.raises(ValueError, match="'image_model' must be a table with a name and a path"):
        parse("--config", str(f))


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "mola.yaml"
    f.write_text(textwrap.dedent("""
        port: 9001
        max_lora_rank: 16
        adapters:
          a: /abs/a
          b: {path: /abs/b, scale: 2}
    """))
    c = parse("--config", str(f), "--port", "9002", "--adapter", "b=/other/b", "--adapter", "c=/abs/c")
    assert c.http.port == 9002 and c.engine.max_lora_rank == 16
    assert c.adapters == (AdapterSpec("a", "/abs/a"), AdapterSpec("b", "/other/b"), AdapterSpec("c", "/abs/c"))


@pytest.mark.parametrize("text, suffix, message", [
    ("portt = 1", ".toml", "unknown setting"),
    ("port = ", ".toml", "does not parse"),
    ("- 1\n- 2", ".yaml", "mapping at the top"),
    ("adapters = 5", ".toml", "adapters"),
    ("[[adapters]]\nname = 'x'", ".toml", "needs a name and a path"),
    ("port = 1", ".ini", "must end in"),
])
def test_bad_files_name_the_problem(tmp_path, text, suffix, message):
    f = tmp_path / f"c{suffix}"
    f.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config_file(f)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="port"):
        ServeConfig.from_settings(port=0)
    with pytest.raises(ValueError, match="more than once"):
        ServeConfig(adapters=(AdapterSpec("a", "/x"), AdapterSpec("a", "/y")))
    with pytest.raises(ValueError, match="max_lora_rank"):
        ServeConfig.from_settings(max_lora_rank=0)
    with pytest.raises(ValueError, match="scale"):
        AdapterSpec("a", "/x", float("nan"))
    with pytest.raises(ValueError, match="'int4'"):
        ServeConfig(dtype="int4")
    with pytest.raises(ValueError, match="unknown demo 'pirate'"):
        ServeConfig(demo="pirate")
    with pytest.raises(ValueError, match="demo 'echo' is served in place of a model; it cannot go with model 'm'"):
        ServeConfig(demo="echo", model="m")


def test_demo_from_flag_and_file(tmp_path):
    assert parse().demo == "chat" and parse("--demo", "echo").demo == "echo"
    f = tmp_path / "mola.toml"
    f.write_text('demo = "echo"\n')
    assert parse("--config", str(f)).demo == "echo"


def test_dtype_from_flag_and_file(tmp_path):
    assert parse().dtype == "auto"
    assert parse("--dtype", "keep").dtype == "keep"
    f = tmp_path / "mola.toml"
    f.write_text('model = "m.gguf"\ndtype = "float16"\n')
    c = parse("--config", str(f))
    assert c.dtype == "float16" and c.model == "m.gguf"
    assert parse("--config", str(f), "--dtype", "bfloat16").dtype == "bfloat16"


def test_access_and_limit_flags(monkeypatch):
    c = parse("--api-key", "k" * 12, "--admin-key", "a" * 12, "--protect-metrics", "--max-queue", "5",
              "--request-timeout", "2.5", "--shutdown-timeout", "4", "--max-stored-responses", "7")
    assert (c.http.api_key, c.http.admin_key, c.http.protect_metrics) == ("k" * 12, "a" * 12, True)
    assert (c.max_queue, c.request_timeout, c.http.shutdown_timeout) == (5, 2.5, 4.0)
    assert c.max_stored_responses == 7 and parse().max_stored_responses == 1024
    assert "k" * 12 not in repr(c)  # keys never appear in reprs or logs
    monkeypatch.setenv("MOLA_API_KEY", "from-the-env-1")
    assert parse().http.api_key == "from-the-env-1"
    assert parse("--api-key", "flag-beats-env").http.api_key == "flag-beats-env"
    with pytest.raises(ValueError, match="api_key"):
        ServeConfig.from_settings(api_key="short")
    with pytest.raises(ValueError, match="request_timeout"):
        ServeConfig(request_timeout=0)
    with pytest.raises(ValueError, match="max_stored_responses"):
        ServeConfig(max_stored_responses=-1)


def test_prompt_cache_bytes_from_flags_and_files(tmp_path):
    assert parse().engine.prompt_cache_bytes == 2**30  # the documented default, 1 GiB
    assert parse("--prompt-cache-bytes", "0").engine.prompt_cache_bytes == 0  # off
    assert parse("--prompt-cache-bytes", "512MB").engine.prompt_cache_bytes == 512 * 10**6
    assert parse("--prompt-cache-bytes", "2GiB").engine.prompt_cache_bytes == 2 * 2**30
    f = tmp_path / "mola.toml"
    f.write_text('prompt_cache_bytes = "1.5G"\n')
    assert parse("--config", str(f)).engine.prompt_cache_bytes == 1_500_000_000
    f.write_text("prompt-cache-bytes = 4096\n")
    assert parse("--config", str(f), "--prompt-cache-bytes", "8192").engine.prompt_cache_bytes == 8192
    for bad in ("-1", "lots", "1TB", "nan"):
        with pytest.raises(ValueError, match="size in bytes"):
            ServeConfig.from_settings(prompt_cache_bytes=bad)
    with pytest.raises(ValueError, match="prompt_cache_bytes"):
        ServeConfig.from_settings(prompt_cache_bytes=1.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prompt-cache-bytes", "-5"])


def test_host_tier_and_admission_settings(tmp_path):
    c = parse()
    assert (c.max_cpu_loras, c.adapter_cache_bytes, c.max_adapter_wait) == (None, None, 2.0)
    c = parse("--max-cpu-loras", "128", "--adapter-cache-bytes", "1.5GiB", "--max-adapter-wait", "0.5")
    assert (c.max_cpu_loras, c.adapter_cache_bytes, c.max_adapter_wait) == (128, 3 * 2**29, 0.5)
    f = tmp_path / "mola.toml"
    f.write_text('max-cpu-loras = 64\nadapter_cache_bytes = "512MB"\nmax_adapter_wait = 3\n')
    c = parse("--config", str(f))
    assert (c.max_cpu_loras, c.adapter_cache_bytes, c.max_adapter_wait) == (64, 512 * 10**6, 3)
    assert parse("--adapter-cache-bytes", "4096").adapter_cache_bytes == 4096
    with pytest.raises(SystemExit):  # argparse names the flag and the value
        parse("--adapter-cache-bytes", "lots")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        ServeConfig(max_cpu_loras=-1)
    with pytest.raises(ValueError, match="adapter_cache_bytes"):
        ServeConfig(adapter_cache_bytes=1.5)
    with pytest.raises(ValueError, match="max_adapter_wait"):
        ServeConfig(max_adapter_wait=0)
    f.write_text('adapter_cache_bytes = "-3GB"\n')
    with pytest.raises(ValueError, match="size in bytes"):
        parse("--config", str(f))


def test_image_input_flags_and_file_keys(tmp_path):
    """Images in chat (VisionConfig): the defaults, the flags, a file's keys, and bad values named."""
    c = parse()
    assert (c.vision.allow_remote_images, c.vision.max_image_bytes, c.vision.max_image_pixels,
            c.vision.max_images_per_request) == (False, 20 * 2**20, 40_000_000, 16)
    c = parse("--allow-remote-images", "--max-image-bytes", "5MB", "--max-image-pixels", "1000000",
              "--max-images-per-request", "3")
    assert (c.vision.allow_remote_images, c.vision.max_image_bytes, c.vision.max_image_pixels,
            c.vision.max_images_per_request) == (True, 5 * 10**6, 1_000_000, 3)
    f = tmp_path / "mola.toml"
    f.write_text('max_image_bytes = "1MiB"\nmax-images-per-request = 2\n')
    c = parse("--config", str(f), "--max-images-per-request", "4")
    assert (c.vision.max_image_bytes, c.vision.max_images_per_request) == (2**20, 4)
    for key, bad in (("max_image_pixels", 0), ("max_images_per_request", -1), ("max_image_bytes", 1.5)):
        with pytest.raises(ValueError, match=key):
            ServeConfig.from_settings(**{key: bad})
