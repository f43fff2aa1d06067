"""What one adapter brings, in a form that no longer depends on its file format,
and the checks that decide whether it can be applied exactly to the base."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import numpy as np

from ..errors import AdapterRankTooHigh, InvalidAdapter
from .dora import check_dora
from .vocab_parts import VocabParts



@dataclass(frozen=True)
class _Dims:
    """A plain linear's dims, for callers that give (input_dims, output_dims)."""

    input_dims: int
    output_dims: int
    num_experts: None = None


@dataclass(frozen=True)
class ModuleLoRA:
    """The LoRA of one linear: delta(x) = scale * (x @ a) @ b.

    For the experts of a mixture-of-experts layer (an mlx-lm SwitchLinear,
    whose weight is [E, out, in]) each expert has its own factors, stacked on
    a leading expert axis: a token routed to expert e gets
    scale * (x @ a[e]) @ b[e]. An expert the adapter leaves alone has zeros.
    """

    a: mx.array  # [in, r], or [E, in, r] for experts
    b: mx.array  # [r, out], or [E, r, out] for experts
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[-1]

    @property
    def num_experts(self) -> int | None:
        """E for an expert module, None for a plain linear."""
        return self.a.shape[0] if self.a.ndim == 3 else None


@dataclass(frozen=True)
class LoRAWeights:
    """An adapter read from disk: module path (as in ``model.named_modules()``,
    e.g. ``model.layers.3.self_attn.q_proj``) -> its factors."""

    source: str  # where it was read from, for messages and /v1/models' root
    format: str  # "mlx-lm", ...
    modules: dict[str, ModuleLoRA]
    # An activated LoRA's invocation: its delta applies from the last place these
    # tokens start in a prompt on, the base alone before (None: a plain LoRA).
    invocation_tokens: tuple[int, ...] | None = None
    # What it changes of the embedding and the head beyond plain factors (trainable
    # tokens, a tied embedding LoRA), resolved against the base by mola.adapters.vocab.
    vocab: VocabParts | None = None
    # A DoRA adapter's magnitudes: module path -> m [out] float32 (mola.adapters.dora; None: no DoRA).
    magnitudes: dict[str, mx.array] | None = None

    @property
    def kind(self) -> str:
        """"dora", "alora" (an activated LoRA) or "lora"."""
        if self.magnitudes:
            return "dora"
        return "lora" if self.invocation_tokens is None else "alora"

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def scale(self) -> float | None:
        """The adapter's scale when every module shares one, else None."""
        scales = {m.scale for m in self.modules.values()}
        return scales.pop() if len(scales) == 1 else None

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())

    @property
    def expert_nbytes(self) -> int:
        """Of its factors, what its expert modules take."""
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values() if m.num_experts is not None)

    @property
    def targets(self) -> tuple[str, ...]:
        """The kinds of module it adapts, each block's index left out
        (``self_attn.q_proj``, ``mlp.switch_mlp.up_proj``, ...)."""
        return tuple(sorted({re.sub(r"^.*?\blayers\.\d+\.", "", p) for p in self.modules}))

    @property
    def expert_modules(self) -> list[str]:
        """Module paths of its expert LoRA (mixture-of-experts projections)."""
        return sorted(p for p, m in self.modules.items() if m.num_experts is not None)


