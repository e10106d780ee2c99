"""Model names beyond paths and the catalog: ``hf:``, ``ollama:``, ``lmstudio:`` and bare ``ORG/REPO``.

``resolve(spec)`` is called by ``lookup.resolve`` (so every command and ``load`` accept these names):

- ``hf:ORG/REPO[@REV][:QUANT|:FILE.gguf]``: a Hugging Face repo, through ``huggingface_hub`` (its cache,
  resume, progress bars, ``HF_HUB_OFFLINE``, its token). The cache is tried first; only a name that is
  not cached reaches the network. MLX / safetensors repos resolve to the snapshot directory; GGUF repos
  to one file, chosen by quant (``:Q4_K_M``) or file name (``:model-q8_0.gguf``).
- ``ollama:NAME[:TAG]``: Ollama's store (``$OLLAMA_MODELS`` or ``~/.ollama/models``): the manifest names
  the model blob, which is GGUF and is read in place, never copied.
- ``lmstudio:PATH[:QUANT]`` or ``lmstudio:NAME``: a path inside LM Studio's models folder, or a unique
  file/folder name in it (``$ONDEVICE_LMSTUDIO_MODELS``, else ``~/.lmstudio/models`` and
  ``~/.cache/lm-studio/models``).
- ``ORG/REPO[:QUANT]`` with no prefix: whichever local store holds it (HF cache or LM Studio), when
  exactly one does; never downloads (say ``hf:`` for that).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from ondevice.errors import OndeviceError, shown

PREFIXES = ("hf:", "ollama:", "lmstudio:")
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
_BARE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
# What a safetensors / MLX repo needs (weights, config, tokenizer, chat template); never other formats.
HF_MODEL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


# -- where each store lives (read from the environment at call time) ------------------------------
def hf_cache_dir() -> Path:
    """huggingface_hub's cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hf_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def ollama_dir() -> Path:
    """Ollama's store: ``$OLLAMA_MODELS`` or ``~/.ollama/models``."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders: ``$ONDEVICE_LMSTUDIO_MODELS`` (os.pathsep-separated) or the defaults."""
    env = os.environ.get("ONDEVICE_LMSTUDIO_MODELS")
    if env:
        return [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return [Path("~/.lmstudio/models").expanduser(), Path("~/.cache/lm-studio/models").expanduser()]


# -- picking a model inside a folder ---------------------------------------------------------------
def is_weights_dir(path: Path) -> bool:
    """An MLX or HF safetensors directory of a text-generation model (what the MLX backend opens)."""
    if not (path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))):
        return False
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return not archs or any(str(a).endswith(("CausalLM", "ConditionalGeneration")) for a in archs)


def _is_model_gguf(name: str) -> bool:
    """A GGUF that is a model: not a projector, and of a split GGUF only the first part."""
    m = _SPLIT.search(name)
    return name.lower().endswith(".gguf") and "mmproj" not in name.lower() and (not m or int(m.group(1)) == 1)


def gguf_files(directory: Path) -> list[Path]:
    """Model GGUFs under ``directory`` (see ``_is_model_gguf``)."""
    return [f for f in sorted(directory.rglob("*.gguf")) if _is_model_gguf(f.name) and not f.is_dir()]


def choose_gguf(names: list[str], selector: str | None, what: str) -> str:
    """The one model GGUF among ``names`` (paths relative to a repo) that ``selector`` names.

    ``selector`` is a file name (``model-Q8_0.gguf``) or a quant (``Q4_K_M``, case-insensitive; an exact
    quant field wins over a longer one: ``Q4_0`` prefers ``…-Q4_0.gguf`` to ``…-Q4_0_4_4.gguf``).
    Raises:
        OndeviceError: none or several match (listing what there is and how to choose).
    """
    models = [n for n in names if _is_model_gguf(n.rsplit("/", 1)[-1])]
    if not selector:
        hits = models
    elif selector.lower().endswith(".gguf"):
        hits = [n for n in models if selector in (n, n.rsplit("/", 1)[-1])]
    else:
        q = re.escape(selector)
        base = [n.rsplit("/", 1)[-1] for n in models]
        hits = [n for n, b in zip(models, base, strict=True) if re.search(rf"(^|[-_.]){q}([-.]|$)", b, re.I)] or \
            [n for n, b in zip(models, base, strict=True) if re.search(rf"(^|[-_.]){q}([-_.]|$)", b, re.I)]
    if len(hits) == 1:
        return hits[0]
    have = ", ".join(models) or "no GGUF files"
    if not hits:
        if not selector:
            raise OndeviceError(f"{what}: no model files (no GGUF, no safetensors); ondevice cannot run it")
        raise OndeviceError(f"{what}: no GGUF matching {selector!r} (there are: {have})")
    raise OndeviceError(f"{what} holds {len(hits)} GGUF files{f' matching {selector!r}' if selector else ''} "
                        f"({', '.join(hits)}); add :QUANT or :FILE.gguf to choose one")


