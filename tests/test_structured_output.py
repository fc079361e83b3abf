"""Structured output (``runtime/structured_output.py``): the compiled token mask, outputs that
follow their JSON schemas, regexes and choices, greedy output identical with speculation on and
off for every proposer, sampling that follows the masked target distribution exactly, and bad
constraints refused with a message that says what is wrong."""

from __future__ import annotations

import dataclasses
import itertools
import json

import jsonschema
import numpy as np
import pytest
import tvm
from compiled_sampling import cpu_sampler
from served import serving
from stats import chi2_rejects

from mlc_spec import LLM, SamplingParams
from mlc_spec.errors import UserError
from mlc_spec.runtime import structured_output
from mlc_spec.runtime.model import Model
from mlc_spec.runtime.params import StructuredOutput
from mlc_spec.runtime.structured_output import Grammars

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINED = [
    ('Copy this person as JSON: {"name": "Bob Lee", "age": 42}. JSON:', {"json": PERSON}),
    ("A product code:", {"regex": "[A-Z]{3}-[0-9]{4}"}),
    ("Is the sky blue? Answer:", {"choice": ["yes", "no", "sometimes"]}),
    ("Some JSON about cats:", {"json_object": True}),
    ("Write an order as JSON:", {"grammar": 'root ::= "{\\"qty\\": " [1-9] [0-9]? "}"'}),
]


def test_token_bitmask_kernel():
    """-inf exactly where a row's bit is clear (bit j % 32 of word j // 32), the logit itself
    elsewhere; a vocabulary that is not a multiple of 32 leaves the last word's high bits."""
    rng = np.random.default_rng(0)
    vocab = 100
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    bits = rng.integers(0, 2, (4, 128)).astype(np.uint8)
    bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    masked = cpu_sampler(vocab).mask(tvm.runtime.tensor(logits), bitmask).numpy()
    np.testing.assert_array_equal(masked, np.where(bits[:, :vocab] == 1, logits, -np.inf))


def _params(constraint: dict, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=0, structured_output=constraint, **kwargs)


def _generate(llm: LLM, rounds: int = 1) -> list[list[int]]:
    """The constrained prompts, all in one batch, ``rounds`` times."""
    prompts = [p for p, _ in CONSTRAINED] * rounds
    params = [_params(c) for _, c in CONSTRAINED] * rounds
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(smollm2_int8) -> list[list[int]]:
    return _generate(LLM(smollm2_int8), rounds=2)


@pytest.mark.slow
def test_constrained_outputs_follow_their_constraints(smollm2_int8, plain):
    llm = LLM(smollm2_int8)
    outs = llm.generate([p for p, _ in CONSTRAINED], [_params(c) for _, c in CONSTRAINED])
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    jsonschema.validate(json.loads(texts[0]), PERSON)
    assert __import__("re").fullmatch("[A-Z]{3}-[0-9]{4}", texts[1])
    assert texts[2] in ("yes", "no", "sometimes")
    assert isinstance(json.loads(texts[3]), dict)
    assert 1 <= json.loads(texts[4])["qty"] <= 99
    assert [o.outputs[0].token_ids for o in outs] == plain[: len(CONSTRAINED)]


def _spec(method: str, k, **extra) -> dict:
    return {"method": method, "num_speculative_tokens": k, **extra}


