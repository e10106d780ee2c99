"""The drafter kinds by name: ``load(drafter=...)``, the CLI, ``draft="auto"`` and the policy find a kind here
and read its declared ``Traits``; no module outside this one compares a drafter's name.

A new kind (MTP, EAGLE-3, DFlash, a trained drafter) is one module under ``ondevice/drafters/`` and one
``register`` call below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ondevice.drafters.base import Drafter, Traits
from ondevice.drafters.dflash import DFlashDrafter, is_dflash_gguf
from ondevice.drafters.eagle3 import Eagle3Drafter
from ondevice.drafters.heads import HeadsDrafter
from ondevice.drafters.model import ModelDrafter
from ondevice.drafters.mtp import MtpDrafter
from ondevice.drafters.ngram import NgramDrafter
from ondevice.errors import OndeviceError


@dataclass(frozen=True, kw_only=True)
class Build:
    """What a kind's factory may use: the open target and the load's arguments."""

    target: object  # the open target ``Backend``
    draft: str | Path | None = None  # the draft model argument (model kinds)
    source: str | Path | None = None  # a drafter file (heads: None = the one stored for the target)
    draft_backend: object = None  # a draft already opened (``draft="auto"``)
    n_ctx: int = 4096
    threads: int | None = None
    device: str | None = None
    mmap: bool = True
    draft_device: str | None = None


@dataclass(frozen=True, kw_only=True)
class Kind:
    """A drafter kind: its declared traits, its factory, and which ``draft=`` arguments name it."""

    traits: Traits
    build: Callable[[Build], Drafter | None]
    help: str
    claims: Callable[[str], bool] | None = None  # a ``draft=`` argument that selects this kind (heads files)

    @property
    def name(self) -> str:
        return self.traits.name


_KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> None:
    _KINDS[kind.name] = kind


def names() -> tuple[str, ...]:
    return tuple(_KINDS)


def get(name: str) -> Kind:
    """The kind called ``name``; a one-line error lists the others."""
    try:
        return _KINDS[name]
    except KeyError:
        raise OndeviceError(f"drafter={name!r}: choose one of {', '.join(_KINDS)}") from None


def traits(name: str) -> Traits:
    return get(name).traits


def choose(drafter: str | None, draft: str | Path | None) -> tuple[Kind | None, str | Path | None, str | Path | None]:
    """The kind ``load(draft=..., drafter=...)`` asks for, before pairs and ``draft="auto"`` are resolved.

    Returns:
        (the kind, or None when it depends on whether a draft model is found; the draft model argument left;
        a drafter file, e.g. a ``.heads.safetensors``).
    """
    asked = None if drafter is None else get(drafter)
    if draft is not None and (asked is None or asked.traits.model or asked.claims is not None):
        for kind in _KINDS.values():
            if kind.claims is not None and kind.claims(str(draft)) and (asked is None or asked.traits.model or asked is kind):
                return kind, None, None if str(draft) == kind.name else draft
    return asked, draft, None


def per_target(draft: str | Path | None) -> bool:
    """``draft`` names a kind that each target resolves for itself (``"heads"``: the heads stored for it), not one
    model's draft file."""
    kind = _KINDS.get(str(draft))
    return kind is not None and kind.claims is not None and kind.claims(str(draft))


def settle(kind: Kind | None, draft: str | Path | None) -> Kind:
    """The kind once pairs are resolved: a draft model's kind when one is given, else prompt lookup; a draft
    given to a kind that would not use it (or none to one that needs it) is refused in one line."""
    kind = kind or get("model" if draft is not None else "ngram")
    if kind.traits.model and draft is None:
        raise OndeviceError(f"drafter={kind.name!r} needs a draft model: pass draft=PATH (or --draft)")
    if not kind.traits.model and draft is not None:
        raise OndeviceError(f"a draft model was given but drafter={kind.name!r} would not use it; drop one of them")
    return kind


def _model(b: Build) -> Drafter:
    from ondevice.backends import open_backend
    from ondevice.formats.pairs import check_vocabs
    from ondevice.store import lookup

    t, backend = b.target, b.draft_backend
    if backend is None:
        backend = open_backend(lookup.resolve(b.draft), n_ctx=b.n_ctx, threads=b.threads, mmap=b.mmap,
                               device=b.draft_device or b.device, keep_ne=b.draft_device is None and b.device != "mil")
    try:
        limit = check_vocabs(t.vocab_tokens(), backend.vocab_tokens(), t.path, backend.path)
    except BaseException:
        backend.close()
        raise
    return ModelDrafter(backend, limit, t.vocab_size)


def _ngram(b: Build) -> Drafter:
    return NgramDrafter()


def _heads(b: Build) -> Drafter:
    """The drafter ``train-heads`` stored for the target: the EAGLE-style one (its default kind) where there is
    one and the target is a llama.cpp one, else the Medusa heads."""
    if "layer_inputs" in b.target.features:  # declared (every Backend has the method)
        from ondevice.heads import eagle_store

        # the one stored for the target, or the file draft="auto" chose (``autodraft.heads_row``)
        p = eagle_store.find(b.target.path) if b.source is None else \
            Path(b.source) if _eagle3_file(str(b.source)) else None
        if p is not None:
            eagle_store.check_for(p, b.target.path)
            return Eagle3Drafter(b.target, p, threads=b.threads)
    return HeadsDrafter.for_target(b.target, b.source)


def _eagle3(b: Build) -> Drafter:
    if b.source is None:
        raise OndeviceError("drafter='eagle3' needs the draft: pass draft=DIR/x.gguf (an eagle3 GGUF from "
                            "`ondevice convert EAGLE_DIR --to gguf --target TARGET --out DIR`)")
    return Eagle3Drafter(b.target, b.source, threads=b.threads)


def _eagle3_file(draft: str) -> bool:
    from ondevice.drafters.eagle3 import is_eagle3_gguf

    return is_eagle3_gguf(draft)


def _dflash(b: Build) -> Drafter:
    if b.source is None:
        raise OndeviceError("drafter='dflash' needs the draft: pass draft=DIR/x.gguf (a dflash GGUF from "
                            "`ondevice convert DFLASH_DIR --to gguf --target TARGET --out DIR`)")
    return DFlashDrafter(b.target, b.source, threads=b.threads)


def _mtp(b: Build) -> Drafter:
    return MtpDrafter(b.target)


def _heads_file(draft: str) -> bool:
    return draft == "heads" or draft.endswith(".heads.safetensors")


register(Kind(traits=ModelDrafter.traits, build=_model,
              help="a smaller model of the same vocabulary (needs a draft)"))
register(Kind(traits=NgramDrafter.traits, build=_ngram, help="prompt lookup: copies of earlier text"))
register(Kind(traits=HeadsDrafter.traits, build=_heads, claims=_heads_file,
              help="the drafter trained for the target (ondevice train-heads): EAGLE-style, else Medusa heads"))
register(Kind(traits=Eagle3Drafter.traits, build=_eagle3, claims=_eagle3_file,
              help="an EAGLE-3 draft (GGUF arch eagle3) on the target's layer inputs (--draft DIR/x.gguf)"))
register(Kind(traits=DFlashDrafter.traits, build=_dflash, claims=is_dflash_gguf,
              help="a DFlash block draft (GGUF arch dflash) on the target's layer inputs (--draft DIR/x.gguf)"))
register(Kind(traits=MtpDrafter.traits, build=_mtp, claims=lambda draft: draft == "mtp",
              help="the model's own MTP (nextn) heads, inside its GGUF (--draft mtp)"))
register(Kind(traits=Traits(name="none"), build=lambda b: None, help="plain decoding"))
