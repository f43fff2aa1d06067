"""mola.adapters.host_safetensors against MLX's own reader, and module_rows' host
path against its MLX path (the same bits)."""

import io

import mlx.core as mx
import numpy as np
import pytest

from mola.adapters.host_safetensors import read_safetensors, read_safetensors_file
from mola.client import write_safetensors
from mola.lora.geometry import Sharding, TargetGeometry, module_rows


def body_of(tensors: dict, metadata: dict | None = None) -> bytes:
    out = io.BytesIO()
    mx.save_safetensors(out, tensors, metadata=metadata or {})
    return out.getvalue()


def same(x: mx.array, y: mx.array) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and bool(mx.array_equal(x, y, equal_nan=True))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_reads_what_mlx_reads(dtype, tmp_path):
    x = mx.random.normal((5, 3)).astype(dtype)
    tensors = {"m.lora_a": x, "m.lora_b": mx.array([[np.inf, np.nan, -0.0]]).astype(dtype),
               "scalar": mx.array(2.5).astype(dtype), "empty": mx.zeros((0, 4), dtype=dtype)}
    body = body_of(tensors, {"adapter_config": "{}"})
    metadata, read = read_safetensors(body)
    assert metadata == {"adapter_config": "{}"}
    theirs = mx.load(io.BytesIO(body), format="safetensors")
    assert set(read) == set(theirs) and all(same(read[k], theirs[k]) for k in theirs)
    path = tmp_path / "a.safetensors"
    path.write_bytes(body)
    assert all(same(v, theirs[k]) for k, v in read_safetensors_file(str(path)).items())


def test_leaves_what_it_does_not_take_to_mlx(tmp_path):
    assert read_safetensors(body_of({"x": mx.array([1, 2], dtype=mx.int32)})) is None
    assert read_safetensors(b"\x05\x00\x00\x00\x00\x00\x00\x00{not") is None
    assert read_safetensors(b"") is None
    cut = body_of({"x": mx.ones((4, 4))})[:-8]  # data shorter than the header says
    assert read_safetensors(cut) is None
    assert read_safetensors_file(str(tmp_path / "missing.safetensors")) is None


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("kind", ["none", "row", "column"])
def test_module_rows_on_the_host_are_the_mlx_rows(dtype, kind):
    a, b = mx.random.normal((8, 4)), mx.random.normal((4, 6))
    target = TargetGeometry(8, 6, Sharding(kind, 1, 2))
    host = module_rows(target, 16, dtype, a, b, 0.37)
    sh = target.sharding
    a_part = a[sh.part(8)] if kind == "row" else a
    b_part = b[:, sh.part(6)] if kind == "column" else b
    assert same(host.a, mx.contiguous(a_part.T.astype(dtype)))
    assert same(host.b, (0.37 * b_part.astype(mx.float32)).astype(dtype))
    assert (host.rank, host.folded_scale) == (4, 0.37)


def test_module_rows_of_experts_on_the_host():
    a, b = mx.random.normal((3, 8, 4)).astype(mx.float16), mx.random.normal((3, 4, 6)).astype(mx.float16)
    rows = module_rows(TargetGeometry(8, 6, num_experts=3), 16, mx.float32, a, b, 2.0)
    assert same(rows.a, a.swapaxes(1, 2).astype(mx.float32))
    assert same(rows.b, 2.0 * b.astype(mx.float32))


def test_module_rows_in_bfloat16_stay_with_mlx():
    a, b = mx.random.normal((8, 4)), mx.random.normal((4, 6))
    rows = module_rows(TargetGeometry(8, 6), 16, mx.bfloat16, a, b, 0.5)
    assert same(rows.a, a.T.astype(mx.bfloat16)) and same(rows.b, (0.5 * b).astype(mx.bfloat16))


def test_writes_what_mlx_reads_back():
    tensors = {"b.lora_a": mx.random.normal((3, 5)), "a.lora_b": mx.random.normal((2,)).astype(mx.float16),
               "c": mx.array([[1.5, -np.inf]]).astype(mx.bfloat16), "empty": mx.zeros((0, 2))}
    body = write_safetensors(tensors, {"adapter_config": '{"r": 2}'})
    read, metadata = mx.load(io.BytesIO(body), format="safetensors", return_metadata=True)
    assert metadata == {"adapter_config": '{"r": 2}'}
    assert set(read) == set(tensors) and all(same(read[k], tensors[k]) for k in tensors)
    assert read_safetensors(body)[0] == metadata
    with pytest.raises(ValueError, match="int32"):
        write_safetensors({"x": mx.array([1])})
