"""Hidden states of a forward's rows: padded or end to end, each row where it lies."""

from __future__ import annotations

import pytest
import torch

from attnstore_client.call.rows import HiddenRows, last_positions


def _rows(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn((length, 4), generator=generator) for length in lengths]


def test_padded_rows_and_packed_rows_give_the_same_padded_view() -> None:
    rows = _rows(3, 1, 2)
    packed = HiddenRows.stacked(rows)
    tokens, mask = packed.padded()
    assert tokens.shape == (3, 3, 4) and mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    padded = HiddenRows(tokens, [3, 1, 2])
    for r, row in enumerate(rows):
        torch.testing.assert_close(packed.row(r), row)
        torch.testing.assert_close(padded.row(r), row)
    assert float(tokens[1, 1:].abs().sum()) == 0.0  # padding is zeros


def test_rows_end_to_end_are_bounded_by_their_offsets() -> None:
    rows = _rows(3, 1, 2)
    packed = HiddenRows.stacked(rows)
    assert packed.end_to_end
    assert packed.offsets().tolist() == [0, 3, 4, 6] and packed.offsets().dtype == torch.int32
    bounds = packed.offsets().tolist()
    for r, row in enumerate(rows):
        torch.testing.assert_close(packed.values[bounds[r] : bounds[r + 1]], row)


def test_padded_rows_and_rows_with_gaps_have_no_offsets() -> None:
    tokens, _ = HiddenRows.stacked(_rows(3, 1)).padded()
    padded = HiddenRows(tokens, [3, 1])
    gapped = HiddenRows(torch.randn(7, 4), [3, 1], starts=[0, 5])
    for hidden in (padded, gapped):
        assert not hidden.end_to_end
        with pytest.raises(ValueError, match=r"lengths \(3, 1\).*not end to end"):
            hidden.offsets()


def test_last_positions_reads_each_row_s_last_real_token_from_the_mask_on_either_padding_side() -> None:
    right = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    left = right.flip(1)
    assert last_positions(right).tolist() == [2, 0, 3]
    assert last_positions(left).tolist() == [3, 3, 3]
