"""Self-distillation data: the target's own greedy answers, with the hidden state of every row.

One greedy decode per prompt gives both the tokens (the labels a greedy chain must hit) and the
post-norm hidden states (the heads' input and their targets), from the same passes the runtime makes
(``LlamaBackend.enable_hidden`` / ``MLXBackend.enable_hidden``). Each answer is written to its own file
through a temp file and a rename, so an interrupted collection resumes at the next prompt.
``OneSequence`` lets a single-sequence backend (MLX) stand in for the batched llama.cpp backend of
``batch`` (one answer at a time).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from ondevice import atomic
from ondevice.sampling import SamplingParams, probs_sparse

GREEDY = SamplingParams(temperature=0.0)


def load_prompts() -> dict:
    """The shipped prompt set: {"train": {class: [text]}, "heldout": {class: [text]}}."""
    return json.loads(resources.files("ondevice.heads").joinpath("prompts.json").read_text("utf-8"))


def train_prompts(prompts: dict | None = None) -> list[tuple[str, str]]:
    """(class, text) of every training prompt, the classes interleaved so any prefix mixes them."""
    p = (prompts or load_prompts())["train"]
    classes = sorted(p)
    out = []
    for i in range(max(len(v) for v in p.values())):
        out += [(c, p[c][i]) for c in classes if i < len(p[c])]
    return out


@dataclass
class Record:
    """One greedy answer: ``tokens[0]`` is the prompt's last token, then the answer; ``hidden[j]`` is the
    target's hidden state after ``tokens[j]`` (the row whose logits chose ``tokens[j + 1]``)."""

    tokens: np.ndarray  # [m + 1] int64
    hidden: np.ndarray  # [m, d] float32
    prompt: np.ndarray  # [n] int64, the whole prompt (n-gram baselines look at it)
    cls: str = ""


def record_answer(backend, prompt_ids: list[int], max_new: int) -> Record:
    """Greedy-decode ``max_new`` tokens (or to an end-of-generation token) keeping every hidden state.

    Args:
        backend: a ``LlamaBackend`` after ``enable_hidden()``; its cache is emptied first.
        prompt_ids: the rendered prompt.
    """
    backend.rollback(0)
    logits = backend.eval(prompt_ids, logits="last")[-1]
    hid = [backend.hidden(len(prompt_ids) - 1).copy()]
    toks = [int(prompt_ids[-1])]
    while True:
        ids, _ = probs_sparse(logits, GREEDY, [])
        t = int(ids[0])
        toks.append(t)
        if len(toks) - 1 >= max_new or backend.is_eog(t) or backend.n_past + 1 >= backend.n_ctx:
            break
        logits = backend.eval([t], logits="all")[-1]
        hid.append(backend.hidden(backend.n_past - 1).copy())
    return Record(np.asarray(toks, np.int64), np.asarray(hid, np.float32), np.asarray(prompt_ids, np.int64))


def record_text(backend, ids: list[int]) -> Record:
    """Teacher-forced features of a text (one prefill with every row output): ``tokens`` are the text's,
    not the target's own answer, but each row's hidden state (hence the teacher's distribution) is the
    target's. Cheaper per token than decoding (a batch instead of one pass per token)."""
    backend.rollback(0)
    backend.eval(ids, logits="all")
    H = np.stack([backend.hidden(i) for i in range(len(ids) - 1)])
    return Record(np.asarray(ids, np.int64), H.astype(np.float32), np.asarray(ids[:1], np.int64), "text")


def collect_text(rt, texts: list[str], work: Path, *, budget: int, chunk: int = 256,
                 on_record: Callable[[int, int], None] | None = None) -> list[Record]:
    """Teacher-forced records of ``texts`` cut into ``chunk``-token pieces, up to ``budget`` tokens (hidden rows;
    the last piece is cut to fit) (resumable: a cached piece is read back while its tokens are the text's)."""
    backend = rt.target
    backend.enable_hidden()
    out: list[Record] = []
    total, i = 0, 0
    for text in texts:
        if budget - total < 16:  # what is left of the budget is shorter than a piece (its hidden rows)
            break
        ids = backend.tokenize(text, add_bos=False)
        for s in range(0, len(ids) - 16, chunk):
            if budget - total < 16:
                break
            path = work / f"txt-{i:05d}.npz"
            i += 1
            piece = ids[s : s + min(chunk, budget - total + 1)]  # the budget counts hidden rows: tokens − 1
            rec = load_record(path) if path.is_file() else None
            if rec is None or not np.array_equal(rec.tokens, piece):  # a text changed since: its piece again
                rec = _save(path, record_text(backend, piece))
            out.append(rec)
            total += len(rec.hidden)
            if on_record is not None:
                on_record(total, len(rec.hidden))
    rt.reset()
    return out


