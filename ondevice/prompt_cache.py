"""A prompt cache on disk: the KV state of long prompt prefixes (system prompts, tools, documents), restored
when a later request, in this process or after a restart, starts with the same tokens.

One file per stored prefix: ``<model>-<build>-<layout>-<tokens>.kvc`` in the cache folder, where ``model`` is
the first 16 hex digits of the model file's sha256 (hashed once and remembered by the file's size, mtime and
inode, like the store's pull stamps), ``build`` a hash of everything else the bytes depend on but the layout (the
llama.cpp library files and versions, the K/V cache types, the device), ``layout`` the context's sequence layout
(``u16``: one KV buffer, 16 sequence ids, the one-at-a-time runtime's; ``s4``: a buffer per sequence, 4 of them,
``parallel=4``'s: llama.cpp serialises a sequence differently in each, so each restores only its own), and
``tokens`` a hash of the exact prefix. A file holds::

    MAGIC | u32 header length | header JSON (identity, n_tokens, state size and sha256) | int32 tokens | state

``lookup`` picks the stored prefix sharing the longest common prefix with the request: K/V rows depend only on
the tokens before them, so a longer stored prefix restored and cut back to the common part is exact (the
state is exactly what this model computed for those tokens; only the batch split of the prefill may differ
from a fresh one, as with the runtime's in-memory prefix). A file that is truncated or altered (size, token
hash or state sha256 wrong), that names our identity but holds another's, or that llama.cpp refuses, is
reported in one line and deleted: never restored. Files of this model made by another build are deleted too
(they can never be used again); other models' files, and this build's files of another layout (a server run
with and without ``--parallel`` on one folder), are left alone. The folder is bounded by ``max_bytes``:
least recently used files go first (a hit touches its file's mtime). Writes are atomic (``ondevice.atomic``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ondevice import inputs
from ondevice.atomic import replacing, write_text
from ondevice.errors import OndeviceError

MAGIC = b"ODKVC01\n"
SUFFIX = ".kvc"
DEFAULT_MAX_BYTES = 4 << 30
DEFAULT_MIN_TOKENS = 32  # shorter prefixes are prefilled faster than a file is read and restored


def _stderr(message: str) -> None:
    print(f"ondevice: {message}", file=sys.stderr)


def _sha256_of_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_sha256(path: str | os.PathLike, memo_dir: str | os.PathLike) -> str:
    """sha256 of the model file, remembered in ``memo_dir`` by (real path, size, mtime_ns, inode): hashed once,
    again only when the file changes (a 4 GB model takes seconds; a restart then reads the memo). A catalog
    model's pull stamp (size, mtime_ns, sha256 checked at download) is used when it matches the file."""
    real = Path(path).resolve()
    st = real.stat()
    stamp = {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    memo = Path(memo_dir) / f".model-{hashlib.sha256(str(real).encode()).hexdigest()[:16]}.json"
    pulled = real.with_name(real.name + ".verified")  # a catalog pull's stamp (ondevice.store.fetch): same rule
    for f, keys in ((memo, stamp), (pulled, {"size": st.st_size, "mtime_ns": st.st_mtime_ns})):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and {k: rec.get(k) for k in keys} == keys and isinstance(rec.get("sha256"), str):
            return rec["sha256"]
    digest = _sha256_of_file(real)
    write_text(memo, json.dumps({**stamp, "sha256": digest}))
    return digest


def build_identity(backend) -> dict:
    """What a llama.cpp KV state's bytes depend on besides the model: library files and versions, cache types
    and layout, device. Any change means a file made before cannot be restored (a rebuild only costs a miss)."""
    import llama_cpp

    h = hashlib.sha256()
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for f in sorted({p.resolve() for p in lib_dir.glob("*") if p.is_file() and ("llama" in p.name or "ggml" in p.name)}):
        h.update(f.name.encode() + b"\0")
        h.update(bytes.fromhex(_sha256_of_file(f)))
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp": (llama_cpp.llama_version() or b"").decode(),
        "system": (llama_cpp.llama_print_system_info() or b"").decode().strip(),
        "libs_sha256": h.hexdigest(),
        "state_seq_version": int(llama_cpp.LLAMA_STATE_SEQ_VERSION),
        "cache_type_k": backend.cache_type_k,
        "cache_type_v": backend.cache_type_v,
        "kv_unified": backend.kv_unified,
        "n_seq_max": backend.n_seq_max,
        "swa_full": backend.n_swa > 0,
        "device": backend.device,
    }