def pick(directory: Path, selector: str | None, what: str) -> Path:
    """The model inside a repo/folder: the weights dir, or the GGUF that ``selector`` (quant or file) names.

    Raises:
        OndeviceError: nothing usable, or several GGUFs and no selector (listing the choices).
    """
    if not selector and is_weights_dir(directory):
        return directory
    names = [g.relative_to(directory).as_posix() for g in gguf_files(directory)]
    if not names and not selector:
        raise OndeviceError(f"{what}: {shown(directory)} holds no model (no GGUF file, no config.json + *.safetensors)")
    return directory / choose_gguf(names, selector, f"{what} ({directory})")


# -- hf: -------------------------------------------------------------------------------------------
def parse_hf(ref: str) -> tuple[str, str | None, str | None]:
    """``ORG/REPO[@REV][:SELECTOR]`` → (repo_id, revision, selector)."""
    repo, _, selector = ref.partition(":")
    repo, _, revision = repo.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise OndeviceError(f"hf:{ref}: expected hf:ORG/REPO[@REVISION][:QUANT or :FILE.gguf]")
    return repo, revision or None, selector or None


def _hf_error(name: str, e: Exception) -> OndeviceError:
    """One line for a huggingface_hub failure, naming the repo and the fix."""
    from huggingface_hub import errors

    kind = type(e).__name__
    if isinstance(e, errors.HFValidationError):
        return OndeviceError(f"{name}: not a valid Hugging Face repo id ({str(e).splitlines()[0]})")
    if isinstance(e, errors.GatedRepoError):
        return OndeviceError(f"{name}: the repo is gated; accept its terms on huggingface.co and log in "
                             "(`hf auth login` or HF_TOKEN)")
    if isinstance(e, errors.RevisionNotFoundError):
        return OndeviceError(f"{name}: no such revision on the Hugging Face Hub")
    if isinstance(e, errors.RepositoryNotFoundError):
        return OndeviceError(f"{name}: repository not found on the Hugging Face Hub (or private: log in with "
                             "`hf auth login` or set HF_TOKEN)")
    if isinstance(e, errors.EntryNotFoundError) and not isinstance(e, errors.LocalEntryNotFoundError):
        return OndeviceError(f"{name}: file not found in the repository ({str(e).splitlines()[0]})")
    if isinstance(e, errors.LocalEntryNotFoundError):
        return OndeviceError(f"{name}: not in the Hugging Face cache at {shown(hf_cache_dir())} and the Hub could not be "
                             "reached; connect once, or check HF_HUB_OFFLINE / HF_HOME")
    first = (str(e).splitlines() or [kind])[0]
    return OndeviceError(f"{name}: download failed ({kind}: {first}); rerun to resume")


def _hf_cached(repo: str, revision: str | None) -> Path | None:
    """The cached snapshot directory of ``repo`` (no network), or None when it is not cached."""
    from huggingface_hub import errors, snapshot_download

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=hf_cache_dir(), local_files_only=True))
    except (errors.LocalEntryNotFoundError, errors.RevisionNotFoundError, errors.HFValidationError, FileNotFoundError):
        return None  # not cached (or not a repo id at all)


def _hf_download(repo: str, revision: str | None, selector: str | None, name: str) -> Path:
    """Fetch what the name needs (one GGUF, or a safetensors repo's model files) into the HF cache."""
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download

    from ondevice.store.network import check_reachable

    cache = hf_cache_dir()
    check_reachable(constants.ENDPOINT, f"{name}: not in the Hugging Face cache at {cache}, and",
                    "connect to the network, or set HF_HUB_OFFLINE=1 to use cached models only")
    files = HfApi().list_repo_files(repo, revision=revision)
    weights = [f for f in files if f.endswith(".safetensors")]
    if selector or not weights:
        first = choose_gguf(files, selector, name)
        m = _SPLIT.search(first)
        parts = sorted(f for f in files if (n := _SPLIT.search(f)) and f[: n.start()] == first[: m.start()]) if m else [first]
        print(f"downloading {name} ({', '.join(parts)}) into {cache}", file=sys.stderr)
        paths = [hf_hub_download(repo, f, revision=revision, cache_dir=cache) for f in parts]
        return Path(paths[0])
    print(f"downloading {name} (model files) into {cache}", file=sys.stderr)
    return Path(snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=HF_MODEL_PATTERNS))


