"""Generation parameters: every default is defined here once and reused by API and CLI.

``SamplingParams`` says how logits become a distribution; ``GenerateRequest`` is one whole request (sampling,
token limit, γ, stop strings), built once by the CLI, the REPL, the server or the bench, validated in its
constructor, and passed down unchanged to the loop. This module imports nothing heavy so the CLI can build
its options from it at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from numbers import Real
from typing import Any

from ondevice import inputs
from ondevice.errors import OndeviceError

DEFAULT_MAX_TOKENS = 256
DEFAULT_GAMMA = "auto"  # the cost-aware policy; an integer fixes γ (0 = plain decoding)
DEFAULT_N_CTX = 4096
DEFAULT_PROMPT_CACHE_SIZE = "4GiB"  # bound of load(prompt_cache=) (ondevice.prompt_cache.DEFAULT_MAX_BYTES)
MAX_GAMMA = 64  # drafts one target pass may verify


def gamma_value(value: Any) -> int | str:
    """The one rule for γ: "auto", or an integer in [0, MAX_GAMMA] (0 = plain decoding); an integer written as
    text (a command-line value) is read as one.

    Raises:
        OndeviceError: anything else, in one line.
    """
    if value == "auto":
        return "auto"
    rule = f"gamma={value!r}: must be 'auto' or an integer in [0, {MAX_GAMMA}] (0 = plain decoding)"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    try:
        g = inputs.integer("gamma", value, 0)
    except OndeviceError:
        raise OndeviceError(rule) from None
    if g > MAX_GAMMA:
        raise OndeviceError(rule)
    return g


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

        for f in fields(self):  # a number of any kind (numpy scalars too), never a string or bool
            v = getattr(self, f.name)
            if not (v is None and f.name == "seed") and (isinstance(v, bool | str | bytes) or not isinstance(v, Real)):
                bad(f.name, v, "must be a number" + (" or None" if f.name == "seed" else ""))

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
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request, validated on construction and passed down unchanged.

    Args:
        sampling: how each position's logits become a distribution (``SamplingParams``).
        max_tokens: most tokens to generate (>= 1).
        gamma: "auto" (the cost-aware policy) or tokens drafted per target pass (0 = plain decoding); see
            ``gamma_value``.
        stop: strings that end generation (not included in the text); a string or a sequence of strings.
        response_format: a constraint on the output ({"type": "json_object" | "json_schema" | "regex" |
            "text", ...}; see ``ondevice.constrain.grammar_text``), compiled when the request starts.
        grammar: a Lark or GBNF grammar the output must follow (instead of ``response_format``).
        logprobs: attach each token's log probability (``ondevice.logprobs``).
        top_logprobs: alternatives per token (0-20; implies ``logprobs``).
        reasoning_budget: thinking tokens at most (>= 0; a model whose template thinks): then the end of
            thinking is forced and the answer follows (``ondevice.budget``); None = unbounded.
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = DEFAULT_MAX_TOKENS
    gamma: int | str = DEFAULT_GAMMA
    stop: Sequence[str] | str | None = ()
    response_format: dict | None = None
    grammar: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    reasoning_budget: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise OndeviceError(f"sampling={self.sampling!r}: pass a SamplingParams")
        object.__setattr__(self, "max_tokens", inputs.integer("max_tokens", self.max_tokens, 1))
        object.__setattr__(self, "gamma", gamma_value(self.gamma))
        object.__setattr__(self, "stop", tuple(inputs.stop_strings(self.stop)))
        top = inputs.integer("top_logprobs", self.top_logprobs, 0, f" (at most {MAX_TOP_LOGPROBS})")
        if top > MAX_TOP_LOGPROBS:
            raise OndeviceError(f"top_logprobs={top}: at most {MAX_TOP_LOGPROBS}")
        object.__setattr__(self, "top_logprobs", top)
        if self.reasoning_budget is not None:
            object.__setattr__(self, "reasoning_budget", inputs.integer("reasoning_budget", self.reasoning_budget, 0))
        if self.response_format is not None and self.grammar is not None:
            raise OndeviceError("give either response_format or grammar, not both")

    @classmethod
    def of(cls, **options: Any) -> GenerateRequest:
        """Build from flat keyword options, as ``Runtime.stream`` and the CLI take them (temperature, top_k,
        top_p, min_p, repetition_penalty, seed, max_tokens, gamma, stop); an unknown name is an error."""
        sampling_names = {f.name for f in fields(SamplingParams)}
        own = {f.name for f in fields(cls)} - {"sampling"}
        unknown = set(options) - sampling_names - own
        if unknown:
            raise OndeviceError(f"unknown generation option(s) {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(sorted(sampling_names | own))}")
        sampling = SamplingParams(**{k: v for k, v in options.items() if k in sampling_names})
        return cls(sampling=sampling, **{k: v for k, v in options.items() if k in own})

    @classmethod
    def resolve(cls, request: GenerateRequest | None, options: dict[str, Any]) -> GenerateRequest:
        """The one request of an API call that takes ``request=`` or keyword options (``Runtime.stream`` /
        ``chat``, ``ChatSession``): a ``GenerateRequest``, or one built from ``options`` by ``of``; both at once,
        or a ``request`` of another type, is an ``OndeviceError``."""
        if request is None:
            return cls.of(**options)
        if options:
            raise OndeviceError(f"pass either a GenerateRequest or keyword options, not both ({', '.join(options)})")
        if not isinstance(request, cls):
            raise OndeviceError(f"request must be a GenerateRequest, not {type(request).__name__}")
        return request

    def to_dict(self) -> dict[str, Any]:
        """Flat options (``of``'s inverse): for JSON and for replaying the request on other ranks."""
        d = asdict(self)
        return {**d.pop("sampling"), **d, "stop": list(self.stop)}