def _tokens_hash(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()[:32]


def _common(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class _Bad(Exception):
    """A cache file that must not be restored (the message says why)."""


class PromptCache:
    """KV states of prompt prefixes on disk for one llama.cpp backend (model, build and cache types).

    Args:
        directory: the cache folder (created if missing); several models and processes may share it.
        backend: an ``ondevice.backends.llama.LlamaBackend`` (``save_seq_state``/``load_seq_state``).
        max_bytes: bound of the folder's ``.kvc`` files together; least recently used files are deleted.
        min_tokens: shorter prefixes are neither stored nor restored.
        warn: where one-line notes about refused files go (default: stderr).
    """

    def __init__(self, directory: str | os.PathLike, backend, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 min_tokens: int = DEFAULT_MIN_TOKENS, warn: Callable[[str], None] | None = None) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OndeviceError(f"prompt cache {self.dir}: cannot use it as a folder ({e.strerror}); pass a folder path") from None
        if not os.access(self.dir, os.R_OK | os.W_OK | os.X_OK):
            raise OndeviceError(f"prompt cache {self.dir}: not readable and writable; pass a folder of your own")
        self.backend = backend
        self.max_bytes = inputs.integer("prompt cache max_bytes", max_bytes, 1)
        self.min_tokens = inputs.integer("prompt cache min_tokens", min_tokens, 1)
        self.warn = warn or _stderr
        self.model_sha256 = model_sha256(backend.path, self.dir)
        self.build = build_identity(backend)
        self.identity = {"model_sha256": self.model_sha256, **self.build}
        build = {k: v for k, v in self.build.items() if k not in ("kv_unified", "n_seq_max")}
        build_hash = hashlib.sha256(json.dumps(build, sort_keys=True).encode()).hexdigest()[:8]
        self._model_prefix = self.model_sha256[:16] + "-"
        self._build_prefix = f"{self._model_prefix}{build_hash}-"
        self._prefix = f"{self._build_prefix}{'u' if backend.kv_unified else 's'}{backend.n_seq_max}-"
        self._index: dict[str, tuple[int, np.ndarray]] = {}  # file name → (size, tokens), read once per file
        self._drop_other_builds()

    # -- files --------------------------------------------------------------------------------------
    def _path(self, ids: Sequence[int]) -> Path:
        return self.dir / f"{self._prefix}{_tokens_hash(ids)}{SUFFIX}"

    def _refuse(self, path: Path, why: str) -> None:
        self.warn(f"prompt cache: refused {path.name} ({why}); deleted it")
        self._index.pop(path.name, None)
        path.unlink(missing_ok=True)

    def _drop_other_builds(self) -> None:
        for p in self.dir.glob(f"{self._model_prefix}*{SUFFIX}"):
            if not p.name.startswith(self._build_prefix):
                self._refuse(p, "made by another llama.cpp build or cache type for this model")

    def _read_head(self, path: Path, f) -> tuple[dict, np.ndarray]:
        """Header and tokens of an open cache file, checked against this identity and the file's name."""
        if f.read(len(MAGIC)) != MAGIC:
            raise _Bad("not a prompt-cache file")
        raw = f.read(4)
        if len(raw) != 4:
            raise _Bad("truncated")
        (n_head,) = struct.unpack("<I", raw)
        try:
            head = json.loads(f.read(n_head)) if n_head < 1 << 20 else None
            n, size = int(head["n_tokens"]), int(head["state_bytes"])
        except (ValueError, TypeError, KeyError):
            raise _Bad("unreadable header") from None
        if head.get("identity") != self.identity:
            raise _Bad("made by another model, llama.cpp build or cache type")
        tokens = np.frombuffer(f.read(4 * n), dtype="<i4")
        if len(tokens) != n or n < 1:
            raise _Bad("truncated")
        if f"{self._prefix}{_tokens_hash(tokens)}{SUFFIX}" != path.name:
            raise _Bad("its tokens do not match its name")
        if path.stat().st_size != len(MAGIC) + 4 + n_head + 4 * n + size:
            raise _Bad("truncated or padded")
        return head, tokens

    def _entries(self) -> dict[str, np.ndarray]:
        """This identity's files and their tokens; unreadable ones are refused."""
        out = {}
        for p in self.dir.glob(f"{self._prefix}*{SUFFIX}"):
            try:
                size = p.stat().st_size
                known = self._index.get(p.name)
                if known is None or known[0] != size:
                    with open(p, "rb") as f:
                        known = (size, self._read_head(p, f)[1])
                    self._index[p.name] = known
                out[p.name] = known[1]
            except FileNotFoundError:  # another process evicted it
                self._index.pop(p.name, None)
            except (_Bad, OSError) as e:
                self._refuse(p, str(e))
        return out

    def _load(self, path: Path) -> bytes:
        with open(path, "rb") as f:
            head, _ = self._read_head(path, f)
            state = f.read()
        if len(state) != head["state_bytes"] or hashlib.sha256(state).hexdigest() != head.get("state_sha256"):
            raise _Bad("its KV state fails its sha256 check")
        return state

    # -- API ----------------------------------------------------------------------------------------
    def lookup(self, ids: Sequence[int], max_tokens: int | None = None,
               more_than: int = 0) -> tuple[int, Callable[..., int] | None]:
        """The longest prefix of ``ids`` a stored file holds.

        Args:
            ids: the request's tokens.
            max_tokens: reuse at most this many (default ``len(ids) - 1``: the last token is evaluated for its
                logits).
            more_than: only a prefix longer than this is worth reading (e.g. what the cache in memory reuses).
        Returns:
            (n, restore): ``restore(seq=0)`` makes the backend's sequence ``seq`` hold ``ids[:n]`` (whatever it
            held is replaced) and returns n, or returns 0 with the sequence empty when llama.cpp refuses the file
            (which is then deleted);
            (0, None) when nothing of at least ``min_tokens`` is stored. The file is read and checked here.
        """
        want = np.asarray(ids, dtype=np.int64)
        cap = len(want) - 1 if max_tokens is None else min(int(max_tokens), len(want))
        scored = sorted(((min(_common(t, want), cap), -len(t), name) for name, t in self._entries().items()
                         if len(t) <= self.backend.n_ctx_seq), reverse=True)
        for n, neg_len, name in scored:
            if n < self.min_tokens or n <= more_than:
                break
            path = self.dir / name
            try:
                state = self._load(path)
            except FileNotFoundError:
                continue
            except (_Bad, OSError) as e:
                self._refuse(path, str(e))
                continue
            try:
                os.utime(path)  # least recently used goes first
            except FileNotFoundError:  # evicted by another process since: the state is in memory already
                pass
            return n, self._restorer(path, state, -neg_len, n)
        return 0, None

    def _restorer(self, path: Path, state: bytes, n_file: int, n: int) -> Callable[..., int]:
        def restore(seq: int = 0) -> int:
            try:  # the common part only: its K/V rows do not depend on what followed
                self.backend.load_seq_state(state, n_file, seq, keep=n)
            except OndeviceError as e:
                self._refuse(path, str(e))
                return 0
            return n

        return restore

    def store(self, ids: Sequence[int], seq: int = 0) -> bool:
        """Save the backend's sequence ``seq``, which must hold exactly ``ids``, unless a stored prefix already
        covers ``ids`` (then it is touched). Stored prefixes that ``ids`` extends are deleted (every request
        they served, this file serves as well), then least recently used files until the folder fits
        ``max_bytes``. Returns whether a file was written."""
        ids = [int(t) for t in ids]
        if len(ids) < self.min_tokens:
            return False
        if (held := self.backend.seq_positions(seq)) != len(ids):
            raise ValueError(f"store: sequence {seq} holds {held} positions, not the {len(ids)} tokens given")
        want = np.asarray(ids, dtype=np.int64)
        entries = self._entries()
        for name, t in entries.items():
            if len(t) >= len(ids) and _common(t, want) == len(ids):
                try:
                    os.utime(self.dir / name)
                except FileNotFoundError:
                    pass
                return False
        state = self.backend.save_seq_state(seq)
        head = json.dumps({"identity": self.identity, "n_tokens": len(ids), "state_bytes": len(state),
                           "state_sha256": hashlib.sha256(state).hexdigest()}).encode()
        total = len(MAGIC) + 4 + len(head) + 4 * len(ids) + len(state)
        if total > self.max_bytes:
            return False
        path = self._path(ids)
        with replacing(path) as tmp, open(tmp, "wb") as f:  # a temp file renamed onto path once whole
            f.write(MAGIC + struct.pack("<I", len(head)) + head)
            f.write(np.asarray(ids, dtype="<i4").tobytes())
            f.write(state)
        self._index[path.name] = (total, np.asarray(ids, dtype="<i4"))
        for name, t in entries.items():
            if len(t) < len(ids) and _common(t, want) == len(t):
                self._index.pop(name, None)
                (self.dir / name).unlink(missing_ok=True)
        self._evict(keep=path)
        return True

    def _evict(self, keep: Path) -> None:
        files = []
        for p in self.dir.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, size, p in sorted(files, key=lambda x: x[0]):
            if total <= self.max_bytes:
                break
            if p != keep:
                self._index.pop(p.name, None)
                p.unlink(missing_ok=True)
                total -= size

    def size_bytes(self) -> int:
        """Bytes of every ``.kvc`` file in the folder (all models)."""
        total = 0
        for p in self.dir.glob(f"*{SUFFIX}"):
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                pass
        return total
