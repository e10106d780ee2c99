"""Prompts the target writes itself: more, and more varied, training answers than the shipped set.

For every (class, topic) of ``prompts.json``'s ``topics`` the target is asked, through its own chat
template, for one realistic request a user might send about that topic: in the first round a plain question
or task (twice per topic), in later rounds once in each other style of its class (a request for advice, for
an explanation of how something works, a comparison; for code, a concept to explain, a small program), so
more rounds add new kinds of answers, not only resamples of the same requests; answers are sampled
(T = 1, top-p 0.95, seeded) in batches (``batch.generate_many``). Requests that did not finish, are
too short, or are close to a held-out prompt (word overlap) are dropped, so the held-out measurement
stays on prompts the heads never saw.
"""

from __future__ import annotations

import re

from ondevice.heads.batch import generate_many
from ondevice.heads.data import load_prompts
from ondevice.sampling import SamplingParams

ASK = {  # per class, the styles of request: round 0 asks the first, later rounds each of the others
    "code": [
        "Write one request a programmer might make about {topic}: asking for a function, a script, "
        "an explanation or a fix. Reply with the request only, in one or two sentences, without quotes.",
        "Write one request asking an assistant to explain a programming concept related to {topic}, with a "
        "short example. Reply with the request only, without quotes.",
        "Write one request asking an assistant to write a small program or class about {topic}. "
        "Reply with the request only, in one or two sentences, without quotes.",
    ],
    "chat": [
        "Write one question a curious person might ask about {topic}. "
        "Reply with the question only, without quotes.",
        "Write one request for practical advice that a person might send to an assistant about {topic}. "
        "Reply with the request only, without quotes.",
        "Write one request asking an assistant to explain how something works, related to {topic}. "
        "Reply with the request only, without quotes.",
        "Write one request asking an assistant to compare two options, or to list pros and cons, about {topic}. "
        "Reply with the request only, without quotes.",
    ],
}
SAMPLE = SamplingParams(temperature=1.0, top_p=0.95)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def near(a: str, b: str, threshold: float = 0.6) -> bool:
    """Word-set Jaccard similarity of two prompts is at least ``threshold``."""
    wa, wb = _words(a), _words(b)
    return bool(wa and wb) and len(wa & wb) / len(wa | wb) >= threshold


def write_prompts(rt, backend, *, per_topic: int = 2, seed: int = 0, max_new: int = 64,
                  on_progress=None, known: dict[int, str | None] | None = None, on_answer=None,
                  round: int = 0, avoid: list[str] | None = None) -> list[tuple[str, str]]:
    """(class, prompt) pairs written by the target, classes interleaved, held-out look-alikes removed.

    Args:
        rt: a ``Runtime`` on the target (its chat template renders the requests).
        backend: a ``LlamaBackend`` of the same model with several sequence ids (it writes, in batches).
        per_topic: requests asked for per topic in round 0 (each a different sample); later rounds ask one
            per topic and style.
        seed: seeds the sampling.
        on_progress: called as ``on_progress(requests finished, requests asked)``.
        known, on_answer: resuming: what earlier runs wrote for request i (None: dropped) is not asked
            again; ``on_answer(i, text or None)`` is called as each request finishes (each answer has its
            own seeded generator, so a resumed run writes what an uninterrupted one would).
        round: round 0 asks the first style of ``ASK``; round r ≥ 1 the other styles, sampled afresh each round
            (round r draws request i from the generator seeded (seed, r · requests + i)).
        avoid: prompts already held (earlier rounds): look-alikes of them are dropped too.
    """
    shipped = load_prompts()
    heldout = [t for v in shipped["heldout"].values() for t in v]
    if round == 0:
        passes = [{c: v[0] for c, v in ASK.items()}] * per_topic
    else:
        passes = [{c: v[j] for c, v in ASK.items() if j < len(v)} for j in range(1, max(map(len, ASK.values())))]
    asks = [(c, p[c].format(topic=topic)) for p in passes for c in sorted(p) for topic in shipped["topics"][c]]
    ids = [rt.render_chat([{"role": "user", "content": text}]) for _, text in asks]
    got: dict[int, str | None] = {i: t for i, t in (known or {}).items() if 0 <= i < len(asks)}
    todo = [i for i in range(len(asks)) if i not in got]

    def done(j: int, rec) -> None:
        i, text = todo[j], None
        toks = [int(t) for t in rec.tokens[1:]]
        if toks and backend.is_eog(toks[-1]):
            text = b"".join(backend.token_bytes(t) for t in toks[:-1]).decode("utf-8", "replace").strip().strip('"').strip()
            if len(text) < 16 or "\ufffd" in text:
                text = None
        got[i] = text
        if on_answer is not None:
            on_answer(i, text)
        if on_progress is not None:
            on_progress(len(got), len(asks))

    generate_many(backend, [ids[i] for i in todo], max_new=max_new, on_done=done, params=SAMPLE, seed=seed,
                  hidden=False, keys=[round * len(asks) + i for i in todo])
    out: list[tuple[str, str]] = []
    earlier = list(avoid or ())
    for i in sorted(i for i, t in got.items() if t is not None):
        text = got[i]
        if any(near(text, h) for h in heldout) or any(near(text, t) for t in earlier) or any(near(text, t) for _, t in out):
            continue
        out.append((asks[i][0], text))
    return out
