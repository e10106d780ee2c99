"""Reading GGUF files: the one GGUF reader of ondevice.

``read_header``: scalars and the token list only, fast; ``tensor_types``: the tensor table's types, counted.

``gguf.GGUFReader`` builds an object per array element and maps every tensor: ~20 s for Qwen2.5's
header (151,936 tokens and as many merges) on a loaded 2-core machine. Listing local models needs
only the scalars and the token texts, so this walks the header once with ``struct`` and skips other
arrays by their lengths (~0.3 s for the same file). Layout (GGUF v2/v3): magic, version u32,
tensor count u64, kv count u64, then per kv: key string, value type u32, value; a string is a u64
length + UTF-8 bytes; an array is an item type u32, a count u64 and the items.

``GGUFFile``: the whole file through ``gguf.GGUFReader`` (metadata, tensors, vocabulary, an HF-style config
for the llama/qwen2 archs), for the converters.
"""

from __future__ import annotations

import functools
import mmap
import re
import struct
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import numpy as np

from ondevice.errors import OndeviceError, shown

SUPPORTED = ("llama", "qwen2")
# The HF transformers spelling among the many each GGUF name has in gguf's TensorNameMap.
_HF_SPELLING = re.compile(
    r"^(model\.embed_tokens|model\.norm|lm_head"
    r"|model\.layers\.0\.(self_attn\.[a-z]_(proj|norm)|mlp\.[a-z]+_proj|[a-z_]*layernorm))$"
)