def resolve_hf(ref: str, *, download: bool = True) -> Path:
    """Resolve ``ORG/REPO[@REV][:SELECTOR]`` from the HF cache, downloading only when it is missing.

    Args:
        ref: the name without its ``hf:`` prefix.
        download: allow the network (also refused when ``HF_HUB_OFFLINE`` is set).
    Returns:
        The snapshot directory (safetensors / MLX) or the chosen GGUF file, inside the HF cache.
    Raises:
        OndeviceError: one line naming the repo, the cache and the fix.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo, revision, selector = parse_hf(ref)
    name = f"hf:{ref}"
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise _hf_error(name, e) from None
    snap = _hf_cached(repo, revision)
    if snap is not None:
        try:
            found = pick(snap, selector, name)
            if found.exists() or not download or hf_offline():  # a dangling link is downloaded again
                return found
        except OndeviceError:
            if not download or hf_offline():
                raise
    if hf_offline() or not download:
        why = "HF_HUB_OFFLINE is set" if hf_offline() else "downloads are off for this name"
        raise OndeviceError(f"{name}: not in the Hugging Face cache at {shown(hf_cache_dir())} and {why}; "
                            f"download it once with `ondevice pull hf:{ref}` while online")
    try:
        path = _hf_download(repo, revision, selector, name)
    except OndeviceError:
        raise
    except Exception as e:  # huggingface_hub and network errors → one line
        raise _hf_error(name, e) from e
    return pick(path, selector, name) if path.is_dir() else path


# -- ollama: ---------------------------------------------------------------------------------------
def ollama_manifest(name: str, root: Path | None = None) -> Path:
    """The manifest path of ``[HOST/][NAMESPACE/]MODEL[:TAG]`` (tag ``latest``, namespace ``library``)."""
    root = root or ollama_dir()
    base, _, tag = name.rpartition(":") if ":" in name.split("/")[-1] else (name, "", "latest")
    parts = base.split("/")
    if len(parts) == 1:
        parts = [OLLAMA_REGISTRY, "library", *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_REGISTRY, *parts]
    if len(parts) != 3 or not all(parts) or not tag:
        raise OndeviceError(f"ollama:{name}: expected ollama:NAME[:TAG] (e.g. ollama:qwen2.5-coder:0.5b)")
    return root / "manifests" / parts[0] / parts[1] / parts[2] / tag


def ollama_blob(manifest: Path, root: Path, name: str) -> Path:
    """The GGUF model blob a manifest names (checked to exist, to have its size, and to be GGUF)."""
    try:
        data = json.loads(manifest.read_text())
        layers = [x for x in data["layers"] if x.get("mediaType") == OLLAMA_MODEL_MEDIA]
        digest, size = layers[0]["digest"], int(layers[0].get("size", -1))
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise OndeviceError(f"{name}: corrupt Ollama manifest {shown(manifest)} ({type(e).__name__}: no model layer); "
                            f"run `ollama pull {name.removeprefix('ollama:')}` again") from e
    algo, _, hexdigest = str(digest).partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
        raise OndeviceError(f"{name}: corrupt Ollama manifest {shown(manifest)} (model digest {digest!r})")
    blob = root / "blobs" / f"sha256-{hexdigest}"
    if not blob.is_file():
        raise OndeviceError(f"{name}: the manifest {shown(manifest)} names blob sha256-{hexdigest[:12]}… but {shown(blob.parent)} "
                            f"has no such file; run `ollama pull {name.removeprefix('ollama:')}` again")
    if size >= 0 and blob.stat().st_size != size:
        raise OndeviceError(f"{name}: blob {shown(blob)} is {blob.stat().st_size} bytes but the manifest says {size} "
                            "(truncated download); run `ollama pull` again")
    with open(blob, "rb") as f:
        if f.read(4) != b"GGUF":
            raise OndeviceError(f"{name}: blob {shown(blob)} is not a GGUF file; ondevice reads Ollama's GGUF models only")
    if size < 0:  # no size to compare with: the file must at least hold the tensors its header lists
        from ondevice.formats.gguf import check_tensor_data

        try:
            check_tensor_data(blob)
        except OndeviceError as e:
            raise OndeviceError(f"{name}: {e}; run `ollama pull {name.removeprefix('ollama:')}` again") from None
    return blob


def ollama_names(root: Path | None = None) -> list[tuple[str, Path]]:
    """(name, manifest) for every model in the store; names shortened as ``ollama list`` shows them."""
    root = root or ollama_dir()
    out = []
    for m in sorted((root / "manifests").glob("*/*/*/*")):
        if not m.is_file():
            continue
        host, ns, model, tag = m.relative_to(root / "manifests").parts
        short = model if (host, ns) == (OLLAMA_REGISTRY, "library") else f"{ns}/{model}" if host == OLLAMA_REGISTRY \
            else f"{host}/{ns}/{model}"
        out.append((f"{short}:{tag}", m))
    return out


def resolve_ollama(name: str) -> Path:
    """``NAME[:TAG]`` → the model blob in Ollama's store (read in place)."""
    root = ollama_dir()
    manifest = ollama_manifest(name, root)
    if not manifest.is_file():
        have = ", ".join(n for n, _ in ollama_names(root)[:8]) or "none"
        raise OndeviceError(f"ollama:{name}: no manifest at {shown(manifest)} (OLLAMA_MODELS={shown(root)}; models there: {have}); "
                            f"run `ollama pull {name}`")
    return ollama_blob(manifest, root, f"ollama:{name}")


