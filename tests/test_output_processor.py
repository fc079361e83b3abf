"""The output processor on real tokenizers: streamed text is always a prefix of, and in the end
equals, the whole output's decode, whatever the chunking; stop strings cut where a
token-at-a-time check would, never leak past the stop, and are found across chunks; the
streamed increments add up to the final output; the work per token does not grow with the
output."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers

from mlc_spec.runtime.logprobs import TokenLogprob
from mlc_spec.runtime.metrics import SpecStats
from mlc_spec.runtime.output_processor import INCOMPLETE, OutputProcessor, SequenceOutput
from mlc_spec.runtime.tokenizer import Tokenizer

TEXT = (
    " Hello, 世界! 😀👍🏽 naïve café — ünïcödé\n\tdef f(x):\n        return x  # 日本語のテキスト"
    " and   three spaces, 🇫🇷 flags, Ελληνικά, العربية.\n"
)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_tokenizer_dir) -> Tokenizer:
    return Tokenizer(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory) -> Tokenizer:
    """Llama-2 style: ``▁`` for spaces, byte-fallback tokens for what the vocabulary lacks,
    and a decoder that strips the first token's leading space."""
    pieces = ["▁", "▁Hello", "▁world", "Hello", "▁世", "界", "!", "▁the", "▁end", "ing", ","]
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += [(p, -1.0 - 0.01 * i) for i, p in enumerate(pieces)]
    tok = RustTokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    out = tmp_path_factory.mktemp("sentencepiece_tok")
    fast.save_pretrained(out)
    return Tokenizer(out)


SHIPPED = ["smollm2_tokenizer", pytest.param("qwen_tokenizer", marks=pytest.mark.qwen)]


def _special_ids(tokenizer: Tokenizer) -> list[int]:
    return [i for i, t in tokenizer._tok.get_added_tokens_decoder().items() if t.special]


