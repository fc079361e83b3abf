"""Draft sources behind one interface: a draft model, prompt lookup (n-gram), or suffix trees
over the request and earlier outputs."""

from .base import Proposal, Proposer
from .build import build_proposer
from .draft_model import DraftModelProposer
from .ngram import NgramProposer
from .suffix import SuffixProposer

__all__ = [
    "DraftModelProposer",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "SuffixProposer",
    "build_proposer",
]