# -- lmstudio: -------------------------------------------------------------------------------------
def lmstudio_models(roots: list[Path] | None = None) -> list[tuple[str, Path]]:
    """(relative name, path) of every GGUF file and weights folder under LM Studio's models folders."""
    out = []
    for root in roots or lmstudio_dirs():
        if not root.is_dir():
            continue
        for g in gguf_files(root):
            out.append((g.relative_to(root).as_posix(), g))
        for cfg in sorted(root.rglob("config.json")):
            if is_weights_dir(cfg.parent):
                out.append((cfg.parent.relative_to(root).as_posix(), cfg.parent))
    return out


def resolve_lmstudio(ref: str) -> Path:
    """``PATH[:QUANT]`` inside a models folder, or a unique file/folder name (case-insensitive)."""
    roots = lmstudio_dirs()
    rel, _, selector = ref.partition(":")
    name = f"lmstudio:{ref}"
    if not rel.strip("/") or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise OndeviceError(f"{name}: expected lmstudio:PATH[:QUANT] with PATH inside LM Studio's models folder "
                            f"({', '.join(map(shown, roots))}), or a file/folder name; for other files give the path itself")
    hits = [r / rel for r in roots if (r / rel).exists()]
    if not hits:
        key = rel.lower().removesuffix(".gguf")
        models = lmstudio_models(roots)
        hits = [p for n, p in models if n.lower().removesuffix(".gguf") == key]
        hits = hits or [p for n, p in models if key in n.lower().rsplit("/", 1)[-1]] or \
            [p for n, p in models if key in n.lower()]
        if selector and len(hits) > 1 and all(h.is_file() for h in hits):  # e.g. lmstudio:REPO-GGUF:Q4_K_M
            return Path(choose_gguf([h.as_posix() for h in hits], selector, name))
    if len(hits) > 1:
        raise OndeviceError(f"{name} is ambiguous: {', '.join(shown(h) for h in hits[:6])}; give the path inside the folder")
    if not hits:
        raise OndeviceError(f"{name}: nothing of that name in LM Studio's folders "
                            f"({', '.join(map(shown, roots))}; set ONDEVICE_LMSTUDIO_MODELS to use another)")
    return hits[0] if hits[0].is_file() else pick(hits[0], selector or None, name)


# -- the hook --------------------------------------------------------------------------------------
def resolve(spec: str, *, download: bool = True) -> Path | None:
    """Resolve a prefixed or bare ``ORG/REPO`` name; None when ``spec`` is neither (paths, catalog names).

    Args:
        spec: the name.
        download: let an ``hf:`` name that is not cached download (bare names never do).

    Raises:
        OndeviceError: the name is of one of these kinds but cannot be resolved (saying where it looked).
    """
    if spec.startswith(PREFIXES) or _BARE.match(spec):
        path = _resolve(spec, download)
        if path.is_symlink() and not path.exists():  # the HF cache links into blobs/; an interrupted download
            raise OndeviceError(f"{spec}: {shown(path)} is a broken link to {shown(os.readlink(path))} (an interrupted download?); "
                                "download it again")
        return path
    return None


def _resolve(spec: str, download: bool) -> Path:
    if spec.startswith("hf:"):
        return resolve_hf(spec[3:], download=download)
    if spec.startswith("ollama:"):
        return resolve_ollama(spec[7:])
    if spec.startswith("lmstudio:"):
        return resolve_lmstudio(spec[9:])
    found: list[tuple[str, Path]] = []
    repo, _, selector = spec.partition(":")
    if _hf_cached(repo, None) is not None:
        found.append(("hf", resolve_hf(spec, download=False)))
    for root in lmstudio_dirs():
        if (root / repo).is_dir():
            found.append(("lmstudio", pick(root / repo, selector or None, f"lmstudio:{spec}")))
    if len(found) > 1:
        raise OndeviceError(f"{spec} is ambiguous: " + "; ".join(f"{k}:{spec} → {shown(p)}" for k, p in found)
                            + "; add the prefix to choose")
    if found:
        return found[0][1]
    raise OndeviceError(f"{spec}: no such file, and no repo of that name in the Hugging Face cache ({shown(hf_cache_dir())}) "
                        f"or LM Studio's folders ({', '.join(map(shown, lmstudio_dirs()))}); "
                        f"say hf:{spec} to download it")
