"""Lossless by construction: on the CPU a token's logits and the K/V it writes are bit for bit the
same however they are computed: decoded alone or in a batch, at any offset of a verify block of
1..16 tokens beside other sequences' blocks of other lengths, inside a prompt's prefill (in one
pass or in chunks), or recomputed after a rollback. Every comparison is ``np.array_equal``: the
speculative loop's greedy output equals plain decoding because these rows are equal, not
because their argmax happens to agree.

Tiny random Llama and Qwen2 models with float, 4-bit and 8-bit weights and int8 activations
(every GGUF tensor type among them), and SmolLM2 as shipped, with float and int8 activations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlc_spec.runtime.model import PAGE_SIZE as PAGE
from mlc_spec.runtime.model import Model

TINY = [
    "tiny_llama",
    "tiny_qwen2",
    "tiny_llama_q4",
    "tiny_qwen2_q8",
    "tiny_llama_q4_int8",
    "tiny_gguf_int8",
]
BLOCKS = list(range(1, 17))  # verify blocks of every length the engine drafts, in this order


@pytest.fixture(params=TINY)
def artifact(request) -> Path:
    fixture = request.getfixturevalue(request.param)
    return fixture if isinstance(fixture, Path) else fixture.artifact


class _Run:
    """One model and one KV cache, and the K/V a sequence holds."""

    def __init__(self, artifact: Path):
        self.model = Model(artifact)
        self.kv = self.model.create_kv_cache(8, 4096, 512)
        self.next_id = 0

    def new(self, prompt=None) -> int:
        seq = self.next_id
        self.next_id += 1
        self.kv.add_sequence(seq)
        if prompt is not None:
            self.model.prefill(self.kv, [seq], [prompt])
        return seq

    def keys_and_values(self, seq: int) -> np.ndarray:
        """[layers, tokens, 2, kv heads, head size] of ``seq``, gathered from its pages (keys
        feature-major, values slot-major: ``compiler/cpu_attention.page_layout``)."""
        table = self.kv._seqs[seq]
        pages = np.from_dlpack(self.kv.pages)[:, table.pages]  # [L, n, 2, h, PAGE * d]
        layers, n, _, heads, size = pages.shape
        d = size // PAGE
        keys = pages[:, :, 0].reshape(layers, n, heads, d, PAGE).transpose(0, 1, 4, 2, 3)
        values = pages[:, :, 1].reshape(layers, n, heads, PAGE, d).transpose(0, 1, 3, 2, 4)
        tokens = np.stack([keys, values], axis=3).reshape(layers, n * PAGE, 2, heads, d)
        return tokens[:, : table.length].copy()


def _decoded(run: _Run, prompt, tokens) -> tuple[np.ndarray, int]:
    seq = run.new(prompt)
    rows = [run.model.decode(run.kv, [seq], [int(t)]).numpy()[0] for t in tokens]
    return np.stack(rows), seq


def _lengths_cover(total: int, lengths) -> list[int]:
    out, at = [], 0
    for n in lengths:
        n = min(n, total - at)
        if n <= 0:
            break
        out.append(n)
        at += n
    return out


def _check_all_ways(run: _Run, prompt, tokens, vocab: int) -> None:
    decoded, decoded_seq = _decoded(run, prompt, tokens)
    kv = run.keys_and_values(decoded_seq)
    rng = np.random.default_rng(7)

    # Verify blocks of 1..16 tokens, one sequence alone.
    seq = run.new(prompt)
    blocks = _lengths_cover(len(tokens), BLOCKS)
    starts = np.cumsum([0, *blocks])
    rows = [
        run.model.evaluate_multi_query(run.kv, [seq], [tokens[a:b]]).numpy()
        for a, b in zip(starts[:-1], starts[1:], strict=True)
    ]
    np.testing.assert_array_equal(np.concatenate(rows), decoded)
    np.testing.assert_array_equal(run.keys_and_values(seq), kv)

    # The same blocks in another order of lengths, beside two other sequences whose blocks
    # (and whether they are in the step at all) vary.
    seq, left, right = run.new(prompt), run.new(prompt[:3]), run.new(prompt[::-1])
    blocks = _lengths_cover(len(tokens), BLOCKS[::-1] * 2)
    starts = np.cumsum([0, *blocks])
    rows = []
    for i, (a, b) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        ids, feeds = [seq], [tokens[a:b]]
        if i % 2:
            ids, feeds = [left, *ids], [rng.integers(0, vocab, 1 + i % 4), *feeds]
        if i % 3:
            ids, feeds = [*ids, right], [*feeds, rng.integers(0, vocab, 16 - i % 7)]
        out = run.model.evaluate_multi_query(run.kv, ids, feeds).numpy()
        first = len(feeds[0]) if ids[0] == left else 0
        rows.append(out[first : first + b - a])
    np.testing.assert_array_equal(np.concatenate(rows), decoded)

    # Verified with a prompt's chunks riding in the passes (a verify step that carries a
    # prefill chunk): the verified rows, the row of each chunk's last token (a chunk that ends
    # a prompt samples its first token there), and the prompt's K/V as decoding writes it.
    seq, rider = run.new(prompt), run.new()
    blocks = _lengths_cover(len(tokens), [5, 11, 16, 8] * 4)
    starts = np.cumsum([0, *blocks])
    fed = np.concatenate([prompt, tokens])
    ends = np.cumsum([len(c) for c in np.array_split(fed, len(blocks))])
    rows, last_rows = [], []
    for a, b, c0, c1 in zip(starts[:-1], starts[1:], [0, *ends[:-1]], ends, strict=True):
        scored = [*range(b - a), b - a + c1 - c0 - 1]
        out = run.model.evaluate_multi_query(
            run.kv, [seq, rider], [tokens[a:b], fed[c0:c1]], scored=scored
        ).numpy()
        rows.append(out[:-1])
        last_rows.append(out[-1])
    np.testing.assert_array_equal(np.concatenate(rows), decoded)
    past_prompt = ends - 1 - len(prompt)
    assert (past_prompt >= 0).sum() >= 2
    np.testing.assert_array_equal(
        np.stack(last_rows)[past_prompt >= 0], decoded[past_prompt[past_prompt >= 0]]
    )
    np.testing.assert_array_equal(run.keys_and_values(rider), kv)

    # Decoded in a batch of other sequences.
    seq = run.new(prompt)
    rows = [run.model.decode(run.kv, [left, seq, right], [1, int(t), 2]).numpy()[1] for t in tokens]
    np.testing.assert_array_equal(np.stack(rows), decoded)

    # Prefill of the prompt and the tokens at once and in chunks: the prompt's last row and
    # every token's row.
    whole = np.concatenate([prompt, tokens])
    seq = run.new()
    at_once = run.model.evaluate_multi_query(run.kv, [seq], [whole]).numpy()
    np.testing.assert_array_equal(at_once[len(prompt) :], decoded)
    np.testing.assert_array_equal(run.keys_and_values(seq), kv)
    seq = run.new()
    chunked = run.model.prefill_chunked(run.kv, [seq], [whole], chunk_size=37).numpy()
    np.testing.assert_array_equal(chunked[0], decoded[-1])

    # Rolled back and verified again: what was popped leaves no trace.
    seq = run.new(prompt)
    run.model.evaluate_multi_query(run.kv, [seq], [tokens[:9]])
    run.kv.popn(seq, 6)
    again = run.model.evaluate_multi_query(run.kv, [seq], [tokens[3:]]).numpy()
    np.testing.assert_array_equal(again, decoded[3:])
    np.testing.assert_array_equal(run.keys_and_values(seq), kv)


# A draft tree after the pending token (node 0): three children at the root, paths of depth up
# to 4, sibling branches that cross a page boundary after a 21-token prompt.
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 6, 7, 8]


def _paths() -> list[list[int]]:
    paths = []
    for node, parent in enumerate(PARENTS):
        paths.append([node] if parent < 0 else [*paths[parent], node])
    return paths


def _check_tree(run: _Run, prompt, vocab: int) -> None:
    """Each tree node's row equals the decode row of its path, whether the tree is verified in
    one pass (the target) or grown a depth per pass (the draft); keeping a path leaves the K/V
    of decoding it, and decoding on from there gives the same rows."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(3, vocab, len(PARENTS))
    paths = _paths()
    decoded, kv = [], []
    for path in paths:
        rows, seq = _decoded(run, prompt, tokens[path])
        decoded.append(rows[-1])
        kv.append(run.keys_and_values(seq))
        run.kv.remove_sequence(seq)

    seq = run.new(prompt)
    base = len(prompt)
    tree = run.model.evaluate_multi_query(run.kv, [seq], [tokens], [(base, np.array(PARENTS))])
    np.testing.assert_array_equal(tree.numpy(), np.stack(decoded))
    rider = run.new()  # with a prompt chunk riding in the pass, without logits
    ridden = run.new(prompt)
    tree = run.model.evaluate_multi_query(
        run.kv,
        [ridden, rider],
        [tokens, prompt],
        [(base, np.array(PARENTS)), None],
        scored=range(len(tokens)),
    )
    np.testing.assert_array_equal(tree.numpy(), np.stack(decoded))
    np.testing.assert_array_equal(run.keys_and_values(rider), run.keys_and_values(run.new(prompt)))

    grown = run.new(prompt)  # the root alone, then one depth per pass
    depth = np.array([len(p) - 1 for p in paths])
    rows = []
    for d in range(depth.max() + 1):
        nodes = np.flatnonzero(depth == d)
        parents = (base, np.array(PARENTS[: nodes[-1] + 1]))
        rows.append(run.model.evaluate_multi_query(run.kv, [grown], [tokens[nodes]], [parents]))
    np.testing.assert_array_equal(np.concatenate([r.numpy() for r in rows]), np.stack(decoded))

    for check in (seq, grown):
        leaf = 10
        run.kv.keep(check, base, paths[leaf])
        np.testing.assert_array_equal(run.keys_and_values(check), kv[leaf])
    after = rng.integers(3, vocab, 3)
    rows, plain = _decoded(run, prompt, np.concatenate([tokens[paths[10]], after]))
    for check in (seq, grown):
        more = [run.model.decode(run.kv, [check], [int(t)]).numpy()[0] for t in after]
        np.testing.assert_array_equal(np.stack(more), rows[-len(after) :])


def test_every_row_is_bit_identical_however_it_is_computed(artifact):
    run = _Run(artifact)
    vocab = run.model.vocab_size
    rng = np.random.default_rng(0)
    # A prompt ending mid-page, 40 tokens crossing three page boundaries.
    _check_all_ways(run, rng.integers(3, vocab, 21), rng.integers(3, vocab, 40), vocab)
    _check_tree(run, rng.integers(3, vocab, 21), vocab)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["smollm2", "smollm2_int8"])
def test_smollm2_rows_are_bit_identical(request, fixture):
    run = _Run(request.getfixturevalue(fixture))
    rng = np.random.default_rng(1)
    vocab = run.model.vocab_size
    _check_all_ways(run, rng.integers(3, vocab, 45), rng.integers(3, vocab, 60), vocab)
