"""Generation parameters: every default is defined here once and reused by API and CLI.

This module imports nothing heavy so the CLI can build its options from it at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ondevice.errors import OndeviceError

DEFAULT_MAX_TOKENS = 256
DEFAULT_GAMMA = "auto"  # the cost-aware policy; an integer fixes γ (0 = plain decoding)
DEFAULT_N_CTX = 4096


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution over the next token.

    The same processing is applied to target and draft, so the rejection sampler compares like
    with like.

    Args:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set whose mass reaches top_p (1.0 = off).
        min_p: drop tokens whose probability is below min_p × the top probability (0 = off).
        repetition_penalty: CTRL-style penalty on tokens already in the history (1.0 = off).
        seed: seed of the generator that draws every random number (None = fresh entropy).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, value: Any, rule: str) -> None:
            raise OndeviceError(f"invalid sampling parameter {name}={value!r}: {rule}")

        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            bad("top_k", self.top_k, "must be an integer >= 0 (0 = off)")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", self.top_p, "must be in (0, 1] (1 = off)")
        if not (0.0 <= self.min_p < 1.0):
            bad("min_p", self.min_p, "must be in [0, 1) (0 = off)")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 = off)")
        if self.seed is not None and (int(self.seed) != self.seed or self.seed < 0):
            bad("seed", self.seed, "must be a non-negative integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a dict, ignoring keys that are not sampling parameters."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})


DEFAULTS = SamplingParams()