def _text_stream(tokenizer: Tokenizer, rng: np.random.Generator) -> list[int]:
    """A piece of ``TEXT`` (leading spaces, emoji, CJK, combining marks) with special tokens
    put in the middle."""
    ids = tokenizer.encode(TEXT * 2)
    start = int(rng.integers(0, len(ids) // 2))
    ids = ids[start : start + int(rng.integers(1, len(ids) // 2))]
    for _ in range(int(rng.integers(0, 3))):
        ids.insert(int(rng.integers(0, len(ids) + 1)), int(rng.choice(_special_ids(tokenizer))))
    return ids


def _random_stream(tokenizer: Tokenizer, rng: np.random.Generator) -> list[int]:
    """Any ids of the vocabulary: byte tokens that cut characters in two or never complete."""
    return [int(t) for t in rng.integers(0, len(tokenizer.vocab), int(rng.integers(1, 80)))]


def _chunks(ids: list[int], rng: np.random.Generator) -> list[list[int]]:
    """``ids`` split as speculation appends them: 1 to 6 tokens at a time."""
    out, i = [], 0
    while i < len(ids):
        out.append(ids[i : i + int(rng.integers(1, 7))])
        i += len(out[-1])
    return out


def _stream(
    processor: OutputProcessor, chunks: list[list[int]], stop: list[str], check
) -> tuple[SequenceOutput, str]:
    """Feed ``chunks`` (the last one finishes the sequence unless a stop string does) and
    return the state and the concatenated increments; ``check(sent, ids so far)`` runs after
    every chunk."""
    state, sent, fed = SequenceOutput(stop), "", []
    for i, chunk in enumerate(chunks):
        stopped = processor.process(state, chunk, finished=i == len(chunks) - 1)
        fed += chunk
        sent += state.completion(0, None, SpecStats(), delta=True).text
        check(sent, fed)
        if stopped:
            break
    return state, sent


def _check_decode_invariant(tokenizer: Tokenizer, ids: list[int], rng, eager: bool) -> None:
    """``eager``: also check that only a half character at the end is held back, so the
    stream is as prompt as decoding everything again (byte-level decoders; a byte-fallback
    decoder turns a whole run of byte tokens into U+FFFD while its last character is cut, so
    there the decode of the ids so far is no guide)."""
    whole = tokenizer.decode(ids)

    def check(sent: str, fed: list[int]) -> None:
        assert whole.startswith(sent)
        if eager and len(fed) < len(ids):
            assert sent == tokenizer.decode(fed).rstrip(INCOMPLETE)

    state, sent = _stream(OutputProcessor(tokenizer), _chunks(ids, rng), [], check)
    assert sent == whole and state.text == whole and state.token_ids == ids


@pytest.mark.parametrize("name", SHIPPED)
def test_streamed_text_is_a_prefix_of_the_whole_decode(name, request):
    tokenizer = request.getfixturevalue(name)
    for seed in range(150):
        rng = np.random.default_rng(seed)
        stream = _text_stream if seed % 2 else _random_stream
        _check_decode_invariant(tokenizer, stream(tokenizer, rng), rng, eager=True)


def test_sentencepiece_leading_space_and_byte_fallback(sentencepiece_tokenizer):
    """The decoder strips the output's first space only, and emoji and CJK arrive as byte
    tokens: decoding each chunk alone would drop every chunk's first space."""
    tokenizer = sentencepiece_tokenizer
    ids = tokenizer.encode("Hello world 😀 世界 the ending, 日本")
    assert [tokenizer._tok.id_to_token(i) for i in ids].count("<0xF0>") == 1  # the emoji's bytes
    for seed in range(100):
        rng = np.random.default_rng(seed)
        with_specials = list(ids)
        for _ in range(seed % 3):
            with_specials.insert(int(rng.integers(0, len(ids))), int(rng.choice([1, 2])))
        _check_decode_invariant(tokenizer, with_specials, rng, eager=False)


def test_half_a_character_is_held_until_complete_and_kept_at_the_end(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    ids = tokenizer.encode(" 😀")
    assert len(ids) > 1 and INCOMPLETE in tokenizer.decode(ids[:-1])
    processor = OutputProcessor(tokenizer)
    state = SequenceOutput()
    processor.process(state, ids[:-1])
    assert state.completion(0, None, SpecStats(), delta=True).text == " "
    processor.process(state, ids[-1:])
    assert state.completion(0, None, SpecStats(), delta=True).text == "😀"
    cut = SequenceOutput()  # max_tokens ends it inside the character: as decode has it
    processor.process(cut, ids[:-1], finished=True)
    assert cut.text == tokenizer.decode(ids[:-1]) and cut.text.endswith(INCOMPLETE)


def _reference_stop(tokenizer: Tokenizer, ids: list[int], stop: list[str]):
    """Stop strings checked one token at a time on the whole decode (what the engine did)."""
    for j in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:j])
        starts = [i for s in stop if (i := text.find(s)) >= 0]
        if starts:
            return text[: min(starts)], ids[:j], True
    return tokenizer.decode(ids), ids, False


def _stops(text: str, rng: np.random.Generator) -> list[str]:
    """One to three stop strings: pieces of ``text`` (1 to 8 characters) and one absent."""
    stops = ["\x00never"]
    clean = text.replace(INCOMPLETE, "")
    for _ in range(int(rng.integers(1, 3))):
        if clean:
            start = int(rng.integers(0, len(clean)))
            stops.append(clean[start : start + int(rng.integers(1, 9))])
    return stops


@pytest.mark.parametrize("name", SHIPPED)
def test_stop_strings_cut_as_one_token_at_a_time(name, request):
    """Whatever the chunking, the text ends where the first stop begins, the tokens after the
    one that completed it are gone, and no increment ever carried text past it."""
    tokenizer = request.getfixturevalue(name)
    processor = OutputProcessor(tokenizer)
    for seed in range(150):
        rng = np.random.default_rng(seed)
        ids = (_text_stream if seed % 2 else _random_stream)(tokenizer, rng)
        stop = _stops(tokenizer.decode(ids), rng)
        text, kept, stopped = _reference_stop(tokenizer, ids, stop)

        def check(sent: str, fed: list[int], text=text, stop=stop) -> None:
            assert text.startswith(sent)
            assert not any(s in sent for s in stop)

        state, sent = _stream(processor, _chunks(ids, rng), stop, check)
        assert (state.text, sent, state.token_ids, state.stopped) == (text, text, kept, stopped)


def test_a_stop_string_spanning_two_chunks_is_held_then_cut(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    processor = OutputProcessor(tokenizer)
    for then, stopped, final in [
        ("/stop> now", True, "Say hi "),
        ("3 you", False, "Say hi <3 you"),
    ]:
        state = SequenceOutput(["</stop>"])
        assert not processor.process(state, tokenizer.encode("Say hi <"))
        # "<" may begin the stop: not streamed until the next tokens settle it.
        assert state.completion(0, None, SpecStats(), delta=True).text == "Say hi "
        assert processor.process(state, tokenizer.encode(then), finished=True) == stopped
        assert state.text == final and state.finished
        if stopped:
            # The tokens after the ">" that completed it are dropped.
            tokens = [tokenizer._tok.id_to_token(i) for i in state.token_ids[-3:]]
            assert tokens == ["/", "stop", ">"]


def test_the_stop_completed_first_wins_over_one_that_begins_earlier(smollm2_tokenizer):
    """With "xabcd" in one chunk, "bc" completes at "c", before "abcd" does at "d": a
    token-at-a-time engine stops at "bc", so a run of speculative tokens must too."""
    tokenizer = smollm2_tokenizer
    ids = [tokenizer.encode(c)[0] for c in "xabcd"]
    state = SequenceOutput(["abcd", "bc"])
    assert OutputProcessor(tokenizer).process(state, ids)
    assert state.text == "xa" and state.token_ids == ids[:4]


def test_increments_add_up_to_the_final_output(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    processor = OutputProcessor(tokenizer)
    ids = tokenizer.encode(TEXT)
    logprobs = [TokenLogprob(t, -0.1 * i, [(t, -0.1 * i)]) for i, t in enumerate(ids)]
    state, stats = SequenceOutput(["return"], with_logprobs=True), SpecStats()
    deltas, i = [], 0
    for chunk in _chunks(ids, np.random.default_rng(0)):
        stopped = processor.process(state, chunk, logprobs[i : i + len(chunk)])
        i += len(chunk)
        deltas.append(state.completion(2, "stop" if stopped else None, stats, delta=True))
        if stopped:
            break
    final = state.completion(2, "stop", stats, delta=False)
    assert final.text == TEXT[: TEXT.index("return")]
    assert final.token_ids == ids[: len(final.token_ids)] and len(final.token_ids) < len(ids)
    assert final.logprobs == logprobs[: len(final.token_ids)]
    assert (final.index, final.finish_reason, final.spec_stats) == (2, "stop", stats)
    assert "".join(d.text for d in deltas) == final.text
    assert sum((d.token_ids for d in deltas), []) == final.token_ids
    assert sum((d.logprobs for d in deltas), []) == final.logprobs
    assert state.completion(2, "stop", stats, delta=True).text == ""  # all of it was sent
    assert SequenceOutput().completion(0, None, stats, delta=False).logprobs is None


def test_misuse_is_refused(smollm2_tokenizer):
    processor = OutputProcessor(smollm2_tokenizer)
    with pytest.raises(ValueError, match="one is needed per token"):
        processor.process(SequenceOutput(with_logprobs=True), [5, 6], [TokenLogprob(5, 0.0, [])])
    with pytest.raises(ValueError, match="no tokens"):
        processor.process(SequenceOutput(), [])
    state = SequenceOutput()
    processor.process(state, [5], finished=True)
    with pytest.raises(ValueError, match="finished"):
        processor.process(state, [6])
    with pytest.raises(ValueError, match="empty"):
        SequenceOutput(["stop", ""])


class _CountingTokenizer:
    """Records how many ids each decode call is given."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.decoded = tokenizer, []

    def decode(self, ids: list[int]) -> str:
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids)


def test_work_per_token_does_not_grow_with_the_output(smollm2_tokenizer):
    """2000 tokens, in chunks of 1 to 6, with and without a stop string: each decode sees a
    window of a few dozen ids at most (it moves on where a chunk ends on a whole character),
    where decoding the whole output again would see up to 2000 ids."""
    ids = (smollm2_tokenizer.encode(TEXT) * 40)[:2000]
    for stop in [], ["\x00x"]:
        counting = _CountingTokenizer(smollm2_tokenizer)
        chunks = _chunks(ids, np.random.default_rng(0))
        state, _ = _stream(OutputProcessor(counting), chunks, stop, lambda *_: None)
        assert len(state.token_ids) == 2000
        assert max(counting.decoded) <= 40
        assert sum(counting.decoded) <= 6 * len(ids)
