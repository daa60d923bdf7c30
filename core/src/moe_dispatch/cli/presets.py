"""Public MoE model shapes, and versions scaled down to run on a CPU."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidSpecError


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
        """Hidden, experts and intermediate divided by ``factor`` (hidden kept a multiple
        of 128, experts of 8, top-k capped by the experts)."""
        hidden = max(128, (self.hidden_size // factor) // 128 * 128)
        experts = max(8, self.num_experts // factor // 8 * 8)
        return ModelPreset(
            f"{self.name} /{factor}",
            hidden,
            experts,
            min(self.top_k, experts),
            max(64, self.intermediate_size // factor),
            self.source,
        )


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("qwen3-30b-a3b", 2048, 128, 8, 768, "Qwen/Qwen3-30B-A3B config.json"),
        ModelPreset("deepseek-v3", 7168, 256, 8, 2048, "deepseek-ai/DeepSeek-V3 config.json"),
        ModelPreset("kimi-k2", 7168, 384, 8, 2048, "moonshotai/Kimi-K2-Instruct config.json"),
        ModelPreset("mixtral-8x7b", 4096, 8, 2, 14336, "mistralai/Mixtral-8x7B-v0.1 config.json"),
    )
}

#: How much each preset is scaled down for the CPU demo.
DEMO_SCALE = {"qwen3-30b-a3b": 4, "deepseek-v3": 8, "kimi-k2": 8, "mixtral-8x7b": 8}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidSpecError(
            "unknown model preset", parameter="preset", value=name, allowed=", ".join(PRESETS)
        ) from None


__all__ = ["DEMO_SCALE", "PRESETS", "ModelPreset", "get_preset"]