@functools.cache
def _hf_names(arch: str) -> dict[str, str]:
    """GGUF name (block 0 for per-block tensors) → HF name, from gguf's own TensorNameMap for ``arch``."""
    import gguf

    march = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    table = gguf.get_tensor_name_map(march, 1)
    out: dict[str, str] = {}
    for key, (_, gguf_name) in table.mapping.items():
        if gguf_name not in out and _HF_SPELLING.match(key) and table.get_name(key) == gguf_name:
            out[gguf_name] = key
    return out


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight`` (via gguf's TensorNameMap)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        base = _hf_names(arch).get(f"blk.0.{parts[2]}")
        if base is None:
            raise KeyError(gguf_name)
        return base.replace("model.layers.0.", f"model.layers.{parts[1]}.", 1) + "." + ".".join(parts[3:])
    base = _hf_names(arch).get(parts[0])
    if base is None:
        raise KeyError(gguf_name)
    return base + "." + ".".join(parts[1:])


# GGUF value type → struct code (8 = string, 9 = array are handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
TOKENS_KEY = "tokenizer.ggml.tokens"
# Caps on what a header may declare (a model file is untrusted input): far above any real model's header
# (Qwen2.5: 151,936 tokens, a chat template of a few kB; ggml tensors have at most 4 dimensions), far below
# what would exhaust memory or time. Counts are also checked against the bytes left in the file.
MAX_DEPTH = 8  # arrays of arrays
MAX_STRING = 16 << 20  # bytes in one string (key, value, token, tensor name)
MAX_COUNT = 1 << 24  # items in one array, keys, tensors
MAX_DIMS = 4  # GGML_MAX_DIMS


class _Corrupt(Exception):
    """A header field beyond its cap or past the end of the file (``_parse`` turns it into an OndeviceError)."""


def read_header(path: str | Path) -> tuple[dict, list[str] | None]:
    """Scalar metadata and the token texts of a GGUF file.

    Returns:
        ({key: value} for every scalar and string key, the token texts in id order or None).
    Raises:
        OndeviceError: not a GGUF v2/v3 file, a truncated header, or one that declares more than the caps
            above (nested arrays deeper than ``MAX_DEPTH``, a string, array or count too large).
    """
    path = Path(path)
    if path.stat().st_size < 24:
        raise OndeviceError(f"{shown(path)}: {path.stat().st_size} bytes, too short for a GGUF header (an interrupted download?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return _parse(mm, path)[:2]


def check_tensor_data(path: str | Path) -> None:
    """Fail unless the file holds every tensor its header lists (a download truncated inside the tensor data
    still has a readable header).

    Raises:
        OndeviceError: a corrupt header, or tensor data that runs past the end of the file.
    """
    tensor_types(path)


def tensor_types(path: str | Path) -> dict[str, int]:
    """How many tensors of each ggml type (``Q4_1``, ``F32``, ...) the file's tensor table lists, once the file is
    known to hold every tensor's data: the capped walk of ``read_header`` and of the table, no tensor data read
    and nothing built per array element (``gguf.GGUFReader`` is slow on a huge header).

    Raises:
        OndeviceError: a corrupt header or tensor table, or tensor data that runs past the end of the file (one
            line naming the file).
    """
    import gguf

    path = Path(path)
    size = path.stat().st_size
    meta, table, pos = _tensor_table(path)
    extent = 0
    counts: dict[str, int] = {}
    for ttype, dims, offset in table:
        try:
            kind = gguf.GGMLQuantizationType(ttype)
            block, nbytes = gguf.GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError) as e:
            raise OndeviceError(f"{shown(path)}: corrupt or truncated GGUF tensor table ({type(e).__name__})") from None
        count = 1
        for d in dims:
            count *= d
        extent = max(extent, offset + count // block * nbytes)
        counts[kind.name] = counts.get(kind.name, 0) + 1
    align = int(meta.get("general.alignment", 32)) or 32
    data = (pos + align - 1) // align * align
    if table and data + extent > size:  # a vocab-only file (no tensors) need not be padded
        raise OndeviceError(f"{shown(path)}: truncated: its tensor data ends at byte {data + extent} but the file has "
                            f"{size} bytes (an interrupted download?); download it again")
    return counts


def _tensor_table(path: Path) -> tuple[dict, list[tuple[int, tuple[int, ...], int]], int]:
    """(scalar metadata, [(ggml type, dims, data offset)] of every tensor, offset just past the table), every count
    checked against its cap and the bytes left.

    Raises:
        OndeviceError: one line naming the file.
    """
    if path.stat().st_size < 24:
        read_header(path)  # its "too short" error
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        size = len(mm)
        meta, _, pos = _parse(mm, path)
        end = "<" if struct.unpack_from("<I", mm, 4)[0] < 0x10000 else ">"
        n_tensors = struct.unpack_from(end + "Q", mm, 8)[0]
        table = []
        try:
            if n_tensors > min(MAX_COUNT, (size - pos) // 24):  # name length, n_dims, type, offset at least
                raise _Corrupt(f"{n_tensors} tensors")
            for _ in range(n_tensors):
                n = struct.unpack_from(end + "Q", mm, pos)[0]
                if n > min(MAX_STRING, size - pos):
                    raise _Corrupt(f"a tensor name of {n} bytes")
                pos += 8 + n
                n_dims = struct.unpack_from(end + "I", mm, pos)[0]
                if n_dims > MAX_DIMS:
                    raise _Corrupt(f"a tensor of {n_dims} dimensions (at most {MAX_DIMS})")
                dims = struct.unpack_from(end + "Q" * n_dims, mm, pos + 4)
                pos += 4 + 8 * n_dims
                ttype, offset = struct.unpack_from(end + "IQ", mm, pos)
                pos += 12
                table.append((ttype, dims, offset))
        except _Corrupt as e:
            raise OndeviceError(f"{shown(path)}: corrupt GGUF tensor table (it declares {e}); re-download it") from None
        except struct.error as e:
            raise OndeviceError(f"{shown(path)}: corrupt or truncated GGUF tensor table ({type(e).__name__})") from None
    return meta, table, pos


def _parse(buf, path: Path) -> tuple[dict, list[str] | None, int]:
    """(scalar metadata, token texts or None, offset of the tensor table) of the header in ``buf``; every
    failure is one OndeviceError naming ``path``."""
    try:
        return _walk(buf, path)
    except _Corrupt as e:
        raise OndeviceError(f"{shown(path)}: corrupt GGUF header (it declares {e}); re-download or reconvert it") from None
    except struct.error:
        raise OndeviceError(f"{shown(path)}: GGUF header runs past the end of the file ({len(buf)} bytes; "
                            "truncated, e.g. an interrupted download)") from None
    except (IndexError, UnicodeDecodeError, ValueError, OverflowError) as e:
        raise OndeviceError(f"{shown(path)}: corrupt GGUF header ({type(e).__name__}: {e})") from e


def _walk(buf, path: Path) -> tuple[dict, list[str] | None, int]:
    """``_parse`` without its error translation: one loop over the key-values, no recursion (nested arrays are
    walked with an explicit stack), every count and length checked against its cap and the bytes left."""
    if bytes(buf[:4]) != b"GGUF":
        raise OndeviceError(f"{shown(path)}: not a GGUF file (no GGUF magic)")
    end = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"  # big-endian files exist, rarely
    version, _, n_kv = struct.unpack_from(end + "IQQ", buf, 4)
    if version not in (2, 3):
        raise OndeviceError(f"{shown(path)}: GGUF version {version} is not supported (2 or 3)")
    u32, u64 = struct.Struct(end + "I"), struct.Struct(end + "Q")
    size = len(buf)
    if n_kv > min(MAX_COUNT, (size - 24) // 12):  # a key-value takes at least 12 bytes
        raise _Corrupt(f"{n_kv} metadata keys in {size} bytes")
    pos = 24
    meta: dict = {}
    tokens = None

    def string_end(p: int) -> int:
        n = u64.unpack_from(buf, p)[0]
        if n > MAX_STRING or p + 8 + n > size:
            raise _Corrupt(f"a string of {n} bytes at offset {p}" + (f" (at most {MAX_STRING})" if n > MAX_STRING else
                                                                      f" in a file of {size} bytes"))
        return p + 8 + n

    def string(p: int) -> tuple[str, int]:
        end = string_end(p)
        return bytes(buf[p + 8 : end]).decode("utf-8", "replace"), end

    def array_head(p: int, key: str) -> tuple[int, int, int]:
        """(item type, item count, offset of the first item) of the array at ``p``."""
        itype, count = u32.unpack_from(buf, p)[0], u64.unpack_from(buf, p + 4)[0]
        least = 12 if itype == 9 else 8 if itype == 8 else struct.calcsize(_SCALARS[itype]) if itype in _SCALARS else 0
        if not least:
            raise OndeviceError(f"{shown(path)}: GGUF array {key!r} has unknown item type {itype}")
        if count > MAX_COUNT or count * least > size - p - 12:
            raise _Corrupt(f"array {key!r} of {count} items at offset {p}")
        return itype, count, p + 12

    def skip_array(p: int, key: str) -> int:
        itype, count, p = array_head(p, key)
        stack = [(itype, count)]  # (item type, items left) of each array being walked, outermost first
        while stack:
            itype, left = stack.pop()
            if itype == 9:
                if left:
                    if len(stack) + 1 >= MAX_DEPTH:
                        raise _Corrupt(f"array {key!r} nested more than {MAX_DEPTH} deep")
                    stack.append((9, left - 1))
                    sub_type, sub_count, p = array_head(p, key)
                    stack.append((sub_type, sub_count))
            elif itype == 8:
                for _ in range(left):
                    p = string_end(p)
            else:
                p += left * struct.calcsize(_SCALARS[itype])
        return p

    for _ in range(n_kv):
        key, pos = string(pos)
        vtype = u32.unpack_from(buf, pos)[0]
        pos += 4
        if vtype == 8:
            meta[key], pos = string(pos)
        elif vtype in _SCALARS:
            meta[key] = struct.unpack_from(end + _SCALARS[vtype], buf, pos)[0]
            pos += struct.calcsize(_SCALARS[vtype])
        elif vtype == 9 and key == TOKENS_KEY and u32.unpack_from(buf, pos)[0] == 8:
            _, count, pos = array_head(pos, key)
            tokens = []
            for _ in range(count):
                text, pos = string(pos)
                tokens.append(text)
        elif vtype == 9:
            pos = skip_array(pos, key)
        else:
            raise OndeviceError(f"{shown(path)}: GGUF key {key!r} has unknown value type {vtype}")
        if pos > size:
            raise OndeviceError(f"{shown(path)}: GGUF header runs past the end of the file (truncated)")
    return meta, tokens, pos


def check_gguf_file(path: Path) -> None:
    """Fail with one line naming the file unless it starts like a GGUF."""
    if not path.is_file():
        from ondevice.inputs import why_missing

        why = why_missing(path)
        raise OndeviceError(f"{shown(path)}: {'no such model file' if why == 'no such file' else why}")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise OndeviceError(f"{shown(path)}: not a GGUF file (bad magic {head[:4]!r}); re-download or reconvert it")
    if len(head) < 8 or int.from_bytes(head[4:8], "little") not in (2, 3):
        raise OndeviceError(f"{shown(path)}: unsupported or corrupt GGUF header; re-download or reconvert it")


class GGUFFile:
    """A GGUF file read with ``gguf``: metadata fields, tensors, and the vocabulary."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        check_gguf_file(self.path)
        self._check_header()
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # gguf raises ValueError/IndexError/struct errors on corrupt files
            raise OndeviceError(f"{shown(self.path)}: corrupt GGUF ({type(e).__name__}: {e}); re-download or reconvert it") from e

    def _check_header(self) -> None:
        """The capped walk of ``read_header`` and the tensor count against the bytes left, before ``GGUFReader``
        (which trusts every count: a 65-byte header declaring an array of 2**62 items made it allocate memory
        for minutes, and nested arrays recursed until RecursionError).

        Raises:
            OndeviceError: one line naming the file, as ``read_header``.
        """
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            _, _, pos = _parse(mm, self.path)
            end = "<" if struct.unpack_from("<I", mm, 4)[0] < 0x10000 else ">"
            n_tensors = struct.unpack_from(end + "Q", mm, 8)[0]
            if n_tensors > min(MAX_COUNT, (len(mm) - pos) // 24):  # name length, n_dims, type, offset at least
                raise OndeviceError(f"{shown(self.path)}: corrupt GGUF tensor table (it declares {n_tensors} tensors in "
                                    f"{len(mm) - pos} bytes); re-download or reconvert it")

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    @cached_property
    def arch(self) -> str:
        return str(self.get("general.architecture"))

    def require_supported(self) -> None:
        if self.arch not in SUPPORTED:
            raise OndeviceError(f"{shown(self.path)}: architecture {self.arch!r} is not supported here; supported: {', '.join(SUPPORTED)}")
        model = self.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise OndeviceError(
                f"{shown(self.path)}: tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2'; SentencePiece GGUFs such as gemma3 are refused)"
            )

    @cached_property
    def tokens(self) -> list[str]:
        return list(self.get("tokenizer.ggml.tokens") or [])

    def config(self) -> dict:
        """An HF-style config.json for this GGUF (llama / qwen2)."""
        a = self.arch
        names = {t.name for t in self.reader.tensors}
        n_head = int(self.get(f"{a}.attention.head_count"))
        hidden = int(self.get(f"{a}.embedding_length"))
        cfg = {
            "model_type": a,
            "architectures": ["LlamaForCausalLM" if a == "llama" else "Qwen2ForCausalLM"],
            "hidden_size": hidden,
            "intermediate_size": int(self.get(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.get(f"{a}.block_count")),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(self.get(f"{a}.attention.head_count_kv", n_head)),
            "rms_norm_eps": float(self.get(f"{a}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.get(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.get(f"{a}.context_length", 2048)),
            "vocab_size": len(self.tokens),
            "tie_word_embeddings": "output.weight" not in names,
            "hidden_act": "silu",
        }
        head_dim = self.get(f"{a}.attention.key_length")
        if head_dim and int(head_dim) != hidden // n_head:
            cfg["head_dim"] = int(head_dim)
        bos, eos = self.get("tokenizer.ggml.bos_token_id"), self.get("tokenizer.ggml.eos_token_id")
        if bos is not None:
            cfg["bos_token_id"] = int(bos)
        if eos is not None:
            cfg["eos_token_id"] = int(eos)
        return cfg


def unpermute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of the llama Q/K row permutation (GGUF interleaved rope rows → HF rotate-half rows)."""
    rows = a.shape[0]
    return a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def llama_permuted_heads(g: GGUFFile, name: str, cfg: dict) -> int | None:
    """For a llama GGUF's Q or K weight, the head count its rows were permuted with; else None."""
    if g.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        return cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
    return None


def float_tensors(g: GGUFFile) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor dequantized to float32, in HF layout and under its HF name."""
    import gguf

    cfg = g.config()
    for t in g.reader.tensors:
        arr = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        heads = llama_permuted_heads(g, t.name, cfg)
        yield hf_name(t.name, g.arch), unpermute_rows(arr, heads) if heads else arr