def _save(path: Path, rec: Record) -> Record:
    """Write ``rec`` (hidden rows as float16) and return it as ``load_record`` will read it back, so a run
    that records an answer trains on exactly what a resumed run reads from the file."""
    rec = Record(rec.tokens, rec.hidden.astype(np.float16).astype(np.float32), rec.prompt, rec.cls)
    with atomic.replacing(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, tokens=rec.tokens, hidden=rec.hidden.astype(np.float16), prompt=rec.prompt, cls=np.array(rec.cls))
    return rec


def load_record(path: Path) -> Record:
    with np.load(path) as z:
        return Record(z["tokens"].astype(np.int64), z["hidden"].astype(np.float32), z["prompt"].astype(np.int64), str(z["cls"]))


def collect(
    rt,
    prompts: list[tuple[str, str]],
    work: Path,
    *,
    budget: int,
    max_new: int,
    on_record: Callable[[int, int], None] | None = None,
) -> list[Record]:
    """Record answers to ``prompts`` in order until ``budget`` answer tokens are held (resumable).

    Args:
        rt: a ``Runtime`` on a llama.cpp target (renders the chat template; its backend decodes).
        prompts: (class, text) pairs.
        work: folder of finished records (``rec-NNNN.npz``); existing ones are read, not redone, while they answer
            the same prompt (prompts.json's classes may have moved them).
        budget: answer tokens wanted in all.
        max_new: most tokens per answer.
        on_record: called as ``on_record(tokens_so_far, new_tokens)`` after each answer (progress).
    Returns:
        The records, in prompt order.
    """
    backend = rt.target
    backend.enable_hidden()
    out: list[Record] = []
    total = 0
    for i, (cls, text) in enumerate(prompts):
        if total >= budget:
            break
        path = work / f"rec-{i:04d}.npz"
        ids = rt.render_chat([{"role": "user", "content": text}])
        rec = load_record(path) if path.is_file() else None
        if rec is None or rec.prompt.tolist() != list(ids):  # none yet, or the answer to another prompt
            if len(ids) + 16 > backend.n_ctx:  # no room for an answer: skip the prompt
                continue
            rec = record_answer(backend, ids, min(max_new, budget - total))
            rec.cls = cls
            rec = _save(path, rec)
        rt.reset()
        out.append(rec)
        total += len(rec.hidden)
        if on_record is not None:
            on_record(total, len(rec.hidden))
    return out


class OneSequence:
    """A single-sequence backend (``MLXBackend``) as ``batch.generate_many`` / ``collect_many`` /
    ``selfprompts.write_prompts`` use a batched llama.cpp one: one sequence id, so answers are recorded one
    after another, each exactly as ``record_answer`` would (prompt prefix, then one token per pass).

    The wrapped backend's cache is its own: call the runtime's ``reset`` after using it through this.
    """

    n_seq_max = 1
    n_batch = 512

    def __init__(self, backend) -> None:
        self.backend = backend
        self.n_ctx = self.n_ctx_seq = backend.n_ctx
        self.vocab_size = backend.vocab_size

    def enable_hidden(self) -> int:
        return self.backend.enable_hidden()

    def is_eog(self, token: int) -> bool:
        return self.backend.is_eog(token)

    def token_bytes(self, token: int) -> bytes:
        return self.backend.token_bytes(token)

    def clear_seqs(self, seq: int = -1) -> None:
        self.backend.rollback(0)

    def eval_seqs(self, items, hidden: bool = False, outputs=None) -> tuple[np.ndarray, np.ndarray | None]:
        """``LlamaBackend.eval_seqs`` for sequence 0 only, its rows at the next positions in order."""
        b = self.backend
        pos = [int(p) for _, p, _ in items]
        if any(s != 0 for s, _, _ in items) or pos != list(range(b.n_past, b.n_past + len(items))):
            raise ValueError(f"OneSequence takes sequence 0 at positions {b.n_past}.. in order, not {list(items)[:4]}")
        toks = [int(t) for _, _, t in items]
        out = [True] * len(items) if outputs is None or hidden else [bool(o) for o in outputs]
        if not any(out):  # a prefill: the cache only
            b.eval(toks, logits="last")
            return np.zeros((0, b.vocab_size), np.float32), None
        logits = b.eval(toks, logits="all")[np.asarray(out)]
        return logits, (np.stack([b.hidden(p) for p in pos]) if hidden else None)


def examples(records: list[Record], K: int) -> Iterator[tuple[int, int]]:
    """(record index, anchor j) for every anchor with at least one head target (j + 1 < len(hidden))."""
    for r, rec in enumerate(records):
        for j in range(len(rec.hidden) - 1):
            yield r, j
