"""EAGLE-3 costs on a real llama-arch target with a random-weight draft of its shapes (no real EAGLE-3 weights
are reachable here, so τ cannot be measured; these are the costs that decide whether one would pay).

Measured as CPU seconds of this process (one llama.cpp thread), paired and interleaved, median ratio: on the
shared 2-core machine wall-clock times swing 30× with the other processes' load, CPU time much less.
- verify-pass overhead of recording 3 layer inputs (llama.cpp's own ``embeddings_layer_inp``), read included;
- the same through the public ``cb_eval`` callback (``llama_ext.EvalTap``, the route for qwen2);
- the draft's cost per drafted token (a chain of 4 after one verified token: encode, 4 decoder rows) ÷ a target
  decode, for draft vocabularies ``--draft-vocab``.

    PYTHONPATH=$PWD python scripts/bench_eagle3.py ~/.cache/ondevice/models/smollm2-135m-instruct/*.gguf
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def _paired(a, b, n: int) -> tuple[float, float, float]:
    """Median CPU seconds of a() and b() and the median of their paired ratio b / a, interleaved n times."""
    ta, tb = [], []
    for i in range(n):
        for f, out in ((a, ta), (b, tb)) if i % 2 else ((b, tb), (a, ta)):
            t0 = time.process_time()
            f()
            out.append(time.process_time() - t0)
    return float(np.median(ta)), float(np.median(tb)), float(np.median(np.array(tb) / np.array(ta)))


def main() -> None:
    import llama_cpp

    from converters.eagle3 import convert_eagle3
    from ondevice.backends import llama_ext
    from ondevice.backends.eagle3 import Eagle3Graph, draft_chain
    from ondevice.backends.llama import LlamaBackend
    from ondevice.testing.eagle3 import make_tiny_eagle3

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path, help="a llama-arch GGUF")
    ap.add_argument("--draft-vocab", type=int, nargs="+", default=[32000, 8192])
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    kw = dict(n_ctx=512, n_batch=64, threads=1)
    a, r = LlamaBackend(args.target, **kw), LlamaBackend(args.target, **kw)
    lib, h = llama_cpp, int(llama_cpp.llama_model_n_embd(a._model))
    n_layer, n_vocab = int(lib.llama_model_n_layer(a._model)), a.vocab_size
    ids = [2, n_layer // 2, n_layer - 3]
    toks = [int(x) for x in np.random.default_rng(0).integers(3, min(n_vocab, 40000), size=80)]
    llama_ext.record_layer_inputs(r._ctx, r._model, ids)
    for b in (a, r):
        b.eval(toks[:64], "last")

    def verify(b, read):
        def f():
            b.rollback(64)
            b.eval(toks[64:68], "all")
            if read:
                llama_ext.layer_inputs(b._ctx, ids, 4, h)
        return f

    out = {"target": args.target.name, "layer_ids": ids}
    p, q, ratio = _paired(verify(a, False), verify(r, True), args.reps)
    out["record_layer_inputs"] = {"verify4_ms": round(p * 1e3, 2), "recording_ms": round(q * 1e3, 2),
                                  "ratio": round(ratio, 3)}
    r.close()

    tap = llama_ext.EvalTap(ids, h, n_layer)
    mp = lib.llama_model_default_params()
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 512, 64, 64, 1, 1
    cp.cb_eval, cp.cb_eval_user_data = tap.callback, None
    model = lib.llama_model_load_from_file(str(args.target).encode(), mp)
    ctx = lib.llama_init_from_model(model, cp)
    arr = (lib.llama_token * 64)(*toks[:64])
    lib.llama_decode(ctx, lib.llama_batch_get_one(arr, 64))
    tap.clear()
    arr4 = (lib.llama_token * 4)(*toks[64:68])

    def with_tap():
        lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), 0, 64, -1)
        lib.llama_decode(ctx, lib.llama_batch_get_one(arr4, 4))
        tap.read()

    p, q, ratio = _paired(verify(a, False), with_tap, args.reps)
    out["cb_eval"] = {"verify4_ms": round(p * 1e3, 2), "with_callback_ms": round(q * 1e3, 2), "ratio": round(ratio, 3)}
    lib.llama_free(ctx)
    lib.llama_model_free(model)

    llama_ext.record_layer_inputs(a._ctx, a._model, ids)
    a.rollback(0)
    a.eval(toks[:64], "all")
    prefix = llama_ext.layer_inputs(a._ctx, ids, 64, h)
    heads = int(lib.llama_model_n_head(a._model))
    kv = int(lib.llama_model_n_head_kv(a._model))
    out["draft"] = []
    with tempfile.TemporaryDirectory() as tmp:
        for dv in args.draft_vocab:
            src = make_tiny_eagle3(Path(tmp) / f"src{dv}", target_hidden=h, vocab_size=n_vocab, n_heads=heads,
                                   n_kv_heads=kv, intermediate=int(h * 8 / 3) // 64 * 64, draft_vocab=dv,
                                   own_embeddings=False, layer_ids=ids)
            s = convert_eagle3(src, target=args.target, out=Path(tmp) / f"out{dv}")
            g = Eagle3Graph(Path(tmp) / f"out{dv}" / "model.gguf", a._ctx, a._model, n_ctx=512, threads=1)
            draft_chain(g, prefix, toks[:64], 0, toks[64], 1)

            def decode():
                a.rollback(64)
                a.eval(toks[64:65], "all")

            f = llama_ext.layer_inputs(a._ctx, ids, 1, h)
            p, q, ratio = _paired(decode, lambda g=g, f=f: draft_chain(g, f, toks[64:65], 64, toks[65], 4), args.reps)
            out["draft"].append({"draft_vocab": dv, "size_mb": round(s["size_bytes"] / 1e6, 1),
                                 "verify_logit_rel": s["verify"]["logit_rel"], "target_decode_ms": round(p * 1e3, 2),
                                 "chain4_ms": round(q * 1e3, 2), "per_token_over_decode": round(ratio / 4, 3)})
            g.close()
    a.close()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
