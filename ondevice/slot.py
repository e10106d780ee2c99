"""``Slot``: one sequence's state — what the target cache holds for it, its drafter, and per request its
context, policy, rng, stats and step generator. ``Runtime`` drives one slot; a ``--parallel N`` engine would
hold N (one llama.cpp sequence id each). The steps know nothing about text (``ondevice.text`` does).

Consistency rule: ``kv`` (what the slot believes the target cache holds) is always a prefix of what it really
holds. Bookkeeping is shortened *before* a cache is cut and lengthened only *after* it grew, so a request
interrupted anywhere (Ctrl-C, an error) leaves a slot that the next request simply continues from.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from ondevice.backends.base import Backend
from ondevice.drafters.base import Drafter, common_prefix
from ondevice.errors import OndeviceError
from ondevice.policy import Policy
from ondevice.results import Stats
from ondevice.sampling import SamplingParams
from ondevice.speculative import Step, steps


class Slot:
    """One sequence on a target (and its drafter).

    ``prompt_cache``: an ``ondevice.prompt_cache.PromptCache`` (set by ``load(prompt_cache=)``) that ``prefill``
    restores prompt prefixes from and stores them to; None: the in-memory prefix only.

    Args:
        target: the target backend (shared by every slot of an engine).
        drafter: this sequence's drafter (None: plain decoding only).
        n_ctx: the context this sequence may fill.
        seq_id: the backend's sequence id (0: the only one).
    """

    prompt_cache = None

    def __init__(self, target: Backend, drafter: Drafter | None, *, n_ctx: int, seq_id: int = 0) -> None:
        self.target, self.drafter, self.n_ctx, self.seq_id = target, drafter, n_ctx, seq_id
        self.kv: list[int] = []  # a prefix of the ids whose K/V the target cache holds
        self.context: list[int] = []  # the request's whole sequence so far (the last token pending)
        self.policy: Policy | None = None
        self.rng: np.random.Generator | None = None
        self.stats: Stats | None = None
        self.t_start: float | None = None  # when the request's prompt started (after any cost probe)
        self.t_first: float | None = None  # when its first token was released
        self._steps: Iterator[Step] | None = None
        self._key: list | None = None  # a prompt with images: its key (``prefill_media``)

    def forget(self) -> None:
        """Empty the caches and the bookkeeping, whatever state they are in."""
        self.kv = []
        self.target.rollback(0)
        if self.drafter is not None:
            self.drafter.reset()

    def open(self, stats: Stats) -> None:
        """A request takes the slot (its policy is chosen next, maybe after a cost probe)."""
        self.stats, self.t_start, self.t_first, self._steps = stats, None, None, None

    def admit(self, ids: list[int], *, params: SamplingParams, policy: Policy, draft: bool,
              trees: bool = False, constraint=None, logprobs: int | None = None, observer=None, media=None) -> None:
        """Start a request: prefill ``ids`` (reusing the cached prefix) and set up its steps.

        Args:
            media: (projector, MultimodalPrompt) for a prompt with images (``prefill_media``); ``ids`` is then
                its drafters' view (text ids, a fill id at image positions).
            draft: the drafter is used (else plain steps).
            trees: speculate with best-first trees (``ondevice.speculative.steps``).
            constraint, logprobs, observer: as ``ondevice.speculative.steps``.
        """
        self.policy, stats = policy, self.stats
        self.t_start = time.perf_counter()
        self.context = list(ids)
        drafter = self.drafter if draft else None
        first_drafts = draft and (not trees or policy.drafts_next())  # trees switch features per step
        self._key = None
        stats.cached_tokens = self.prefill(ids, drafts=first_drafts) if media is None else \
            self.prefill_media(*media, drafts=first_drafts)
        stats.prompt_eval_tokens = len(ids) - stats.cached_tokens
        self.rng = np.random.default_rng(params.seed)
        self._steps = steps(self.target, drafter, self.context, params, policy, self.rng, observer, n_ctx=self.n_ctx,
                            constraint=constraint, logprobs=logprobs, trees=trees)

    def step(self) -> Step | None:
        """One target pass (None: the context is full). Native state: call it under the engine's lock."""
        step = next(self._steps, None)
        # With images, the cache's prompt positions are the prompt's key (images told apart), not the fill ids.
        self.kv = self.context[:-1] if self._key is None else [*self._key, *self.context[len(self._key):]][:-1]
        return step

    def prefill(self, ids: list[int], drafts: bool = False) -> int:
        """Make the target cache hold ``ids[:-1]``, reusing the longest cached prefix: the one in memory, or a
        longer one from ``prompt_cache`` on disk (then ``ids[:-1]`` is stored there). Returns tokens reused.

        ``drafts``: the first step may draft, so a drafter that reads features of the last cached row
        (``Traits.needs``: heads) gets them; else the prompt is evaluated in one batch without them (llama.cpp
        would output every row with them on, so a prompt with them is split: its prefix, then its last token)."""
        t = self.target
        keep = min(common_prefix(self.kv, ids), len(ids) - 1, t.n_past)
        needs = self.drafter.traits.needs if self.drafter is not None else frozenset()
        reads = drafts and bool(needs)
        if needs:
            t.keep_features(reads)  # on: the first step drafts from the prompt's last row
        if reads and 0 < keep == len(ids) - 1 and any(t.feature(f, keep - 1) is None for f in needs):
            keep -= 1  # drafts read that row: evaluate it again
        pc = self.prompt_cache
        if pc is not None and keep < len(ids) - 1:
            # A restored state has no features: drafts that read the last row need it evaluated here.
            n, restore = pc.lookup(ids, max_tokens=len(ids) - 2 if reads else None, more_than=keep)
            if restore is not None:
                self.kv = []  # the sequence's cache is replaced (emptied if llama.cpp refuses the file)
                keep = restore(self.seq_id)
                self.kv = list(ids[:keep])
        self.kv = self.kv[:keep]
        try:
            t.rollback(keep)
        except OndeviceError:  # a recurrent state keeps snapshots of its last few positions only: start over
            if keep == 0:
                raise
            keep, self.kv = 0, []
            t.rollback(0)
        if len(ids) - 1 > keep:
            t.eval(ids[keep:-1], logits="last")
        self.kv = list(ids[:-1])
        if pc is not None and len(ids) - 1 >= pc.min_tokens:
            try:
                pc.store(ids[:-1], self.seq_id)  # no write when a stored prefix already covers it
            except (OSError, OndeviceError) as e:  # a full disk costs the next restart a miss, not this answer
                pc.warn(f"prompt cache: could not store a prefix in {pc.dir} ({getattr(e, 'strerror', None) or e})")
        return keep

    def prefill_media(self, projector, prompt, drafts: bool = False) -> int:
        """``prefill`` for a prompt with images (docs/vision.md): the cache ends up holding all but the prompt's
        last position, reusing the prefix whose ``key`` (text ids, an image's hash at its positions) it shares
        with what is cached; an image is never cut (evaluated whole). The disk prompt cache is not used.
        Returns positions reused."""
        t, key = self.target, list(prompt.key)
        needs = self.drafter.traits.needs if self.drafter is not None else frozenset()
        reads = drafts and bool(needs)
        if needs:
            t.keep_features(reads)
        # Drafts that read the last row's features get it evaluated (a restored or image row has none).
        keep = max(0, min(common_prefix(self.kv, key), len(key) - (2 if reads else 1), t.n_past))
        pos = 0
        for c in prompt.chunks:
            if c.kind == "image" and pos < keep < pos + c.n_pos:
                keep = pos
            pos += c.n_pos
        self.kv = self.kv[:keep]
        t.rollback(keep)
        n_past, tail = projector.eval_prefix(prompt, n_past=keep)
        self.kv = key[:n_past]
        if len(tail) > 1:
            t.eval(tail[:-1], logits="last")
        self.kv = key[:-1]
        self._key = key
        return keep

    def finish(self, end: float) -> None:
        """Close the request's statistics."""
        self.stats.finish(end if self.t_start is None else self.t_start, self.t_first, end)
        self._steps = None
