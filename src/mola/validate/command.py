"""`mola validate ADAPTER [--model M] [--json]`: describe an adapter and, with
--model, check it against that model offline, with the readers and checks
mola serve runs (``recipe.read_checked``); exit 0 when it would load, 1 with
serve's message when it would not."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from ..engine.config import DEFAULT_EXPERT_RANK
from ..errors import MolaError
from ..adapters.recipe import read_checked
from ..registry.sources import AdapterSources
from .describe import AdapterInfo, describe
from .offline import ModelShape, model_shape


@dataclass
class Report:
    adapter: str  # as given
    info: AdapterInfo | None = None
    model: ModelShape | None = None
    error: str | None = None  # what mola serve would say

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        model = None
        if self.model is not None:
            g = self.model.geometry
            experts = sum(t.num_experts is not None for t in g.targets.values())
            vocab = _vocab_targets(g)
            model = {"path": str(self.model.path), "model_type": self.model.model_type,
                     "layers": self.model.num_layers, "targets": len(g.targets) - experts - len(vocab),
                     "vocab_targets": vocab, "tied_head": bool(g.vocab and g.vocab.tied),
                     "expert_targets": experts, "num_experts": g.num_experts,
                     "dtype": str(g.dtype).removeprefix("mlx.core.")}
            if self.model.memory is not None:
                plan = self.model.memory
                model["memory"] = {"dtype": plan.dtype, "compute": plan.compute, "bytes": plan.total,
                                   "groups": plan.groups}
            if self.model.conversion is not None:
                model["conversion"] = self.model.conversion
        return {"adapter": self.adapter, "ok": self.ok, "error": self.error,
                **({"info": self.info.to_json()} if self.info else {"info": None}), "model": model}


def _vocab_targets(geometry) -> list[str]:
    """The embedding and the head among a geometry's targets."""
    v = geometry.vocab
    return [p for p in (v.embed_path, v.head_path) if p is not None] if v is not None else []


def validate(adapter: str, model: str | None = None, max_rank: int = 64, dtype: str = "auto",
             max_expert_rank: int = DEFAULT_EXPERT_RANK) -> Report:
    report = Report(adapter)
    try:
        real = AdapterSources(allow_any_path=True).resolve(adapter)  # a path, or a hub id through its cache
        report.info = describe(real)
        if model is not None:
            report.model = model_shape(model, max_rank, dtype, max_expert_rank)
            read_checked(real, report.model.geometry, report.model.config)  # what serve's reader runs
    except MolaError as e:
        report.error = e.message
    return report


def _layers(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for n in layers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _vocab(parts: dict) -> str:
    """The embedding/head parts of an adapter, in words."""
    words = [f"{what} LoRA rank {parts[key]}" for key, what in
             (("embedding_lora_rank", "embedding"), ("head_lora_rank", "head")) if parts[key]]
    words += [f"{parts[key]} {what} rows replaced (trainable tokens)" for key, what in
              (("embedding_tokens", "embedding"), ("head_tokens", "head")) if parts[key]]
    return ", ".join(words) + (" (tied to a tied head)" if parts.get("tied") else "")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def text(report: Report) -> list[str]:
    lines = []
    info = report.info
    if info is not None:
        arch = f", {info.architecture}" if info.architecture else ""
        scales = ", ".join(f"{s:g}" for s in info.scales)
        alpha = f" (alpha {info.alpha:g})" if info.alpha is not None else ""
        ranks = ", ".join(map(str, info.ranks))
        lines += [f"adapter  {info.path} ({info.format}{arch})", f"kind     {info.kind}",
                  f"rank     {ranks}   scale {scales}{alpha}",
                  f"targets  {', '.join(info.targets)}",
                  f"layers   {_layers(info.layers) or '-'} ({info.modules} module{'s' * (info.modules != 1)})",
                  f"dtype    {', '.join(info.dtypes)}",
                  f"size     {_size(info.size_bytes)} on disk, {info.parameters:,} parameters",
                  f"base     {info.base or '(not declared)'}"]
        if info.vocab:
            lines.insert(3, f"vocab    {_vocab(info.vocab)}")
        if info.expert_modules:
            lines.insert(3, f"experts  {', '.join(info.expert_targets)}: {info.num_experts} experts each, "
                            f"{info.expert_modules} of the {info.modules} modules")
    if report.model is not None:
        m = report.model
        dtype = str(m.geometry.dtype).removeprefix("mlx.core.")
        experts = sum(t.num_experts is not None for t in m.geometry.targets.values())
        vocab = _vocab_targets(m.geometry)
        moe = f" + {experts} expert projections of {m.geometry.num_experts} experts" if experts else ""
        head = " (tied)" if m.geometry.vocab and m.geometry.vocab.tied else ""
        extra = f" + {' and '.join(vocab)}{head}" if vocab else ""
        lines.append(f"model    {m.path} ({m.model_type}, {m.num_layers} layers, "
                     f"{len(m.geometry.targets) - experts - len(vocab)} linears{moe}{extra}, {dtype})")
        if m.memory is not None:
            lines.append(f"memory   {_size(m.memory.total)} as --dtype {m.memory.dtype}, by tensor group:")
            lines += [f"         {line}" for line in m.memory.lines()]
        if m.conversion is not None:
            lines.append(f"convert  {m.conversion}")
    if report.ok:
        lines.append("ok       the adapter would load" + (" on this model" if report.model else
                                                          " (pass --model to check it against a base)"))
    return lines


def run(adapter: str, model: str | None, as_json: bool, max_rank: int, dtype: str = "auto",
        max_expert_rank: int = DEFAULT_EXPERT_RANK) -> int:
    report = validate(adapter, model, max_rank, dtype, max_expert_rank)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in text(report):
            print(line)
        if report.error:
            print(f"[mola] error: {report.error}", file=sys.stderr)
    return 0 if report.ok else 1