SPECS = {
    **{f"ngram k={k}": _spec("ngram", k) for k in range(1, 7)},
    **{f"suffix k={k}": _spec("suffix", k) for k in range(1, 7)},
    **{f"draft k={k}": _spec("draft", k) for k in range(1, 7)},
    **{f"{m} auto": _spec(m, "auto") for m in ("ngram", "suffix", "draft")},
    "draft tree": _spec("draft", 3, draft_tree_width=2),
}
# What the default suite runs of SPECS x async; the rest runs with MLC_SPEC_RUN_HEAVY=1.
DEFAULT = {("ngram k=3", False), ("suffix k=2", True), ("draft k=2", False)}
DEFAULT |= {("draft tree", True), ("draft auto", False), ("suffix auto", True)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "async_scheduling"),
    [
        pytest.param(n, a, marks=() if (n, a) in DEFAULT else pytest.mark.heavy)
        for n in SPECS
        for a in (False, True)
    ],
)
def test_constrained_greedy_output_is_identical_with_speculation(
    smollm2_int8, smollm2, plain, name, async_scheduling
):
    """Each verify row is masked with the matcher's state after the drafts before it: the
    constrained plain output, token for token. The batch runs twice, so suffix decoding drafts
    the second round from the first round's outputs (an automatic policy may draft nothing)."""
    spec = SPECS[name]
    llm = LLM(
        smollm2_int8,
        draft_model=smollm2 if spec["method"] == "draft" else None,
        speculative=spec,
        async_scheduling=async_scheduling,
    )
    assert _generate(llm, rounds=2) == plain
    if spec["num_speculative_tokens"] != "auto":
        assert llm.metrics()["num_accepted_tokens"] > 0
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


# Thirty schemas: nested objects, arrays, enums, bounded numbers, anyOf, $ref, const, patterns.
# A greedy 135M model writes digits on and on where nothing bounds them.
INT = {"type": "integer", "minimum": 0, "maximum": 99}
NUMBER = {"type": "number", "minimum": 0, "maximum": 9}
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}}},
    {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"]},
    {"type": "object", "properties": {"v": {"const": "fixed"}}, "required": ["v"]},
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 4},
    {"type": "string", "maxLength": 10},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "boolean"},
    {"enum": [1, 2, 3]},
    {"anyOf": [INT, {"type": "boolean"}]},
    {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/point"}},
        "required": ["p"],
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": INT, "y": INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": INT, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"a": INT, "b": {"type": "string", "maxLength": 5}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {"type": "array", "items": NUMBER, "maxItems": 2},
    {"type": "null"},
    {"type": "object", "properties": {}, "additionalProperties": False},
    {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": INT},
        "required": ["kind", "legs"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 4}},
            "required": ["k"],
            "additionalProperties": False,
        },
        "maxItems": 2,
    },
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
    {"type": "number", "minimum": 0, "maximum": 100},
    {"type": "string", "enum": ["north", "south", "east", "west"]},
    {"anyOf": [{"$ref": "#/$defs/yes"}, INT], "$defs": {"yes": {"const": "y"}}},
    {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
    {"type": "array", "prefixItems": [INT, {"type": "boolean"}], "items": False},
    {
        "type": "object",
        "properties": {"m": {"type": "object", "properties": {"z": {"type": "null"}}}},
        "required": ["m"],
    },
]


@pytest.mark.slow
def test_every_output_validates_against_its_schema(smollm2_int8):
    llm = LLM(smollm2_int8, speculative={"method": "suffix"}, max_batch_size=16)
    prompts = [f"Answer in JSON ({json.dumps(s)[:60]}):" for s in SCHEMAS]
    params = [_params({"json": s}, ignore_eos=False) for s in SCHEMAS]
    params = [dataclasses.replace(p, max_tokens=96) for p in params]
    outs = llm.generate(prompts, params)
    for schema, out in zip(SCHEMAS, outs, strict=True):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_max_tokens_mid_structure_finishes_with_length(smollm2_int8, plain):
    """The text so far comes back as it is, the start of the constrained plain output."""
    llm = LLM(smollm2_int8, speculative={"method": "ngram", "num_speculative_tokens": 3})
    prompt, constraint = CONSTRAINED[0]
    params = dataclasses.replace(_params(constraint), max_tokens=5)
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == plain[0][:5]
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


def test_bad_constraints_are_refused(tiny_llama):
    llm = LLM(tiny_llama.artifact)
    for bad, message in (
        ({"json": {"type": "objectx"}}, "invalid JSON schema"),
        ({"regex": "(unclosed"}, "invalid regex"),
        ({"grammar": "root ::= undefined_rule"}, "invalid grammar"),
    ):
        with pytest.raises(UserError, match=message):
            llm.generate(["w5"], SamplingParams(max_tokens=4, structured_output=bad))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput()
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StructuredOutput(choice=[])
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_output={"regex": "a"}, guided_decoding={"regex": "b"})
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