def validate(weights: LoRAWeights, targets: Mapping, max_rank: int, max_expert_rank: int | None = None,
             expert_slots: int | None = None) -> None:
    """Raise InvalidAdapter unless every module of ``weights`` fits the base.

    ``targets`` maps each module path that can carry LoRA to its
    (input_dims, output_dims), or to its TargetGeometry (which also names the
    expert count of a mixture-of-experts projection); ranks are bounded by
    ``max_rank``, and by ``max_expert_rank`` in expert projections.
    ``expert_slots`` (the server's, when known) explains a refusal of expert
    LoRA. Arrays must already be evaluated.
    """
    where = weights.source
    targets = {p: t if hasattr(t, "num_experts") else _Dims(*t) for p, t in targets.items()}
    if not weights.modules:
        raise InvalidAdapter(f"Adapter at {where} contains no LoRA weights.")
    unknown = sorted(p for p in weights.modules if p not in targets)
    if unknown:
        shown = ", ".join(unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        hint = ""
        if expert_slots == 0 and any(m.num_experts for m in weights.modules.values()):
            hint = (" (this server holds no expert LoRA slots: its base has no experts mola can put "
                    "LoRA on, or --max-expert-loras is 0)")
        raise InvalidAdapter(
            f"Adapter at {where} targets modules the base model does not have "
            f"(or that mola cannot put LoRA on): {shown}{hint}; {_describe(targets)}"
        )
    for path, m in sorted(weights.modules.items()):
        _check_shapes(where, path, m, targets[path])
        experts = targets[path].num_experts is not None
        limit = max_expert_rank if experts and max_expert_rank is not None else max_rank
        if m.rank > limit:
            flag = "--max-expert-lora-rank" if experts else "--max-lora-rank"
            raise InvalidAdapter(
                f"Adapter at {where} has rank {m.rank} (in {path}), above the server's {flag} {limit}."
            )
        if not math.isfinite(m.scale):
            raise InvalidAdapter(f"Adapter at {where}: scale {m.scale} of {path} is not finite.")
    for path in sorted(weights.modules):
        m = weights.modules[path]
        if not (all_finite(m.a) and all_finite(m.b)):
            raise InvalidAdapter(f"Adapter at {where}: {path} contains non-finite values (NaN or Inf).")
    if weights.magnitudes:
        check_dora(weights, targets)


def _check_shapes(where: str, path: str, m: ModuleLoRA, target) -> None:
    """InvalidAdapter unless a [in, r] and b [r, out] (experts: [E, in, r] and
    [E, r, out]) fit the target linear."""
    E, input_dims, output_dims = target.num_experts, target.input_dims, target.output_dims
    found = f"found lora_a {tuple(m.a.shape)} and lora_b {tuple(m.b.shape)}"
    if E is None and (m.a.ndim != 2 or m.b.ndim != 2):
        what = "per-expert factors" if m.a.ndim == 3 else "factors that are not matrices"
        raise InvalidAdapter(f"Adapter at {where}: {path} is a plain linear, but the adapter has {what}: {found}.")
    if E is not None and (m.a.ndim != 3 or m.b.ndim != 3):
        raise InvalidAdapter(
            f"Adapter at {where}: {path} holds the base's {E} experts, so its LoRA needs one pair of "
            f"factors per expert (lora_a [E, in, r], lora_b [E, r, out]); {found}.")
    r = m.a.shape[-1]
    lead = () if E is None else (E,)
    expected_a, expected_b = (*lead, input_dims, r), (*lead, r, output_dims)
    if tuple(m.a.shape) != expected_a or tuple(m.b.shape) != expected_b:
        if E is not None and m.a.shape[0] != E:
            raise InvalidAdapter(
                f"Adapter at {where}: {path} has LoRA for {m.a.shape[0]} experts, but the base has {E} "
                f"experts in that layer.")
        linear = f"a {input_dims}->{output_dims} linear" + (f" with {E} experts" if E else "")
        raise InvalidAdapter(
            f"Adapter at {where}: shapes of {path} do not fit the base model: expected lora_a "
            f"{expected_a} and lora_b {expected_b} for {linear}, {found}."
        )


def _describe(targets: dict[str, tuple[int, int]]) -> str:
    """What the base offers, for messages: its layers and the linears of a block."""
    layers = {int(p.split(".")[2]) for p in targets if p.startswith("model.layers.")}
    kinds = sorted({p.split(".", 3)[3] for p in targets if p.startswith("model.layers.")})
    if not layers:
        return f"the base model's LoRA targets are {', '.join(sorted(targets)[:5])}"
    return (f"the base model has {len(layers)} layers (model.layers.0-{max(layers)}) with "
            f"LoRA targets {', '.join(kinds)}")


def all_finite(x: mx.array) -> bool:
    """No NaN or Inf in ``x`` (evaluated). Checked on the host with numpy: for
    an adapter's hundreds of small factors that takes a tenth of the time of
    MLX's per-array reductions (1.4 vs 13 ms for 168 factors on a CPU)."""
    if x.dtype == mx.bfloat16:  # numpy has no bfloat16: look at the exponent bits
        bits = np.asarray(x.view(mx.uint16))
        return not bool(((bits & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(np.asarray(x)).all())


def invocation_start(tokens: tuple[int, ...], prompt: list[int]) -> int | None:
    """Where the last occurrence of an activated LoRA's invocation ``tokens``
    starts in ``prompt`` (PEFT's calculate_alora_offsets: the delta applies
    from there on); None when the prompt does not hold them."""
    n = len(tokens)
    for start in range(len(prompt) - n, -1, -1):
        if tuple(prompt[start:start + n]) == tokens:
            return start
    return None


def invocation_tokens(value, what: str) -> tuple[int, ...] | None:
    """An activated LoRA's invocation tokens as a file gives them (``what``
    names where, for the message), checked; None: a plain LoRA."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise InvalidAdapter(f"{what} (an activated LoRA's invocation) must be a non-empty list of token ids, "
                             f"got {value!r}.")
    return tuple(value)


def alora_tokens(config: dict, where) -> tuple[int, ...] | None:
    """An adapter config's ``alora_invocation_tokens`` (PEFT's name, which mlx-lm
    adapters written by `mola train --alora-invocation` and pushed configs use too),
    checked; None: a plain LoRA. ``where`` names the config in messages."""
    return invocation_tokens(config.get("alora_invocation_tokens"), f"{where}: alora_invocation_tokens")


def with_invocation(weights: LoRAWeights, tokens: tuple[int, ...] | None) -> LoRAWeights:
    """``weights`` as an activated LoRA invoked by ``tokens`` (None: as they are).
    Its delta is masked by position on the dense linears only: one on experts is refused."""
    if tokens is None:
        return weights
    experts = sorted(p for p, m in weights.modules.items() if m.num_experts is not None)
    if experts:
        raise InvalidAdapter(f"Adapter at {weights.source} is an activated LoRA with LoRA on experts ({experts[0]}, "
                             f"...); mola applies activated LoRA on dense linears only.")
    return dataclasses.replace(weights, invocation_tokens=tokens)


def stack_weights(parts: list[tuple[LoRAWeights, float]], max_rank: int,
                  max_expert_rank: int | None = None) -> LoRAWeights:
    """Adapters applied together, as one LoRA: per module, A is the parts' A
    side by side [in, r1+r2+...] and B their B's stacked [r1+r2+..., out]
    (experts likewise, per expert), each scaled by its part's scale (and its
    own), so that

        x @ A @ B = sum_i scale_i * own_scale_i * x @ A_i @ B_i   exactly.
    """
    modules: dict[str, ModuleLoRA] = {}
    paths = sorted({p for w, _ in parts for p in w.modules})
    for path in paths:
        pieces = [(w.modules[path], s) for w, s in parts if path in w.modules]
        a = mx.concatenate([m.a for m, _ in pieces], axis=-1)  # [(E,) in, r1+r2+...]
        b = mx.concatenate([(m.b.astype(mx.float32) * (m.scale * s)).astype(m.b.dtype)
                            for m, s in pieces], axis=-2)  # [(E,) r1+r2+..., out]
        modules[path] = ModuleLoRA(a=a, b=b, scale=1.0)
    for experts, limit, flag in ((False, max_rank, "--max-lora-rank"),
                                 (True, max_expert_rank, "--max-expert-lora-rank")):
        rank = max((m.rank for m in modules.values() if (m.num_experts is not None) == experts), default=0)
        if limit is not None and rank > limit:
            ranks = " + ".join(str(w.rank) for w, _ in parts)
            raise AdapterRankTooHigh(
                f"These adapters stacked together have rank {ranks} = {rank} in one module, above "
                f"the server's {flag} {limit}."
            )
    mx.eval([(m.a, m.b) for m in modules.values()])
    source = " + ".join(f"{s:g}*{w.source}" for w, s in parts)
    return LoRAWeights(source=source, format="stack", modules=modules)
