"""The DFlash drafter: a published DFlash block draft (a GGUF of arch ``dflash``) run on the target's layer inputs by
llama.cpp's own graph (``ondevice.backends.llama_dflash``) for a llama.cpp target, or by the same maths written in
MLX (``ondevice.backends.mlx_dflash``) for an MLX one (``Backend.dflash_draft`` picks).

The target records the inputs of the draft's layers for every token of every pass (``Traits.needs``:
"layer_inputs"; the backend's ``enable_layer_inputs``), so drafting costs no extra target pass. The draft's KV
cache holds, at every target position, K/V made from the target's features there: before each block it is
rolled back to the positions whose features came from the same context (the common prefix) and the new ones
are injected from the kept rows. One draft pass of ``[pending token, mask × k]`` then gives k logit rows at
once: row i is the draft's distribution of the token i + 1 places after the pending one.

q: row i does not depend on the tokens drafted before it (masks stand there), a valid draft law all the same;
each drafted token is drawn from its row processed with the request's own ``SamplingParams``
(``probs_sparse``, with the drafted prefix as the repetition history) after the request's constraint mask, and
that processed row is its q, so the shared rejection rule keeps the target's law at any temperature. Greedy
drafting is deterministic (q None). Chains only: a block has no branching of its own.

DSpark (Markov head) and DFlash2 (candidate selector) drafts make row i depend on the token drafted at i − 1:
``DFlashGraph.block`` gives each row conditioned on the token actually drafted before it
(``ondevice.backends.llama_dflash_heads``), computed before that position is drawn, so the processed row is
still exactly the distribution the token was drawn from (q). An anchor-first DSpark drafts up to block_size
tokens per pass, the others block_size − 1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ondevice.drafters.base import LayerInputsDrafter, Traits, common_prefix, file_arch
from ondevice.drafters.chain import Chain
from ondevice.sampling import SamplingParams, probs_sparse

_GREEDY = SamplingParams(temperature=0.0)


def is_dflash_gguf(path: str) -> bool:
    """Whether ``path`` is a GGUF file whose architecture is ``dflash`` (read from its header alone)."""
    return file_arch(path) == "dflash"


class DFlashDrafter(LayerInputsDrafter):
    """Chains of up to ``max_draft`` tokens per draft pass from a DFlash draft (see the module docstring).

    Args:
        target: the target backend; it must record layer inputs (a llama.cpp target of an architecture whose
            graph keeps them, or qwen2 through its cb_eval tap; an MLX target whose mlx-lm model has a ``layers``
            list; others are refused in one line).
        path: the dflash GGUF.
        threads: CPU threads of the draft's context (llama.cpp).
    """

    traits = Traits(name="dflash", needs=frozenset({"layer_inputs"}))

    def __init__(self, target, path: str | Path, threads: int | None = None) -> None:
        layer_inputs_on = self._attach(target)  # refuses a target that records no layer inputs
        # llama.cpp's dflash graph or the same maths in MLX, by the target's backend; checks layers, vocabulary and
        # hidden size against the target; may read its embeddings / LM head
        self.graph = target.dflash_draft(path, layer_inputs_on, threads=threads)
        self.last_block = None  # the last proposal's Block (tests read it)

    def _absorb(self, context: Sequence[int]) -> bool:
        """Bring the draft's cache to positions 0..L-2 (L = len(context)) of ``context`` (K/V of the target's
        features there); False when the target kept no features for the last cached position (nothing to draft
        from)."""
        new = self._new_features(context, common_prefix(self._tokens, context))
        if new is None:
            return False
        keep, feats = new
        self.graph.observe(feats, keep)
        self._absorbed(context, len(context) - 1)
        return True

    def propose(self, context, gamma, params, rng, keep_drafting=None, constraint=None):
        """Up to ``gamma`` (≤ the graph's ``max_draft``) tokens after ``context`` (its last token pending, the rest in the
        target's cache), each drawn from its block row's processed (and constrained) distribution; (tokens, q rows
        [γ', V] or None greedy). Nothing (a plain step) when the target kept no features for the last position."""
        V = self.target_vocab
        none = ([], None if params.greedy else np.zeros((0, V)))
        gamma = min(gamma, self.graph.max_draft, self.target.n_ctx - len(context))
        if gamma <= 0 or not self._absorb(context):
            return none
        self.last_block = block = self.graph.block(int(context[-1]), gamma)
        with Chain(context, gamma, params, rng, keep_drafting, constraint) as chain:
            for j in range(len(block)):  # each row given the token drafted before it (the anchor first)
                if not chain.take(block.row(j, chain.tokens[-1] if chain.tokens else int(context[-1]))):
                    break
        return chain.result(V)

    def seconds_per_token(self, reps: int = 5) -> float:
        """Median seconds of one drafted token: a block pass of min(4, max_draft) tokens and their processed
        rows, divided by that count, timed once on the draft's cache (left as it was); charged by the policy."""
        if self._spt is None:
            k = min(4, self.graph.max_draft)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                block, prev = self.graph.block(0, k), 0
                for j in range(k):  # the greedy chain (a DFlash2 row needs a candidate before it)
                    prev = int(probs_sparse(block.row(j, prev), _GREEDY, [])[0][0])
                times.append((time.perf_counter() - t0) / k)
            self._spt = float(np.median(times))
        return self._spt