# ---- sampling ---------------------------------------------------------------------------
COLORS = ["red", "green", "blue", "white"]
COLOR_PROMPT = "Name one color:"
SAMPLES = 1500


def _exact_outcomes(artifact, prompt_ids: list[int]) -> dict[tuple[int, ...], float]:
    """Every token sequence the choice grammar allows after the prompt (up to its stop token),
    with its probability under the target's masked, renormalised rows at temperature 1."""
    model = Model(artifact)
    eos = sorted(model.config.get("eos_token_ids") or [])
    grammars = Grammars(artifact, model.vocab_size, eos)
    compiled = grammars.compile(StructuredOutput(choice=COLORS))
    kv = model.create_kv_cache(1, 4096, 512)
    outcomes, frontier = {}, [((), 1.0)]
    while frontier:
        prefix, p = frontier.pop()
        constraint = grammars.constraint(compiled)
        for token in prefix:
            assert constraint.accept(token)
        kv.add_sequence(0)
        logits = model.prefill(kv, [0], [prompt_ids + list(prefix)]).numpy()[0]
        kv.remove_sequence(0)
        mask = constraint.masks([0], [-1])[0]
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: model.vocab_size] == 1
        z = np.where(allowed, logits.astype(np.float64), -np.inf)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        for token in np.flatnonzero(probs > 1e-9):
            if token in eos:
                outcomes[prefix] = outcomes.get(prefix, 0.0) + p * probs[token]
            else:
                frontier.append(((*prefix, int(token)), p * probs[token]))
    return outcomes


def _sample_outcomes(llm: LLM, prompt_ids: list[int]) -> list[tuple[int, ...]]:
    per_request = 50
    params = [
        SamplingParams(
            max_tokens=8,
            temperature=1.0,
            n=per_request,
            seed=seed,
            structured_output={"choice": COLORS},
        )
        for seed in range(SAMPLES // per_request)
    ]
    eos = set(llm.engine.eos_ids)
    outs = llm.generate([prompt_ids] * len(params), params)
    return [tuple(t for t in s.token_ids if t not in eos) for o in outs for s in o.outputs]


@pytest.fixture(scope="module")
def exact(smollm2_int8) -> tuple[list[int], dict]:
    ids = LLM(smollm2_int8).tokenizer.encode(COLOR_PROMPT)
    return ids, _exact_outcomes(smollm2_int8, ids)


def _rejects(samples: list[tuple[int, ...]], outcomes: dict) -> bool:
    keys = list(outcomes)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys) + 1, np.int64)  # the last cell: outcomes the law gives ~0
    for s in samples:
        counts[index.get(s, len(keys))] += 1
    probs = np.append([outcomes[k] for k in keys], 0.0)
    return chi2_rejects(counts, probs / probs.sum())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "suffix"])
def test_constrained_sampling_follows_the_masked_target_distribution(
    smollm2_int8, smollm2_first_layers, exact, method
):
    """The draft model's drafts are sampled from its own unmasked distribution and verified
    against the masked target rows (rejection sampling is exact for any draft distribution);
    suffix drafts are earlier samples' outputs. Either way the outcomes follow the target's
    masked law, and speculation both accepted and rejected. The draft is the target's first 12
    layers: the whole model with float activations drafts so close to its int8 twin that on
    some CPUs (Zen 5) every draft was accepted and the rejection path went untested."""
    ids, outcomes = exact
    llm = LLM(
        smollm2_int8,
        draft_model=smollm2_first_layers if method == "draft" else None,
        speculative={"method": method, "num_speculative_tokens": 2},
        max_batch_size=64,
    )
    assert not _rejects(_sample_outcomes(llm, ids), outcomes)
    stats = llm.metrics()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats


