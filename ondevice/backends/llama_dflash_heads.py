"""What DFlash2's candidate selector and DSpark's Markov head make of a drafted block (``Block``): the logits row of
draft position j given the token actually drafted at j − 1, from one block pass of llama.cpp's dflash graph.

- DFlash (plain): row j is the block's row j; it does not depend on the tokens drafted before it.
- DSpark: the graph's row j is ``base_j + bias(prev)`` with ``bias(t) = markov_w2 · markov_w1[t]`` (scattered
  through ``d2t`` for a reduced draft vocabulary), where the graph takes prev = the anchor for j = 0 and the
  *argmax* of its own row j − 1 after that (src/models/dflash.cpp ``build_dspark_markov_head``; its driver samples
  at temperature but conditions greedily). Here row j is conditioned on the token actually drafted at j − 1:
  the graph's row as it is when that token is the one the graph assumed, else ``row − bias(assumed) +
  bias(drafted)`` (``base_j`` does not depend on the drafted tokens: masks stand there). The drafted token is then
  drawn from exactly this row (processed by the request's sampling parameters), so it is its q.
- DFlash2: the graph's selector lattice (``h_nextn`` rows, ``build_dflash2_selector``) holds, per position j ≥ 1,
  its top-k candidates and their scores given each candidate of position j − 1 (the anchor for the first);
  row j is those scores at the candidates (−inf elsewhere) given the candidate drafted at j − 1, the row the
  reference driver's greedy walk takes the argmax of. A drafted token is always one of its position's
  candidates, so the next position's scores given it are in the lattice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError


def gguf_arrays(path: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The tensors of ``names`` present in a GGUF, dequantized to float32 in numpy (row-major) layout; int64
    tensors (``d2t``) as they are."""
    import gguf

    from ondevice.formats.gguf import GGUFFile

    out = {}
    for t in GGUFFile(path).reader.tensors:
        if t.name in names:
            shape = [int(d) for d in reversed(t.shape)]
            if t.tensor_type == gguf.GGMLQuantizationType.I64:
                out[t.name] = np.asarray(t.data, np.int64).reshape(shape)
            else:
                out[t.name] = np.asarray(gguf.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
    return out


class MarkovHead:
    """DSpark's Markov head read from the GGUF: ``bias(prev)`` [vocab] is what the graph adds to a row whose
    previous token is ``prev``."""

    def __init__(self, path: Path, vocab_size: int) -> None:
        a = gguf_arrays(path, ("markov_w1.weight", "markov_w2.weight", "markov_w2.scale", "d2t"))
        if "markov_w1.weight" not in a or "markov_w2.weight" not in a:
            raise OndeviceError(f"{path.name}: a DSpark draft without markov_w1 / markov_w2; re-convert it")
        self.w1, self.w2 = a["markov_w1.weight"], a["markov_w2.weight"]
        self.scale = float(a["markov_w2.scale"].reshape(-1)[0]) if "markov_w2.scale" in a else 1.0
        self.d2t, self.vocab_size = a.get("d2t"), vocab_size

    def bias(self, prev: int) -> np.ndarray:
        b = (self.w2 @ self.w1[int(prev)]) * self.scale
        if self.d2t is None:
            return b
        full = np.zeros(self.vocab_size, np.float32)
        full[self.d2t] = b
        return full


class Block:
    """One drafted block: ``row(j, prev)`` the logits of draft position j (0-based) given ``prev``, the token
    drafted at j − 1 (the anchor for j = 0).

    Args:
        anchor: the token the block was drafted after.
        logits: the graph's rows of the k draft positions [k, vocab].
        markov: DSpark's head (None otherwise).
        lattice: DFlash2's selector rows of the k draft positions [k, n_embd] (None otherwise) and ``top_k``.
    """

    def __init__(self, anchor: int, logits: np.ndarray, markov: MarkovHead | None = None,
                 lattice: np.ndarray | None = None, top_k: int = 0) -> None:
        self.anchor, self.logits, self.markov, self.lattice, self.top_k = int(anchor), logits, markov, lattice, top_k
        self._cand: list[np.ndarray] = []
        if lattice is not None:
            self._cand = [np.rint(r[:top_k]).astype(np.int64) for r in lattice]

    def __len__(self) -> int:
        return len(self.logits)

    def candidates(self, j: int) -> np.ndarray:
        """DFlash2: the selector's candidate token ids of draft position j (the graph's top-k order)."""
        return self._cand[j]

    def assumed(self, j: int) -> int:
        """DSpark: the previous token the graph's row j was conditioned on."""
        return self.anchor if j == 0 else int(np.argmax(self.logits[j - 1]))

    def row(self, j: int, prev: int) -> np.ndarray:
        if self.markov is not None:
            gp = self.assumed(j)
            if prev == gp:
                return self.logits[j]
            return self.logits[j] - self.markov.bias(gp) + self.markov.bias(prev)
        if self.lattice is None:
            return self.logits[j]
        k, cand = self.top_k, self._cand[j]
        p = 0  # position 1's scores are the same for every predecessor slot (the anchor's)
        if j > 0:
            hit = np.flatnonzero(self._cand[j - 1] == int(prev))
            if not hit.size:
                raise OndeviceError(f"DFlash2: token {prev} is not a candidate of block position {j}; the selector "
                                    "has no scores after it")
            p = int(hit[0])
        row = np.full(self.logits.shape[1], -np.inf, np.float32)
        row[cand] = self.lattice[j, k + p * k: k + (p + 1) * k]
        return row
