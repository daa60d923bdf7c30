"""Public MoE model shapes, and versions scaled down to run on a CPU."""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import InvalidSpecError


@dataclass(frozen=True)
class ModelPreset:
    """A MoE layer's shape. ``scaled`` is the CPU-sized version the demo runs."""

    name: str
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    source: str = ""

    def scaled(self, factor: int) -> "ModelPreset":
        """Hidden, experts and intermediate over ``factor`` (hidden a multiple of 128, experts of 8, top-k capped)."""
        hidden = max(128, (self.hidden_size // factor) // 128 * 128)
        experts = max(8, self.num_experts // factor // 8 * 8)
        return ModelPreset(f"{self.name} /{factor}", hidden, experts, min(self.top_k, experts),
                           max(64, self.intermediate_size // factor), self.source)


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("qwen3-30b-a3b", 2048, 128, 8, 768, "Qwen/Qwen3-30B-A3B config.json"),
        ModelPreset("deepseek-v3", 7168, 256, 8, 2048, "deepseek-ai/DeepSeek-V3 config.json"),
        ModelPreset("kimi-k2", 7168, 384, 8, 2048, "moonshotai/Kimi-K2-Instruct config.json"),
        ModelPreset("mixtral-8x7b", 4096, 8, 2, 14336, "mistralai/Mixtral-8x7B-v0.1 config.json"),
    )
}

def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidSpecError("unknown model preset", parameter="preset", value=name,
                               allowed=", ".join(PRESETS)) from None


def model_shapes(presets: "list[str] | None", default: "list[str]", hidden: int | None, experts: int | None,
                 top_k: int | None) -> list[tuple[str, int, int, int]]:
    """The one rule every subcommand follows: ``(name, hidden, experts, top_k)`` of each ``--preset`` (or of
    ``default``), with ``--hidden``/``--experts``/``--top-k`` overriding those fields of each; all three given without
    a ``--preset`` is one custom shape, ``H/E/k``. Overrides are checked (>= 1) here; each distinct shape once."""
    overrides = {"--hidden": hidden, "--experts": experts, "--top-k": top_k}
    for flag, value in overrides.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidSpecError("must be a positive int", parameter=flag, value=value, allowed="1, 2, 3, ...")
    if not presets and None not in overrides.values():
        return [(f"H{hidden}/E{experts}/k{top_k}", hidden, experts, top_k)]  # type: ignore[list-item]
    shapes: dict[tuple[int, int, int], str] = {}
    for name in presets or default:
        p = get_preset(name)
        size = (p.hidden_size if hidden is None else hidden, p.num_experts if experts is None else experts,
                p.top_k if top_k is None else top_k)
        changed = (p.hidden_size, p.num_experts, p.top_k) != size
        shapes.setdefault(size, f"{p.name}*" if changed else p.name)  # *: the preset with overrides
    return [(name, *size) for size, name in shapes.items()]


__all__ = ["PRESETS", "ModelPreset", "get_preset", "model_shapes"]
