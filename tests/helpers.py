"""What several test modules share: the prompt, bit-exactness and batch-invariance checks, the exact law of a
model's next tokens and the chi-square test of sampled output against it, and mlx-lm as an independent
reference for the converters."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats as sps

from ondevice import sampling

PROMPT = "The model draft and the target verify"
# train-heads on the tiny llama target in seconds (the session's trained heads, and runs compared with them)
SMALL_HEADS = dict(tokens=600, max_new=48, rank=32, epochs=3, vocab=256, threads=1, n_ctx=512, slots=8, quiet=True)


def slowdown(seconds: float = 0.2) -> float:
    """How many times slower than on an idle core this process runs now (≥ 1): the wall time over the CPU
    time of a short CPU-bound loop. Other jobs on the machine stretch it (one busy process on a 2-core
    machine shared with this test and its child: ~1.5; load 6 there: ~3); a slow but idle machine does not."""
    t0, c0 = time.perf_counter(), time.thread_time()
    while time.thread_time() - c0 < seconds:
        sum(range(1000))
    return max(1.0, (time.perf_counter() - t0) / (time.thread_time() - c0))


class TimeScale:
    """Time limits for a test, scaled by the machine's load: ``scale(30)`` is 30 s times ``slowdown()``,
    measured when the object was made (the test's start) and again at the call, the larger kept. A limit
    written for an idle machine then holds under load, and still fails a wait that does not end (a hang, an
    ignored signal)."""

    def __init__(self) -> None:
        self.factor = slowdown()

    def __call__(self, seconds: float) -> float:
        self.factor = max(self.factor, slowdown())
        return seconds * self.factor


def _proc_stat(pid: int) -> tuple[str, int, float] | None:
    """(state, parent pid, CPU seconds) of a Linux process from /proc, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return fields[0], int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until_child_busy(pid: int, module: str, cpu_seconds: float, timeout: float, fallback: float,
                          exclude: tuple[int, ...] = ()) -> int | None:
    """Wait until a live descendant of ``pid`` running ``python -m module`` (not in ``exclude``) has used more
    than ``cpu_seconds`` of CPU: it is at work, not starting. A descendant, not only a child: a sandbox
    (bubblewrap, unshare) may stand between. A fixed sleep there broke under load (the model still loading when
    the signal came). Returns the process's pid. Where /proc is missing (macOS), sleeps ``fallback`` seconds
    instead and returns None. Raises AssertionError after ``timeout`` seconds."""
    if not sys.platform.startswith("linux"):
        time.sleep(fallback)
        return None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = {int(e): st for e in os.listdir("/proc") if e.isdigit() and (st := _proc_stat(int(e))) is not None}
        family, grew = {pid}, True
        while grew:  # every descendant of pid
            new = {q for q, st in procs.items() if st[1] in family and q not in family}
            family |= new
            grew = bool(new)
        for q in sorted(family - {pid} - set(exclude)):
            state, _, cpu = procs[q]
            if state == "Z" or cpu <= cpu_seconds:
                continue
            try:
                argv = Path(f"/proc/{q}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if module.encode() in argv:
                return q
        time.sleep(0.1)
    raise AssertionError(f"no descendant of {pid} running {module} used {cpu_seconds} s of CPU in {timeout:.0f} s")


def batch_invariant(path, k: int = 6, kind: str = "gguf") -> bool:
    """k tokens in one batch give, bit for bit, the logits of k single decodes (``kind``: gguf | mlx)."""
    if kind == "gguf":
        from ondevice.backends.llama import LlamaBackend

        b = LlamaBackend(path, n_ctx=256)
    else:
        from ondevice.backends.mlx import MLXBackend

        b = MLXBackend(path, n_ctx=256, device="cpu")
    try:
        ids = b.tokenize(PROMPT)
        b.eval(ids[:2])
        batched = b.eval(ids[2 : 2 + k])
        b.rollback(2)
        singles = np.concatenate([b.eval([t]) for t in ids[2 : 2 + k]])
        return bool(np.array_equal(batched, singles))
    finally:
        b.close()


def exact_law(backend, ids, params, depth=3):
    """Exact target law of the next ``depth`` tokens, enumerating every sequence with nonzero mass,
    evaluated with ``backend`` (which is left empty)."""
    backend.rollback(0)
    backend.eval(ids[:-1])
    base = backend.n_past
    law = {}

    def walk(prefix, mass):
        backend.rollback(base + len(prefix))
        ctx = ids + list(prefix)
        p = sampling.probs(backend.eval([ctx[-1]])[0], params, ctx)
        for t in np.flatnonzero(p):
            if len(prefix) + 1 == depth:
                law[(*prefix, int(t))] = mass * p[t]
            else:
                walk((*prefix, int(t)), mass * p[t])

    walk((), 1.0)
    backend.rollback(0)
    return law


def exact_joint_law(path, ids, params, depth=3):
    from ondevice.backends.llama import LlamaBackend

    b = LlamaBackend(path, n_ctx=256)
    try:
        return exact_law(b, ids, params, depth)
    finally:
        b.close()


def chisquare(counts: dict, law: dict, n: int) -> float:
    """Goodness of fit; cells with expected count < 5 are pooled into one."""
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for seq, pr in law.items():
        e = n * pr
        if e >= 5:
            obs.append(counts.get(seq, 0))
            exp.append(e)
        else:
            pool_o += counts.get(seq, 0)
            pool_e += e
    pool_o += sum(c for s, c in counts.items() if s not in law)  # impossible sequences land here
    obs.append(pool_o)
    exp.append(max(pool_e, 1e-9))
    return float(sps.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue)


def sampled_counts(rt, ids, n, temperature, top_k, gamma):
    counts = {}
    for seed in range(n):
        res = rt.generate(ids, max_tokens=3, temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0,
                          seed=seed, gamma=gamma)
        key = tuple(res.tokens)
        counts[key] = counts.get(key, 0) + 1
    return counts


def mlx_float32(hf_dir):
    """mlx-lm's model for an HF checkpoint directory, cast to float32, and its tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load

    model, tok = load(str(hf_dir))
    model.update(tree_map(lambda x: x.astype(mx.float32), model.parameters()))
    return model, tok


def mlx_logits(model, ids) -> np.ndarray:
    """[len(ids), vocab] float32 logits of one fresh pass."""
    import mlx.core as mx

    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


DRAFT_PROMPTS = ["def add(a, b):", "The model draft and the target verify", "class Cache:\n    def __init__(self, n):"]
REPEATS = "x = cache.get(key)\ny = cache.get(key)\nz = cache.get("  # its suffix occurs earlier: copies draft
LAW_PROMPT = "The model draft"
LAW = dict(temperature=0.8, top_k=6, top_p=1.0, min_p=0.0)


def tiny_gguf_target(base, arch: str, n_layers: int = 4):
    """A tiny random-weight ``arch`` target converted to an f16 GGUF under ``base``; its path."""
    from converters import convert
    from ondevice.testing import make_tiny_hf

    hf = make_tiny_hf(base / "hf", arch=arch, n_layers=n_layers)
    convert(hf, to="gguf", quant="f16", out=base / "gguf", progress=False)
    return base / "gguf" / "model.gguf"


def law_after(target, prompt: str = LAW_PROMPT):
    """The target's exact law of 3 tokens after ``prompt`` under ``LAW`` (top-k 6 keeps it enumerable) and the
    prompt ids."""
    from ondevice.backends.llama import LlamaBackend

    b = LlamaBackend(target, n_ctx=128, threads=1)
    try:
        ids = b.tokenize(prompt)
        return exact_law(b, ids, sampling.SamplingParams(**LAW)), ids
    finally:
        b.close()


def favoured_tokens(target, law) -> tuple[list[int], list[int]]:
    """The tokens ``target`` favours, most first: by their mass in ``law`` (``law_after``), and by how often its
    plain greedy answers (40 tokens) to ``DRAFT_PROMPTS`` repeat them. A random draft whose vocabulary is a mix of
    them has its drafts both kept and rejected."""
    from ondevice.loader import load

    mass: dict[int, float] = {}
    for seq, pr in law.items():
        for t in seq:
            mass[t] = mass.get(t, 0.0) + pr
    seen: dict[int, int] = {}
    with load(target, drafter="none", threads=1) as rt:
        for prompt in DRAFT_PROMPTS:
            for t in rt.generate(prompt, max_tokens=40, temperature=0).tokens:
                seen[t] = seen.get(t, 0) + 1
    return sorted(mass, key=mass.get, reverse=True), sorted(seen, key=seen.get, reverse=True)


def sampled_law_kept(rt, ids, law, gamma: int = 3, n: int = 3000) -> None:
    """Speculative sampling on ``rt`` under ``LAW`` after ``ids`` with γ = ``gamma``: drafts are both kept and
    rejected (40 requests), so a planted control can fail, and the joint law of 3 tokens is ``law`` (chi-square
    of ``n`` samples, p > 1e-3)."""
    runs = [rt.generate(ids, max_tokens=3, seed=s, gamma=gamma, **LAW).stats for s in range(40)]
    accepted, drafted = sum(r.accepted for r in runs), sum(r.drafted for r in runs)
    assert 0 < accepted < drafted, (accepted, drafted)
    assert chisquare(sampled_counts(rt, ids, n, 0.8, 6, gamma), law, n) > 1e-3


def sampled_law_broken(rt, ids, law, gamma: int = 3, n: int = 3000) -> None:
    """As ``sampled_law_kept``, the joint law is not ``law`` (p < 1e-4): what a planted control must give."""
    assert chisquare(sampled_counts(rt, ids, n, 0.8, 6, gamma), law, n) < 1e-4


def convert_then_generate(src, target, tmp_path, drafter: str) -> None:
    """``ondevice convert SRC --to gguf --target TARGET --out DIR --json`` then ``ondevice generate TARGET --draft
    DIR/model.gguf --gamma 3 --temperature 0 --json`` drafts with it (its ``drafter``, stats.drafted > 0); the
    convert without ``--target`` exits 2 naming it and writes nothing."""
    import json
    import subprocess

    run = [sys.executable, "-m", "ondevice"]
    out = subprocess.run([*run, "convert", str(src), "--to", "gguf", "--target", str(target), "--out",
                          str(tmp_path / "d"), "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    gen = subprocess.run([*run, "generate", str(target), "--draft", str(tmp_path / "d" / "model.gguf"), "--gamma", "3",
                          "--temperature", "0", "--json", "-p", DRAFT_PROMPTS[0], "--threads", "1"],
                         capture_output=True, text=True, timeout=600)
    assert gen.returncode == 0, gen.stderr
    stats = json.loads(gen.stdout)["stats"]
    assert stats["drafter"] == drafter and stats["drafted"] > 0
    bad = subprocess.run([*run, "convert", str(src), "--to", "gguf", "--out", str(tmp_path / "e")],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--target" in bad.stderr and not (tmp_path / "e").exists()


def greedy_equal(spec, plain, prompts, gammas, max_tokens: int = 40, cap: int | None = None) -> tuple[int, int]:
    """Greedy speculation on ``spec`` emits ``plain``'s tokens for every prompt (text, or a chat: a list of
    messages) at every γ of ``gammas`` (with ``cap``: never more than min(γ, cap) drafts per target pass);
    returns (drafted, accepted) summed."""
    drafted = accepted = 0
    for prompt in prompts:
        chat = not isinstance(prompt, str)
        ref = (plain.chat if chat else plain.generate)(prompt, max_tokens=max_tokens, temperature=0, gamma=0)
        for gamma in gammas:
            res = (spec.chat if chat else spec.generate)(prompt, max_tokens=max_tokens, temperature=0, gamma=gamma)
            assert res.tokens == ref.tokens, (prompt, gamma)
            if cap is not None:
                assert res.stats.drafted <= min(gamma, cap) * res.stats.target_forwards
            drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    return drafted, accepted


def heads_greedy_equals_plain(spec, plain, prompts, shape: str, gamma: int) -> tuple[int, int]:
    """Greedy speculation with heads (``shape`` "chain" or "tree") emits ``plain``'s tokens on every prompt;
    trees are really verified as trees (some branch at 8 nodes) and chains never. Returns (drafted, accepted)."""
    use_trees(spec.drafter, shape == "tree")
    trees, orig = [], spec.target.eval_tree
    spec.target.eval_tree = lambda tokens, parents: trees.append(list(parents)) or orig(tokens, parents)
    drafted = accepted = 0
    for p in prompts:
        a = spec.generate(p, max_tokens=40, temperature=0, gamma=gamma)
        b = plain.generate(p, max_tokens=40, temperature=0, gamma=0)
        assert a.tokens == b.tokens
        drafted, accepted = drafted + a.stats.drafted, accepted + a.stats.accepted
        assert a.stats.accepted <= a.stats.drafted <= gamma * a.stats.target_forwards
    assert drafted > 0
    if shape == "chain":
        assert not trees
    else:  # verified as trees, and at 8 nodes some really branch (a node with two children)
        assert trees and max(len(t) for t in trees) <= gamma + 1
        if gamma == 8:
            assert any(len(set(t[1:])) < len(t) - 1 for t in trees)
    return drafted, accepted


def use_trees(drafter, on: bool) -> None:
    """Make ``drafter`` (an instance) draft trees or chains, whatever its kind declares."""
    import dataclasses

    drafter.traits = dataclasses.replace(drafter.traits, trees=on)


def steady_probe(monkeypatch) -> None:
    """The real cost probe, its curve clamped into what ``costs.plausible`` accepts: a test of caching or of a
    decision made from a probe must not depend on whether a loaded machine stalled the probe's threads (an
    implausible curve is, rightly, never cached)."""
    import dataclasses

    from ondevice import costs

    real = costs.measure

    def measure(*a, **kw):
        c = real(*a, **kw)
        t1 = c.target_seconds[1]
        return dataclasses.replace(c, target_seconds={k: min(max(t, 0.8 * t1), 1.5 * k * t1)
                                                      for k, t in c.target_seconds.items()})

    monkeypatch.setattr(costs, "measure", measure)


def served(model, n_ctx: int, api_key: str):
    """A module fixture's body (``yield from``): ``ondevice serve`` of ``model`` with one thread on a free loopback
    port behind ``api_key``; yields its URL and stops the server after the module."""
    from ondevice.server.run import launch

    proc, url = launch(str(model), "--n-ctx", str(n_ctx), "--threads", "1", api_key=api_key)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def loaded(model, n_ctx: int, threads: int = 1):
    """A module fixture's body (``yield from``): the runtime of ``model``, closed after the module."""
    from ondevice.loader import load

    with load(model, n_ctx=n_ctx, threads=threads) as rt:
        yield rt


