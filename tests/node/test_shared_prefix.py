"""What the node counts and shares of a call's rows: distinct tokens (each shared prefix once) and the groups of
rows whose common prefix the prefix tier computes once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from attnstore_client.call.rows import Row
from attnstore_client.tiers.prefix.shared import shared_groups, suffix_batches
from attnstore_node.call import distinct_tokens

token_rows = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=20)


def trie_nodes(rows: list[list[int]]) -> int:
    return len({tuple(row[: end]) for row in rows for end in range(1, len(row) + 1)})


@given(token_rows)
def test_distinct_tokens_are_the_nodes_of_the_rows_prefix_tree(rows: list[list[int]]) -> None:
    assert distinct_tokens(rows) == trie_nodes(rows)


@given(token_rows, st.integers(1, 6))
def test_every_group_shares_its_prefix_and_leaves_each_row_a_token(rows: list[list[int]], min_tokens: int) -> None:
    distinct = {tuple(row): row for row in rows}  # a call's rows are distinct
    call_rows = [Row(index, row, bytes(index)) for index, row in enumerate(distinct.values())]
    seen: set[int] = set()
    for group in shared_groups(call_rows, min_tokens):
        assert len(group.rows) >= 2 and group.length >= min_tokens
        prefix = list(group.rows[0].tokens[: group.length])
        for row in group.rows:
            assert list(row.tokens[: group.length]) == prefix and len(row.tokens) > group.length
            assert row.index not in seen
            seen.add(row.index)


def test_a_query_with_64_items_is_one_group_of_the_query() -> None:
    query = list(range(100, 180))
    rows = [Row(i, [*query, 1000 + i, 7], bytes(i)) for i in range(64)]
    (group,) = shared_groups(rows, 64)
    assert group.length == len(query) and len(group.rows) == 64
    assert shared_groups(rows, 81) == []


@given(st.lists(st.integers(1, 60), min_size=1, max_size=80), st.integers(1, 16))
def test_suffix_batches_take_every_row_once_shortest_first_within_their_padding_bound(
    suffixes: list[int], size: int
) -> None:
    prefix = 5
    rows = [Row(index, [9] * (prefix + length), bytes(index)) for index, length in enumerate(suffixes)]
    batches = suffix_batches(rows, prefix, size, waste=0.15)
    assert sorted(row.index for batch in batches for row in batch) == list(range(len(rows)))
    lengths = [[len(row.tokens) - prefix for row in batch] for batch in batches]
    assert [length for batch in lengths for length in batch] == sorted(suffixes)  # shortest first
    for batch in lengths:
        assert len(batch) <= size
        assert len(batch) == 1 or len(batch) * max(batch) <= 1.15 * sum(batch)  # padded within 15% of real
