"""Sinks: served rows pooled into a preallocated result as they come, every copy answered, input order kept."""

from __future__ import annotations

import pytest
import torch

from attnstore.errors import UnwrittenRowError
from attnstore_client.call.rows import HiddenRows
from attnstore_client.call.sinks import LastStates, Pooled, RowStates


def _mean(hidden: HiddenRows) -> torch.Tensor:
    tokens, mask = hidden.padded()
    weights = mask[:, :, None].float()
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1)


def _rows(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn((length, 4), generator=generator) for length in lengths]


def test_pooled_rows_land_at_every_position_they_answer_in_input_order() -> None:
    sink = Pooled(5, _mean)
    first, second = _rows(3, 1), _rows(2, seed=1)
    sink.put([[4], [0, 2]], HiddenRows.stacked(first))  # row 1 answers positions 0 and 2
    sink.put([[1]], HiddenRows.stacked(second[:1]))
    sink.copy(4, 3)
    result = sink.result()
    assert result.shape == (5, 4)
    torch.testing.assert_close(result[4], first[0].mean(dim=0))
    torch.testing.assert_close(result[0], first[1][0])
    torch.testing.assert_close(result[2], result[0])
    torch.testing.assert_close(result[1], second[0].mean(dim=0))
    torch.testing.assert_close(result[3], result[4])


def test_row_states_are_each_rows_own_tensor_not_a_view_of_its_forward() -> None:
    sink = RowStates(3)
    rows = _rows(3, 2)
    hidden = HiddenRows.stacked(rows)
    sink.put([[0, 2], [1]], hidden)
    hidden.values.zero_()  # the forward's buffer is reused: the results must not change
    result = sink.result()
    torch.testing.assert_close(result[0], rows[0])
    torch.testing.assert_close(result[1], rows[1])
    torch.testing.assert_close(result[2], rows[0])
    result[2].add_(1.0)  # a copy is its own tensor too
    torch.testing.assert_close(result[0], rows[0])


def test_pooled_keeps_the_states_too_when_asked() -> None:
    sink = Pooled(2, _mean, keep_states=True)
    rows = _rows(3, 5)
    sink.put([[1], [0]], HiddenRows.stacked(rows))
    assert sink.states is not None
    torch.testing.assert_close(sink.states.result()[1], rows[0])
    torch.testing.assert_close(sink.result()[0], rows[1].mean(dim=0))


def test_last_states_keep_each_rows_last_token() -> None:
    sink = LastStates(3)
    rows = _rows(3, 1, 4)
    sink.put([[2], [0], [1]], HiddenRows.stacked(rows))
    torch.testing.assert_close(sink.result(), torch.stack([rows[1][-1], rows[2][-1], rows[0][-1]]))


@pytest.mark.parametrize("make", [lambda: Pooled(3, _mean), lambda: RowStates(3), lambda: LastStates(3),
                                  lambda: Pooled(3, _mean, keep_states=True)])
def test_a_sink_missing_a_row_raises_naming_it_instead_of_returning_its_buffer(make) -> None:
    sink = make()
    sink.put([[0], [2]], HiddenRows.stacked(_rows(2, 3)))
    with pytest.raises(UnwrittenRowError, match=r"row 1 \(kind 'miss'\)"):
        sink.check(["miss", "miss", "miss"])
    with pytest.raises(UnwrittenRowError, match="row 1"):
        sink.result()


def test_a_copy_of_a_row_not_yet_received_raises() -> None:
    sink = Pooled(2, _mean)
    with pytest.raises(UnwrittenRowError, match="row 1 copies row 0"):
        sink.copy(0, 1)