@pytest.mark.slow
def test_a_mask_that_ignores_the_drafts_is_caught(smollm2_int8, smollm2, exact, monkeypatch):
    """A broken rule: every verify row gets the mask of the sequence's committed state, as if
    the matcher had not followed the drafts. The target then draws from the wrong rows'
    constraints: outputs either break the grammar (refused at commit) or miss the law."""
    ids, outcomes = exact
    masks = structured_output.Constraint.masks

    def root_only(self, tokens, parents):
        rows = masks(self, tokens[:1], parents[:1])
        return np.repeat(rows, len(tokens), axis=0)

    monkeypatch.setattr(structured_output.Constraint, "masks", root_only)
    llm = LLM(
        smollm2_int8,
        draft_model=smollm2,
        speculative={"method": "draft", "num_speculative_tokens": 2},
        max_batch_size=64,
    )
    try:
        samples = _sample_outcomes(llm, ids)
    except RuntimeError as err:
        assert "against its request's grammar" in str(err)
    else:
        assert _rejects(samples, outcomes)


@pytest.mark.slow
def test_outcomes_of_a_choice_sum_to_one_and_spell_the_choices(smollm2_int8, exact):
    """The reference law itself: every outcome decodes to one of the choices."""
    ids, outcomes = exact
    tokenizer = LLM(smollm2_int8).tokenizer
    assert abs(sum(outcomes.values()) - 1) < 1e-6
    assert {tokenizer.decode(list(k)) for k in outcomes} <= set(COLORS)
    assert len(set(itertools.chain.from_iterable(outcomes))) > 1


# ---- the server, through the openai client ------------------------------------------------
@pytest.mark.slow
def test_the_openai_client_gets_structured_output(smollm2_int8):
    """``response_format`` with a JSON schema, streamed and not, and vLLM's ``guided_choice``,
    through ``mlc-spec serve``'s app with suffix decoding on: the same text as the Python API."""
    llm = LLM(smollm2_int8, speculative={"method": "suffix"}, async_scheduling=True)
    expected = (
        LLM(smollm2_int8).generate(CONSTRAINED[0][0], _params({"json": PERSON}))[0].outputs[0].text
    )
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    with serving(llm) as served:
        client = served.client()
        out = client.completions.create(
            model="tiny",
            prompt=CONSTRAINED[0][0],
            max_tokens=48,
            temperature=0,
            extra_body={"response_format": response_format},
        )
        assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
        chat = dict(model="tiny", messages=[{"role": "user", "content": "A person?"}])
        reply = client.chat.completions.create(
            **chat, max_tokens=48, temperature=0, response_format=response_format
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
        stream = client.chat.completions.create(
            **chat, max_tokens=48, temperature=0, response_format=response_format, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == reply.choices[0].message.content
        choice = client.chat.completions.create(
            **chat, max_tokens=8, temperature=0.8, extra_body={"guided_choice": COLORS}
        )
        assert choice.choices[0].message.content in COLORS
    assert llm.engine.kv.available_pages() == llm.engine.capacity_pages


@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 2])
def test_draft_model_drafts_follow_the_grammar(smollm2_int8, smollm2, width):
    """The draft's rows are masked too: every drafted path (chain or tree) is grammatical."""
    llm = LLM(
        smollm2_int8,
        draft_model=smollm2,
        speculative={"method": "draft", "num_speculative_tokens": 4, "draft_tree_width": width},
    )
    engine = llm.engine
    prompt = llm.tokenizer.encode("Name six colors:")
    colors = "(red|blue|green|black)"
    request = engine.add_request(prompt, _params({"regex": f"{colors}(, {colors}){{5}}"}))
    while not request.sequences[0].num_output:
        engine.step()
    seq = request.sequences[0]
    proposal = engine.proposer.propose([seq], [4])
    drafts = proposal.tokens[0]
    chain = np.arange(len(drafts))
    parents = chain if proposal.parents is None else proposal.parents[0]
    masks = seq.constraint.masks([seq.tokens[-1], *drafts], np.concatenate([[-1], parents]))
    assert len(drafts) >= 4 and masks.any(axis=1).all()
    engine.proposer.on_verified([seq], [len(drafts)], [[]])
    engine.abort(request.request_id)
