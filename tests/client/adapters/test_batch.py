"""Right-padded batches from token ids and from text."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnstore.errors import ConfigError
from attnstore_client.adapters.batch import batch_from_ids, group_by_length, tokenize, within_padding


def test_batch_from_ids_pads_on_the_right_and_keeps_lengths():
    batch = batch_from_ids([[5, 6, 7], [8]], pad_id=0)
    assert batch.lengths == (3, 1) and batch.size == 2 and batch.padded_length == 3
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.input_ids.dtype == torch.long
    assert batch.row_ids(1).tolist() == [8]


@pytest.mark.parametrize("rows", [[], [[1], []]])
def test_batch_from_ids_refuses_empty_input(rows):
    with pytest.raises(ConfigError):
        batch_from_ids(rows, pad_id=0)


@pytest.mark.real_model
def test_tokenize_adds_special_tokens_truncates_and_refuses_a_bare_string(minilm_model):
    tokenizer = minilm_model.tokenizer
    batch = tokenize(tokenizer, ["a cat", "a cat sat on the mat today"], max_length=5)
    assert batch.lengths == (4, 5)
    assert batch.input_ids[0, 0].item() == tokenizer.cls_token_id
    assert batch.input_ids[0, 3].item() == tokenizer.sep_token_id
    assert batch.input_ids[0, 4].item() == tokenizer.pad_token_id
    with pytest.raises(ConfigError, match="single str"):
        tokenize(tokenizer, "a cat")


def _forward_seconds(fixed: float, per_token: float):
    return lambda rows, padded: fixed + per_token * rows * padded


def test_without_forward_times_rows_go_in_full_batches_of_max_rows():
    assert group_by_length([9, 7, 7, 5, 3], 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]


def test_short_rows_get_a_forward_of_their_own_where_their_padding_costs_more_than_a_forward():
    lengths = [64, 60, 8, 8, 8, 8]
    # A forward costs as much as 100 padded tokens: padding four 8-token rows to 64 wastes 224.
    assert group_by_length(lengths, 32, _forward_seconds(100.0, 1.0)) == [slice(0, 2), slice(2, 6)]
    # A forward costing 1,000 tokens is worth more than the padding: one forward, as without times.
    assert group_by_length(lengths, 32, _forward_seconds(1000.0, 1.0)) == [slice(0, 6)]
    # Free forwards: one per distinct length.
    assert group_by_length(lengths, 32, _forward_seconds(0.0, 1.0)) == [slice(0, 1), slice(1, 2), slice(2, 6)]


def test_the_split_is_the_cheapest_and_never_exceeds_max_rows():
    rng = np.random.default_rng(4)
    lengths = sorted(rng.integers(1, 200, size=70).tolist(), reverse=True)
    seconds = _forward_seconds(40.0, 1.0)
    groups = group_by_length(lengths, 8, seconds)
    assert groups[0].start == 0 and groups[-1].stop == 70
    assert all(a.stop == b.start for a, b in zip(groups, groups[1:], strict=False))
    assert all(0 < g.stop - g.start <= 8 for g in groups)
    total = sum(float(seconds(g.stop - g.start, lengths[g.start])) for g in groups)
    full = sum(float(seconds(g.stop - g.start, lengths[g.start])) for g in group_by_length(lengths, 8))
    assert total < full


def test_group_by_length_refuses_unsorted_lengths_and_no_room_for_a_row():
    with pytest.raises(ConfigError, match="longest first"):
        group_by_length([3, 5], 4)
    with pytest.raises(ConfigError, match="max_rows must be >= 1, got 0"):
        group_by_length([5], 0)


@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=80), waste=st.sampled_from([0.0, 0.05, 0.15]),
       max_rows=st.none() | st.integers(1, 40), max_tokens=st.none() | st.integers(1, 4096),
       longest_first=st.booleans())
def test_padded_batches_take_every_row_once_in_order_within_their_bounds(
    lengths: list[int], waste: float, max_rows: int | None, max_tokens: int | None, longest_first: bool
) -> None:
    lengths = sorted(lengths, reverse=longest_first)
    batches = within_padding(lengths, waste=waste, max_rows=max_rows, max_tokens=max_tokens)
    assert [i for part in batches for i in range(len(lengths))[part]] == list(range(len(lengths)))
    for part in batches:
        rows = lengths[part]
        if len(rows) == 1:  # a row alone may be past any bound
            continue
        padded = len(rows) * max(rows)
        assert padded <= (1 + waste) * sum(rows) + 1e-9
        assert max_rows is None or len(rows) <= max_rows
        assert max_tokens is None or padded <= max_tokens
    for before, after in zip(batches, batches[1:], strict=False):  # a batch closes only at a bound
        rows = lengths[before.start:after.start + 1]
        padded = len(rows) * max(rows)
        assert (padded > (1 + waste) * sum(rows) or (max_rows is not None and len(rows) > max_rows)
                or (max_tokens is not None and padded > max_tokens))


def test_padded_batches_refuse_a_negative_waste_and_no_room():
    with pytest.raises(ConfigError, match="waste must be >= 0"):
        within_padding([3], waste=-0.1)
    with pytest.raises(ConfigError, match="max_rows, max_tokens >= 1"):
        within_padding([3], waste=0.1, max_tokens=0)