def plant_no_residual(mp) -> None:
    """Planted control: the rejection residual does not subtract q (dense and sparse forms); ``mp``: a pytest
    ``MonkeyPatch`` or one of its contexts, which undoes it."""
    mp.setattr(sampling, "residual", lambda p, q: p)
    mp.setattr(sampling, "residual_sparse", lambda ids, pr, qv, V: pr)


def plant_wrong_q(mp, drafter_cls) -> None:
    """Planted control: ``drafter_cls.propose`` hands back, for each q row, the uniform law over its support instead
    of the distribution its token was drawn from; ``mp`` as in ``plant_no_residual``."""
    real = drafter_cls.propose

    def wrong_q(self, *a, **kw):
        tokens, q = real(self, *a, **kw)
        if q is not None and len(q):
            q = (q > 0) / np.maximum((q > 0).sum(-1, keepdims=True), 1)
        return tokens, q

    mp.setattr(drafter_cls, "propose", wrong_q)


def count_copies(drafter) -> list[bool]:
    """Per chain or tree proposed: whether it held a prompt-lookup copy (``Copies.copied``)."""
    seen, chain, tree = [], drafter.propose, drafter.propose_tree

    def propose(*a, **kw):
        out = chain(*a, **kw)
        if out[0]:
            seen.append(drafter.copies.copied)
        return out

    def propose_tree(*a, **kw):
        out = tree(*a, **kw)
        if out is not None and len(out) > 1:
            seen.append(drafter.copies.copied)
        return out

    drafter.propose, drafter.propose_tree = propose, propose_tree
    return seen
