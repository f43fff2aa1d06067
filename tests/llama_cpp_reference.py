"""An independent reference for GGUF llama models: llama.cpp's forward pass in numpy,
on tensors read and dequantized by gguf-py (GGUFReader, gguf.quants.dequantize), in
the file's own layout: q/k rows in llama.cpp's rope order, rotated as adjacent pairs
(llama.cpp's "normal" rope for LLM_ARCH_LLAMA). Nothing of mola is used, so agreeing
with it checks mola's names, q/k row order, rope convention, codecs and config.

A GGUF LoRA is applied the way llama.cpp does (src/llama-adapter.cpp):
W += (alpha / r) * lora_b @ lora_a, factors as stored (lora_b rows in rope order too).
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, quants


def _read(path) -> tuple[dict, dict[str, np.ndarray]]:
    reader = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    return meta, tensors


class LlamaCppReference:
    def __init__(self, model_path):
        meta, self.t = _read(model_path)
        arch = meta["general.architecture"]
        assert arch == "llama", arch
        self.n_layers = int(meta[f"{arch}.block_count"])
        self.n_head = int(meta[f"{arch}.attention.head_count"])
        self.n_kv = int(meta[f"{arch}.attention.head_count_kv"])
        self.eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
        self.base = float(meta[f"{arch}.rope.freq_base"])

    def with_lora(self, path, lora_scale: float = 1.0) -> "LlamaCppReference":
        """A copy with a GGUF LoRA applied (sharing the tensors it leaves alone)."""
        other = object.__new__(LlamaCppReference)
        other.__dict__.update(self.__dict__, t=dict(self.t))
        other._apply_lora(path, lora_scale)
        return other

    def _apply_lora(self, path, extra_scale: float) -> None:
        meta, lora = _read(path)
        alpha = float(meta.get("adapter.lora.alpha", 0.0))
        for name in lora:
            if name.endswith(".lora_a"):
                base = name[: -len(".lora_a")]
                a, b = lora[name], lora[base + ".lora_b"]  # [r, in], [out, r]
                scale = alpha / b.shape[1] if alpha else 1.0
                self.t[base] = self.t[base] + extra_scale * scale * (b @ a)

    def _norm(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def _rope(self, x):  # [T, H, D], adjacent pairs (x[2i], x[2i+1])
        T, _, D = x.shape
        theta = self.base ** (-np.arange(0, D, 2, dtype=np.float64) / D)  # [D/2]
        angle = np.arange(T)[:, None] * theta[None, :]  # [T, D/2]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def logits(self, tokens: list[int]) -> np.ndarray:
        """[T, vocab] for the whole sequence."""
        t = self.t
        x = t["token_embd.weight"][np.asarray(tokens)]  # [T, hidden]
        T = len(tokens)
        mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            h = self._norm(x, t[p + "attn_norm.weight"])
            q = (h @ t[p + "attn_q.weight"].T).reshape(T, self.n_head, -1)
            k = (h @ t[p + "attn_k.weight"].T).reshape(T, self.n_kv, -1)
            v = (h @ t[p + "attn_v.weight"].T).reshape(T, self.n_kv, -1)
            q, k = self._rope(q), self._rope(k)
            group = self.n_head // self.n_kv
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [T, H, D]
            scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1]) + mask
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            attn = np.einsum("hts,shd->thd", scores, v).reshape(T, -1)
            x = x + attn @ t[p + "attn_output.weight"].T
            h = self._norm(x, t[p + "ffn_norm.weight"])
            gate, up = h @ t[p + "ffn_gate.weight"].T, h @ t[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "ffn_down.weight"].T
        x = self._norm(x, t["output_norm.weight"])
        return x @ t.get("output.weight", t["token_embd.weight"]).T

    def greedy(self, prompt: list[int], max_tokens: int, stop: set[int]) -> tuple[list[int], list[np.ndarray]]:
        """Greedy tokens (up to and including a stop token) and the logits each was
        picked from."""
        tokens, picked = list(prompt), []
        out = []
        for _ in range(max_tokens):
            row = self.logits(tokens)[-1]
            token = int(np.argmax(row))
            out.append(token)
            picked.append(row)
            tokens.append(token)
            if token in stop:
                break
        return out, picked
