"""What a request reports: ``Chunk`` (a piece of streamed output), ``Stats`` and ``Result``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class _Step(Protocol):  # ``ondevice.speculative.Step``, as ``Stats.add`` reads it
    gamma: int
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float


@dataclass
class Chunk:
    """A piece of streamed output."""

    text: str
    tokens: list[int]
    from_draft: list[bool]
    logprobs: list | None = None  # per token: TokenLogprob (when asked for)


@dataclass
class Stats:
    """Per-request statistics (the same names appear in every ``--json``).

    ``mean_accepted_per_forward`` counts tokens emitted per decoding target pass (accepted drafts
    plus the target's own token), the usual τ of the speculative decoding literature; plain decoding
    gives 1.0. ``accept_counts[k]`` is how many passes accepted exactly k drafts.
    """

    tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_per_forward: float = 0.0
    tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    time_to_first_token: float = 0.0
    load_seconds: float = 0.0
    probe_seconds: float = 0.0  # one-time cost measurement for gamma="auto" (not in tokens_per_second)
    prompt_tokens: int = 0
    prompt_eval_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused, from the cache in memory or the prompt cache on disk
    prompt_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    plain_steps: int = 0
    accept_counts: list[int] = field(default_factory=list)
    gamma_counts: dict[int, int] = field(default_factory=dict)
    drafter: str = "none"
    stop_reason: str = ""  # eos | length | stop | context | cancelled (also: closed or dropped unfinished) | error

    def add(self, step: _Step) -> None:
        self.target_forwards += 1
        self.drafted += step.drafted
        self.accepted += step.accepted
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds
        self.gamma_counts[step.gamma] = self.gamma_counts.get(step.gamma, 0) + 1
        if step.drafted == 0:
            self.plain_steps += 1
        while len(self.accept_counts) <= step.accepted:
            self.accept_counts.append(0)
        self.accept_counts[step.accepted] += 1

    def bench_fields(self) -> dict:
        """Extra fields a benchmark row reports (a sharded target's collectives: ``DistStats``)."""
        return {}

    def finish(self, t_start: float, t_first: float | None, t_end: float) -> None:
        self.total_seconds = t_end - t_start
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        self.mean_accepted_per_forward = (self.accepted + self.target_forwards) / self.target_forwards if self.target_forwards else 0.0
        self.tokens_per_second = self.tokens / self.total_seconds if self.total_seconds > 0 else 0.0
        if t_first is not None:
            self.time_to_first_token = t_first - t_start
            decode = t_end - t_first
            self.decode_tokens_per_second = (self.tokens - 1) / decode if self.tokens > 1 and decode > 0 else 0.0


@dataclass
class Result:
    text: str
    tokens: list[int]  # generated ids only
    stats: Stats
    logprobs: list | None = None  # per token: TokenLogprob (when asked for)
