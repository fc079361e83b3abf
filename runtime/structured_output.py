"""Structured output: a request's grammar decides which tokens the target may emit next.

xgrammar compiles a request's constraint (``StructuredOutput``: a JSON schema, any JSON object,
a regex, a choice, an EBNF grammar, a structural tag) against the tokenizer's vocabulary, and a
matcher per sequence follows the tokens it accepts. Before a row of logits is sampled or
verified, the matcher's token bitmask sets the disallowed tokens to -inf, in the artifact's
compiled ``apply_token_bitmask`` (the logits themselves stay as the model computed them, for
logprobs).

With speculation, the row of a draft (tree) node is masked with the matcher's state after the
node's path (``traverse_draft_tree``; the matcher itself is left where it was): each verify row
gets the mask decoding would have given it, so greedy output is the constrained plain output
token for token, and sampling draws from the masked target distribution. A node the grammar
rejects gets an empty mask; its parent's row gives it no probability, so it is never accepted
and its own row is never read. The matcher advances only by the tokens a step commits.

xgrammar imports torch: it is loaded on the first constrained request, not before.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlc_spec.errors import UserError

from .params import StructuredOutput

NEEDS_XGRAMMAR = (
    "structured output needs xgrammar: python -m pip install --no-deps xgrammar==0.2.8 (with "
    "torch, as the test extra installs it)"
)


def _xgrammar() -> Any:
    try:
        import xgrammar  # noqa: PLC0415 - pulls in torch: only on the first constrained request
    except ImportError:
        raise UserError(NEEDS_XGRAMMAR) from None
    return xgrammar


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return -(-vocab_size // 32)


class Grammars:
    """The grammar compiler of one model's tokenizer, with xgrammar's cache of compiled
    grammars (one compile per distinct constraint)."""

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, stop_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self._args = (Path(tokenizer_dir), vocab_size, list(stop_token_ids))
        self._lock = threading.Lock()  # the server compiles off the engine thread too
        self._compiler: Any = None

    def _grammar_compiler(self) -> Any:
        from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - heavy; rarely needed

        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                tokenizer_dir, vocab_size, stops = self._args
                tokenizer = PreTrainedTokenizerFast(
                    tokenizer_file=str(tokenizer_dir / "tokenizer.json")
                )
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec`` (cached: the same constraint compiles once); a
        ``UserError`` that says what is wrong with it. Thread-safe."""
        compiler = self._grammar_compiler()
        try:
            if spec.json is not None:
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if spec.json_object:
                return compiler.compile_builtin_json_grammar()
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                alternatives = " | ".join(json.dumps(c) for c in spec.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            if spec.structural_tag is not None:
                tag = spec.structural_tag
                return compiler.compile_structural_tag(
                    tag if isinstance(tag, str) else json.dumps(tag)
                )
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as err:
            kind = next(k for k in _NAMES if getattr(spec, k))
            raise UserError(f"invalid {_NAMES[kind]}: {_first_line(err)}") from None

    def constraint(self, compiled: Any) -> Constraint:
        return Constraint(_xgrammar().GrammarMatcher(compiled), self.vocab_size)


_NAMES = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag (a forced tool_choice's: the tools' parameters)",
}


def _first_line(err: Exception) -> str:
    """xgrammar's message without its source location prefix."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class Constraint:
    """One sequence's matcher: the tokens it has committed, and the masks of what may follow."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size

    def masks(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """The bitmask of each node of a draft tree rooted at the sequence's pending token
        (``tokens[0]``, already accepted; ``parents[0]`` -1): the matcher's state after the
        node's path, or none allowed where the grammar rejects the path.
        ``[len(tokens), words]`` int32."""
        import torch  # noqa: PLC0415 - xgrammar's tensors; loaded with it

        n = len(tokens)
        first_child = np.full(n, -1, np.int64)
        next_sibling = np.full(n, -1, np.int64)
        last_child: dict[int, int] = {}
        for node in range(1, n):
            parent = parents[node]
            if parent in last_child:
                next_sibling[last_child[parent]] = node
            else:
                first_child[parent] = node
            last_child[parent] = node
        bitmask = torch.zeros((n, bitmask_words(self.vocab_size)), dtype=torch.int32)
        self._matcher.traverse_draft_tree(
            torch.from_numpy(first_child),
            torch.from_numpy(next_sibling),
            torch.as_tensor(np.asarray(tokens, np.int64)),
            bitmask,
        )
        return bitmask.numpy()

    def accept(self, token: int) -> bool:
        """Advance by a committed token; False where the grammar rejects it."""
        return bool(self._matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""
        return bool(self._matcher.is_terminated())


def unconstrained(rows: int, vocab_size: int) -> np.ndarray:
    """Bitmask rows that allow every token."""
    return np.full((rows, bitmask_words(vocab_size)), -1, np.int32)
