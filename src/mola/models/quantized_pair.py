"""Layers whose weight is held as a QuantizedPair (codecs.py): the sum of two affine-
quantized halves, each holding every other 16-weight sub-block of the matrix and
zeros between. That is how a GGUF Q6_K matrix stays exact in MLX, whose groups are
32 weights or more while Q6_K's scales change every 16: 2 x (6 bits + two float32
numbers per 32) = 16 bits a weight, against 32 dequantized to float32.

QuantizedPairLinear is an nn.QuantizedLinear (the low half, and the bias) plus the
high half, so that whatever wraps a QuantizedLinear wraps it alike (mola's
MultiLoRALinear, mlx-lm's LoRALinear, which take its dims from weight and bits and
call it); QuantizedPairEmbedding likewise is an nn.QuantizedEmbedding, for a tied
Q6_K token_embd (``as_linear``). Anything that reads a QuantizedLinear's weight,
scales and biases alone (mlx-lm's dequantize_model, a save for mlx-lm) would miss
the high half: :func:`unpair` turns the pairs back into float layers first."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

HIGH = ("weight_high", "scales_high", "biases_high")


def _high(layer: nn.Module) -> tuple[mx.array, mx.array, mx.array]:
    return tuple(layer[k] for k in HIGH)


class QuantizedPairLinear(nn.QuantizedLinear):
    """y = x @ (W_low + W_high)^T + bias, as two quantized matmuls."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool, group_size: int, bits: int):
        super().__init__(input_dims, output_dims, bias, group_size=group_size, bits=bits)
        for k, v in zip(HIGH, (self.weight, self.scales, self.biases)):
            setattr(self, k, mx.zeros_like(v))  # replaced by load_weights

    def __call__(self, x):
        w, scales, biases = _high(self)
        high = mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True,
                                   group_size=self.group_size, bits=self.bits)
        return super().__call__(x) + high

    def dequantized(self) -> mx.array:
        """The whole weight [out, in], exactly (one half is 0 wherever the other is not)."""
        return _dequantize(self)


class QuantizedPairEmbedding(nn.QuantizedEmbedding):
    """Rows of W_low + W_high; ``as_linear`` for a head tied to it."""

    def __init__(self, num_embeddings: int, dims: int, group_size: int, bits: int):
        super().__init__(num_embeddings, dims, group_size=group_size, bits=bits)
        for k, v in zip(HIGH, (self.weight, self.scales, self.biases)):
            setattr(self, k, mx.zeros_like(v))

    def __call__(self, x):
        w, scales, biases = _high(self)
        high = mx.dequantize(w[x], scales=scales[x], biases=biases[x], group_size=self.group_size, bits=self.bits)
        return super().__call__(x) + high

    def as_linear(self, x):
        w, scales, biases = _high(self)
        high = mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True,
                                   group_size=self.group_size, bits=self.bits)
        return super().as_linear(x) + high

    def dequantized(self) -> mx.array:
        return _dequantize(self)


def _dequantize(layer) -> mx.array:
    halves = [(layer.weight, layer.scales, layer.biases), _high(layer)]
    low, high = (mx.dequantize(w, s, b, group_size=layer.group_size, bits=layer.bits) for w, s, b in halves)
    return low + high


def make_pairs(model: nn.Module, paths, group_size: int, bits: int) -> None:
    """Replace the nn.Linear / nn.Embedding at each of ``paths`` by its pair layer
    (weights to be loaded after)."""
    modules = dict(model.named_modules())
    pairs = []
    for path in paths:
        m = modules[path]
        if isinstance(m, nn.Embedding):
            pairs.append((path, QuantizedPairEmbedding(*m.weight.shape, group_size, bits)))
        elif isinstance(m, nn.Linear):
            out_dims, in_dims = m.weight.shape
            pairs.append((path, QuantizedPairLinear(in_dims, out_dims, "bias" in m, group_size, bits)))
        else:
            raise TypeError(f"{path} is a {type(m).__name__}, which no quantized pair replaces")
    model.update_modules(tree_unflatten(pairs))


def unpair(model: nn.Module, dtype: mx.Dtype) -> list[str]:
    """Replace every pair layer by the float layer of the same weight in ``dtype``
    (exact in float32); the paths replaced."""
    pairs = []
    for path, m in model.named_modules():
        if isinstance(m, QuantizedPairLinear):
            out_dims, in_dims = m.dequantized().shape
            layer = nn.Linear(in_dims, out_dims, bias="bias" in m)
            layer.weight = m.dequantized().astype(dtype)
            if "bias" in m:
                layer.bias = m.bias.astype(dtype)
            pairs.append((path, layer))
        elif isinstance(m, QuantizedPairEmbedding):
            layer = nn.Embedding(*m.dequantized().shape)
            layer.weight = m.dequantized().astype(dtype)
            pairs.append((path, layer))
    if pairs:
        model.update_modules(tree_unflatten(pairs))
    return [p for p, _ in pairs]
