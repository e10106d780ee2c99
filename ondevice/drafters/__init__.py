"""Drafters: what guesses the next tokens. ``base`` holds the contract (``Drafter``, ``Traits``, ``Ask``,
``Proposal``), ``registry`` the kinds by name, and one module per kind: ``ngram`` (prompt lookup), ``model``
(a draft model), ``heads`` (heads on the target's hidden states); mtp, eagle3 and dflash go beside them."""

from ondevice.drafters.base import Ask, Drafter, Guess, Proposal, Traits, common_prefix
from ondevice.drafters.model import ModelDrafter
from ondevice.drafters.ngram import NgramDrafter, TreeNgram, ngram_paths

__all__ = ["Ask", "Drafter", "Guess", "Proposal", "Traits", "common_prefix", "ModelDrafter", "NgramDrafter",
           "TreeNgram", "ngram_paths"]
