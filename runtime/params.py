"""What a user asks for: sampling parameters per request, the speculation config, engine limits.

Names and defaults follow vLLM's ``SamplingParams`` and ``speculative_config`` so that code
written for vLLM reads the same here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from mlc_spec.errors import UserError

from .artifact import MAX_TREE_WIDTH


class ParamsError(UserError, ValueError):
    """Sampling or speculation parameters outside their valid range."""


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate, as vLLM's ``StructuredOutputsParams``:
    exactly one of a JSON schema (``json``, a dict or its text), any JSON object
    (``json_object``), a regular expression, one of several strings (``choice``), an EBNF
    grammar (GBNF, ``grammar``), or an xgrammar structural tag (``structural_tag``, a dict or
    its text: what forced tool calls compile to). Compiled by xgrammar
    (``runtime/structured_output.py``)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) for c in self.choice):
                raise ParamsError("choice must be a non-empty list of strings")
        kinds = [self.json is not None, self.json_object, self.regex is not None]
        kinds += [self.choice is not None, self.grammar is not None]
        kinds += [self.structural_tag is not None]
        if sum(kinds) != 1:
            raise ParamsError(
                "structured output takes exactly one of json, json_object, regex, choice, "
                f"grammar and structural_tag, got {sum(kinds)}"
            )

    @classmethod
    def parse(cls, value: StructuredOutput | dict[str, Any] | None) -> StructuredOutput | None:
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ParamsError(f"structured_output must be a dict, got {type(value).__name__}")
        try:
            return cls(**value)
        except TypeError as err:
            raise ParamsError(f"bad structured_output {value!r}: {err}") from None


@dataclasses.dataclass
class SamplingParams:
    """Per-request decoding parameters. ``temperature=0`` is greedy decoding."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    # Log-probability of each sampled token and of the ``logprobs`` most likely tokens at its
    # position (0: the sampled token's only; None: none), from the target's raw logits.
    logprobs: int | None = None
    # Draft tokens per step for this request: None = the engine's setting (automatic by
    # default), 0 = no speculation, k = exactly k (capped by the engine's maximum).
    num_speculative_tokens: int | None = None
    # The proposer for this request, among the engine's (``auto`` has draft and suffix): None
    # = the engine's choice per step.
    speculative_method: str | None = None
    # Constrain the output to a JSON schema, a regex, a choice or a grammar (``StructuredOutput``
    # or its dict form; ``guided_decoding`` is vLLM's older name for it).
    structured_output: StructuredOutput | dict[str, Any] | None = None
    guided_decoding: dataclasses.InitVar[StructuredOutput | dict[str, Any] | None] = None

    def __post_init__(self, guided_decoding=None) -> None:
        if guided_decoding is not None:
            if self.structured_output is not None:
                raise ParamsError("give structured_output or guided_decoding, not both")
            self.structured_output = guided_decoding
        self.structured_output = StructuredOutput.parse(self.structured_output)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens < 1:
            raise ParamsError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ParamsError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ParamsError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.n < 1:
            raise ParamsError(f"n must be at least 1, got {self.n}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ParamsError(f"seed must be a 64-bit integer, got {self.seed}")
        if any(not s for s in self.stop):
            raise ParamsError("stop strings must not be empty")
        if self.logprobs is not None and self.logprobs < 0:
            raise ParamsError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ParamsError(
                f"num_speculative_tokens must be >= 0 (0: off), got {self.num_speculative_tokens}"
            )
        if self.speculative_method not in (None, *PROPOSERS):
            raise ParamsError(
                f"unknown speculative_method {self.speculative_method!r} ({', '.join(PROPOSERS)})"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Beyond 6 drafts the expected gain is small even at 80% acceptance (0.8^7 = 0.21 of a token for
# the 7th) while every draft adds a row to the verify pass, whose cost steps up with the CPU
# matmul's row tiles (``M_TILES`` in compiler/cpu_matmul.py, ``IntegerDot.max_rows`` in
# compiler/int8_matmul.py).
DEFAULT_MAX_SPECULATIVE_TOKENS = 6
# Suffix decoding (and method auto, which has it) drafts on only while a suffix tree's branch
# frequencies hold (``suffix_decoding_min_token_prob``) and the match is long enough, so its runs
# are long where a reply copies text, and there acceptance is near 1: the 8th-12th drafts are
# worth their rows (docs/benchmarks-features.md). vLLM lets it draft up to its tree depth.
SUFFIX_MAX_SPECULATIVE_TOKENS = 12


# The proposers a config names (``auto``: suffix and, with a draft model, draft) ...
METHODS = ("draft", "ngram", "suffix")
# ... and those an engine can have: the draft model's trees too, with a tree width and automatic
# k (``SpeculativeConfig.methods``).
PROPOSERS = (*METHODS, "draft_tree")


@dataclasses.dataclass
class SpeculativeConfig:
    """How drafts are proposed: ``draft`` (a small model, ``LLM(draft_model=...)``), ``ngram``
    (prompt lookup), ``suffix`` (suffix trees over the request and earlier requests' outputs,
    with vLLM's ``suffix_decoding_*`` settings), or ``auto``: suffix decoding and the draft
    model where there is one, the policy choosing per sequence and step (prompt lookup is left
    out: a request's own suffix tree holds its prompt). ``num_speculative_tokens`` is what
    requests that do not set their own get: ``"auto"`` (chosen per request and step from
    measured goodput) or a fixed k (0: off unless a request asks). ``max_speculative_tokens``
    caps every request's k (by default 6, 12 with suffix decoding, lowered where a verify pass
    of every sequence's drafts would not fit a prefill chunk: ``max_drafts``).
    ``draft_tree_width`` > 1 makes the draft model grow a tree of
    depth k instead of a chain: each depth keeps the ``width`` most probable continuations
    (EAGLE-2's dynamic tree), so a step verifies up to ``k x width`` drafts in one pass
    (``runtime/draft_tree.py``). With a fixed k every step grows a tree; with automatic k the
    policy chooses per sequence and step between the draft model's chain and its tree
    (method ``draft_tree``), and the depth of either, by the goodput each predicts."""

    method: Literal["draft", "ngram", "suffix", "auto"]
    num_speculative_tokens: int | Literal["auto"] = "auto"
    max_speculative_tokens: int | None = None  # None: ``max_drafts`` chooses
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # Longest string a suffix tree holds: a match of m tokens drafts at most depth - m. A tree
    # takes up to ~60 bytes x depth per token it indexes (less where text repeats).
    suffix_decoding_max_tree_depth: int = 32
    # Drafts at most this many times the matched suffix's length ...
    suffix_decoding_max_spec_factor: float = 1.0
    # ... and while the draft's estimated chance (the product of branch frequencies) holds.
    suffix_decoding_min_token_prob: float = 0.1
    # Memory for earlier requests' outputs; least recently used ones are evicted past it.
    suffix_decoding_cache_mb: float = 256.0
    draft_tree_width: int = 1

    def __post_init__(self) -> None:
        if self.method not in (*METHODS, "auto"):
            raise ParamsError(
                f"unknown speculative method {self.method!r} (draft, ngram, suffix or auto)"
            )
        k = self.num_speculative_tokens
        if k != "auto" and not (isinstance(k, int) and k >= 0):
            raise ParamsError(f"num_speculative_tokens must be 'auto' or an int >= 0, got {k!r}")
        most = self.max_speculative_tokens
        if most is not None and most < 1:
            raise ParamsError(f"max_speculative_tokens must be at least 1, got {most}")
        if most is not None and not self.auto and k > most:
            raise ParamsError(f"num_speculative_tokens {k} exceeds max_speculative_tokens {most}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ParamsError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if not 2 <= self.suffix_decoding_max_tree_depth <= 1024:
            raise ParamsError("suffix_decoding_max_tree_depth must be in [2, 1024]")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ParamsError("suffix_decoding_max_spec_factor must be above 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ParamsError("suffix_decoding_min_token_prob must be in [0, 1]")
        if not self.suffix_decoding_cache_mb >= 0:
            raise ParamsError("suffix_decoding_cache_mb must be >= 0 (0: no shared cache)")
        if not (isinstance(self.draft_tree_width, int) and self.draft_tree_width >= 1):
            raise ParamsError(f"draft_tree_width must be an int >= 1, got {self.draft_tree_width}")
        if self.draft_tree_width > MAX_TREE_WIDTH:
            raise ParamsError(
                f"draft_tree_width {self.draft_tree_width} exceeds the artifacts' "
                f"{MAX_TREE_WIDTH} candidates per node"
            )
        if self.draft_tree_width > 1 and not (
            self.method == "draft" or (self.method == "auto" and self.auto)
        ):
            raise ParamsError(
                "draft trees (draft_tree_width > 1) need a draft model: method 'draft', or "
                "'auto' with automatic num_speculative_tokens"
            )

    @property
    def auto(self) -> bool:
        """k is chosen by the policy (``num_speculative_tokens`` auto)."""
        return self.num_speculative_tokens == "auto"

    def methods(self, has_draft_model: bool) -> tuple[str, ...]:
        """The proposers an engine with this config has: with a tree width and automatic k,
        the draft model's trees beside its chains."""
        trees = ("draft_tree",) if self.draft_tree_width > 1 and self.auto else ()
        if self.method == "draft":
            return ("draft", *trees)
        if self.method != "auto":
            return (self.method,)
        return ("draft", *trees, "suffix") if has_draft_model else ("suffix",)

    def max_drafts(self, per_sequence: int) -> int:
        """The cap on every request's k: ``max_speculative_tokens`` where given, else the
        method's default (at least a fixed k), lowered so that a step's drafts of a sequence
        (``nodes``) stay within ``per_sequence``, what a verify pass of a full batch holds
        beside each sequence's own token."""
        if self.max_speculative_tokens is not None:
            return self.max_speculative_tokens
        suffix = "suffix" in self.methods(has_draft_model=True)
        default = SUFFIX_MAX_SPECULATIVE_TOKENS if suffix else DEFAULT_MAX_SPECULATIVE_TOKENS
        fits = per_sequence // self.draft_tree_width
        return max(min(default, fits), 0 if self.auto else self.num_speculative_tokens, 1)

    def nodes(self, k: int) -> int:
        """The most drafts a step of depth ``k`` verifies (a chain's k, a tree's k x width)."""
        return k * self.draft_tree_width

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | None, has_draft_model: bool = False
    ) -> SpeculativeConfig | None:
        """The config from its dict form; a draft model given without one drafts with it."""
        if value is None:
            return cls(method="draft") if has_draft_model else None
        if isinstance(value, cls):
            return value
        try:
            return cls(**value)
        except TypeError as err:
            raise ParamsError(f"bad speculative config {value!r}: {err}") from None


@dataclasses.dataclass
class EngineConfig:
    max_batch_size: int = 8  # sequences decoded together
    max_total_len: int = 8192  # tokens the KV cache holds, all sequences together
    prefill_chunk_size: int = 512  # tokens per prefill forward pass
    # Tokens one step may take while sequences decode (vLLM's max_num_batched_tokens): a token
    # per decoding sequence, the rest for the next chunk of a waiting prompt (at least a page).
    # Without decoding sequences a prompt's chunk is prefill_chunk_size. On 2 cores a prompt
    # token costs SmolLM2 ~1 ms at 2,000 tokens of context: with 64, 8 streams' p99 gap is ~8x
    # a step while a 2,000-token prompt is prefilled (512: ~45x; 16: ~2.6x, the prompt's first
    # token ~1.6x later than with 512; docs/benchmarks.md).
    max_num_batched_tokens: int = 64
    # ... and in time, for prompts longer than a prefill pass: a chunk that adds at most this
    # multiple of the decoding rows' plain step per waiting prompt, as measured in this process
    # (runtime/chunk_sizer.py), so their steps take about (1 + this) times as long while a long
    # prompt is prefilled, whatever its context; at least a token, so prompts still advance.
    # None: tokens only. Lower keeps the streams smoother and makes the prompt wait longer for
    # its first token. 0.75 kept the p99 time per output token of 8 SmolLM2 int8 streams beside
    # a 2,000-token prompt under 2x their median alone, on 2 cores of a Xeon and of Zen 5 (1 did
    # not on Zen 5; docs/benchmarks-features.md and its git log).
    chunk_time_ratio: float | None = 0.75
    # Keep ended sequences' K/V pages and start new prompts from the longest cached prefix
    # (CPU artifacts; outputs are the same either way, docs/exactness.md).
    enable_prefix_caching: bool = True
    # Run each step's forward on a worker thread while the host processes the last step's
    # tokens (text, stop strings, streaming); outputs are the same either way.
    async_scheduling: bool = False
