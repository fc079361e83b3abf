"""Draft sources behind one interface: a draft model, or prompt lookup (n-gram)."""

from .base import Proposal, Proposer
from .build import build_proposer
from .draft_model import DraftModelProposer
from .ngram import NgramProposer

__all__ = ["DraftModelProposer", "NgramProposer", "Proposal", "Proposer", "build_proposer"]
