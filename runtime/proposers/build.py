"""Building the proposer a speculative config asks for: the one place that knows which
configuration needs which draft source."""

from __future__ import annotations

from pathlib import Path

from mlc_spec.errors import UserError

from ..kv_cache import NO_TREES
from ..model import Model
from ..params import EngineConfig, SpeculativeConfig
from ..tokenizer import Tokenizer
from .auto import AutoProposer
from .base import Proposer
from .draft_model import DraftModelProposer, DraftTreeProposer
from .ngram import NgramProposer
from .suffix import SuffixProposer


def build_proposer(
    spec: SpeculativeConfig | None,
    draft_model: str | Path | None,
    target: Model,
    tokenizer: Tokenizer,
    config: EngineConfig,
) -> Proposer | None:
    """The proposer for ``spec`` (none without speculation); a draft model is loaded and
    checked against the target's vocabulary."""
    if spec is None:
        return None
    if (spec.method == "draft" and draft_model is None) or (
        spec.method not in ("draft", "auto") and draft_model is not None
    ):
        raise UserError(
            "speculative method 'draft' needs draft_model, and only it and 'auto' use one"
        )
    if spec.draft_tree_width > 1 and draft_model is None:
        raise UserError("draft trees (draft_tree_width > 1) need draft_model")
    if spec.draft_tree_width > 1 and not target.verifies_trees:
        raise UserError(NO_TREES)  # here, not at the first tree a running request would draft
    methods = spec.methods(draft_model is not None)
    proposers: dict[str, Proposer] = {}
    for m in methods:  # ``draft`` comes before ``draft_tree``, the view of its trees
        proposers[m] = (
            DraftTreeProposer(proposers["draft"], spec.draft_tree_width)
            if m == "draft_tree"
            else _proposer(m, spec, draft_model, target, tokenizer, config)
        )
    return (
        AutoProposer(proposers)
        if len(methods) > 1 or spec.method == "auto"
        else proposers[spec.method]
    )


def _proposer(
    method: str,
    spec: SpeculativeConfig,
    draft_model: str | Path | None,
    target: Model,
    tokenizer: Tokenizer,
    config: EngineConfig,
) -> Proposer:
    if method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if method == "suffix":
        return SuffixProposer(
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob,
            int(spec.suffix_decoding_cache_mb * 2**20),
        )
    draft = Model(draft_model)
    _check_same_vocabulary(draft, Tokenizer(draft_model), target, tokenizer)
    return DraftModelProposer(
        draft,
        config.max_batch_size,
        config.max_total_len,
        config.prefill_chunk_size,
        config.enable_prefix_caching,
        1 if spec.auto else spec.draft_tree_width,  # with automatic k: chains, trees beside
    )


def _check_same_vocabulary(
    draft: Model, draft_tokenizer: Tokenizer, target: Model, tokenizer: Tokenizer
) -> None:
    """Rejection sampling compares distributions over one vocabulary, token for token."""
    if draft.vocab_size != target.vocab_size:
        raise UserError(
            f"draft model vocabulary ({draft.vocab_size}) differs from the target's "
            f"({target.vocab_size})"
        )
    if draft_tokenizer.vocab != tokenizer.vocab:
        raise UserError("draft model tokenizer differs from the target's tokenizer")
