"""Adaptive speculation: how many drafts each sequence gets per step, from measured step costs
and estimated acceptance."""

from .acceptance import AcceptanceEstimator
from .backoff import Backoff
from .costs import (
    REFERENCE_CONTEXT,
    Attended,
    Attention,
    CostTable,
    DraftCosts,
    RunningMean,
    StepCosts,
    StepShape,
)
from .coverage import Coverage
from .policy import Candidate, Decision, GoodputPolicy, expected_tokens, refreshes_plain

__all__ = [
    "REFERENCE_CONTEXT",
    "Attended",
    "Attention",
    "AcceptanceEstimator",
    "Backoff",
    "Candidate",
    "CostTable",
    "Coverage",
    "Decision",
    "DraftCosts",
    "GoodputPolicy",
    "RunningMean",
    "StepCosts",
    "StepShape",
    "expected_tokens",
    "refreshes_plain",
]
