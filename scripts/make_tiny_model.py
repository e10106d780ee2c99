"""Write a tiny deterministic random-weight HF checkpoint (for tests and experiments).

    python scripts/make_tiny_model.py OUT_DIR [--arch llama|qwen2] [--layers 2] [--vocab 512] [--seed 0]
"""

from __future__ import annotations

import argparse

from ondevice.testing import make_tiny_hf

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(make_tiny_hf(a.out, a.arch, n_layers=a.layers, vocab_size=a.vocab, seed=a.seed))
