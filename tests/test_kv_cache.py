"""The CPU artifacts' page pool (``runtime/kv_cache.py``): the page tables a forward pass gets,
pages shared copy-on-write between forked sequences, rollback and removal giving pages back,
and a full pool refused with an error instead of an overwritten page."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from mlc_spec.runtime.kv_cache import KVCacheFull, PagePool

PAGE = 16


def _pool(num_pages: int = 8) -> PagePool:
    pages = tvm.runtime.tensor(np.zeros((2, num_pages, 2, 1, PAGE * 4), np.float32))
    return PagePool(pages, PAGE)


def _tables(pool: PagePool, seq_ids, lengths, trees=None, paths=False) -> list[np.ndarray]:
    """positions, slots, q_indptr, page_indptr, page_values (and with ``paths``,
    path_indptr and path_positions)."""
    with pool.forward(seq_ids, lengths, trees) as kv:
        return [t.numpy().copy() for t in kv[1 : 8 if paths else 6]]


def test_tables_of_a_forward_pass():
    pool = _pool()
    pool.add_sequence(7)
    pool.add_sequence(3)
    positions, slots, q_indptr, page_indptr, page_values = _tables(pool, [7, 3], [18, 2])
    np.testing.assert_array_equal(positions, [*range(18), 0, 1])
    np.testing.assert_array_equal(q_indptr, [0, 18, 20])
    np.testing.assert_array_equal(page_indptr, [0, 2, 3])
    first, second, third = page_values
    expected = [first * PAGE + i for i in range(16)] + [second * PAGE, second * PAGE + 1]
    np.testing.assert_array_equal(slots, [*expected, third * PAGE, third * PAGE + 1])
    assert len({first, second, third}) == 3
    assert [pool.sequence_length(s) for s in (7, 3)] == [18, 2]
    # Decoding one more token of 7 continues its second page.
    positions, slots, *_ = _tables(pool, [7], [1])
    np.testing.assert_array_equal(positions, [18])
    np.testing.assert_array_equal(slots, [second * PAGE + 2])


def test_tables_of_a_tree_and_keeping_its_path():
    """A tree of 6 nodes after 14 tokens (root at 14): positions by depth, each node's path
    mapped from its first node off the chain, then the path 0-2-5 kept: its K/V moved to 15
    and 16, the rest dropped."""
    pool = _pool()
    view = np.from_dlpack(pool.pages).reshape(2, 8, 2, 1, 4, PAGE)  # keys: [feature, slot]
    pool.add_sequence(0)
    _tables(pool, [0], [14])
    parents = np.array([-1, 0, 0, 1, 2, 2])
    positions, *_, path_indptr, path_positions = _tables(
        pool, [0], [6], [(14, parents)], paths=True
    )
    np.testing.assert_array_equal(positions, [14, 15, 15, 16, 16, 16])
    # Nodes 0 and 1 sit where decode would put them; node 2's path 0-2 maps its last position
    # to 16, node 3's 0-1-3 its last to 17, node 4's 0-2-4 its last two to 16 and 18.
    bounds = zip(path_indptr[:-1], path_indptr[1:], strict=True)
    paths = [path_positions[a:b].tolist() for a, b in bounds]
    assert paths == [[], [], [16], [17], [16, 18], [16, 19]]
    first, second = pool._seqs[0].pages
    for position in range(14, 20):
        page = first if position < PAGE else second
        view[:, page, 0, 0, :, position % PAGE] = position  # each token's keys: its position
    pool.keep(0, 14, [0, 2, 5])
    assert pool.sequence_length(0) == 17
    assert view[0, second, 0, 0, 0, 0] == 19  # node 5 moved from 19 to 16
    assert view[0, first, 0, 0, 0, 15] == 16  # node 2 moved from 16 to 15
    assert view[0, first, 0, 0, 0, 14] == 14


def test_fork_shares_pages_and_copies_the_one_written():
    pool = _pool()
    view = np.from_dlpack(pool.pages)
    pool.add_sequence(0)
    _tables(pool, [0], [20])  # pages a (full) and b (4 tokens)
    a, b = pool._seqs[0].pages
    view[:, b] = 5.0  # stands for the parent's keys and values
    free = pool.available_pages()
    pool.fork_sequence(0, 1)
    assert pool.available_pages() == free  # nothing copied yet
    *_, page_values = _tables(pool, [1], [1])  # the child writes into the shared page b
    assert page_values[0] == a and page_values[1] != b
    np.testing.assert_array_equal(view[:, page_values[1]], view[:, b])
    assert pool.available_pages() == free - 1
    # The parent writes into b, its own again: no copy.
    *_, page_values = _tables(pool, [0], [1])
    np.testing.assert_array_equal(page_values, [a, b])
    pool.remove_sequence(0)
    pool.remove_sequence(1)
    assert pool.available_pages() == 8


def test_copy_holds_the_parents_bytes_in_pages_of_its_own():
    pool = _pool()
    view = np.from_dlpack(pool.pages)
    pool.add_sequence(0)
    _tables(pool, [0], [20])  # pages a (full) and b (4 tokens)
    parent = pool._seqs[0].pages
    view[:, parent] = np.arange(2 * 2 * 2 * PAGE * 4, dtype=np.float32).reshape(2, 2, 2, 1, -1)
    free = pool.available_pages()
    assert pool.copy_sequence(0, 1)
    copy = pool._seqs[1].pages
    assert pool.sequence_length(1) == 20 and pool.available_pages() == free - 2
    assert not set(copy) & set(parent)
    np.testing.assert_array_equal(view[:, copy], view[:, parent])
    *_, page_values = _tables(pool, [1], [1])  # the copy writes into its own last page
    np.testing.assert_array_equal(page_values, copy)
    pool.remove_sequence(0)
    pool.remove_sequence(1)
    assert pool.available_pages() == 8


def test_repeat_fills_a_longer_context_with_copies_of_whole_pages():
    """Pages a, b (full) and c (4 tokens), forked to a second sequence: grown to 70 tokens,
    c and two new pages repeat a, b, a, b in turn; the shared a and b stay as they were."""
    pool = _pool()
    view = np.from_dlpack(pool.pages)
    pool.add_sequence(0)
    _tables(pool, [0], [36])
    a, b, c = pool._seqs[0].pages
    view[:, [a, b, c]] = np.arange(3 * 2 * 2 * PAGE * 4, dtype=np.float32).reshape(2, 3, 2, 1, -1)
    before = view[:, [a, b]].copy()
    pool.fork_sequence(0, 1)
    assert pool.repeat_sequence(1, 70)
    pages = pool._seqs[1].pages
    assert pool.sequence_length(1) == 70 and len(pages) == 5 and pages[:2] == [a, b]
    assert not set(pages[2:]) & {a, b, c}  # c was shared: the copy writes a page of its own
    np.testing.assert_array_equal(view[:, pages], before[:, [0, 1, 0, 1, 0]])
    np.testing.assert_array_equal(view[:, [a, b]], before)
    assert pool.repeat_sequence(1, 40) and pool.sequence_length(1) == 70  # never shrinks
    pool.add_sequence(2)
    _tables(pool, [2], [15])
    assert not pool.repeat_sequence(2, 64)  # no whole page to repeat
    assert pool.sequence_length(2) == 15
    for seq_id in (0, 1, 2):
        pool.remove_sequence(seq_id)
    assert pool.available_pages() == 8


def test_fork_at_a_position_and_rollback():
    pool = _pool()
    pool.add_sequence(0)
    _tables(pool, [0], [40])
    pool.fork_sequence(0, 1, fork_pos=16)
    assert pool.sequence_length(1) == 16
    assert pool._seqs[1].pages == pool._seqs[0].pages[:1]
    pool.popn(0, 23)  # back to 17 tokens: the third page goes back
    assert pool.sequence_length(0) == 17 and len(pool._seqs[0].pages) == 2
    assert pool.available_pages() == 8 - 2
    with pytest.raises(ValueError, match="cannot pop 18"):
        pool.popn(0, 18)
    with pytest.raises(ValueError, match="not in the KV cache"):
        pool.popn(9, 1)
    with pytest.raises(ValueError, match="already in the KV cache"):
        pool.add_sequence(1)


def test_a_full_pool_is_refused():
    pool = _pool(num_pages=2)
    pool.add_sequence(0)
    with pytest.raises(KVCacheFull, match="no free page"):
        _tables(pool, [0], [33])
