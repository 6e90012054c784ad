"""The cost model: per length band, a map lookup is asked for only where hits save more than lookups cost."""

from __future__ import annotations

import pytest

from attnstore.errors import ConfigError
from attnstore_client.tiers.cost_model import PRIOR_SAVING, CostModel, CostSettings


def _asked(model: CostModel, length: int, rows: int) -> int:
    return sum(model.should_ask(length) for _ in range(rows))


def test_bands_double_from_eight_tokens() -> None:
    assert [CostModel.band_of(n) for n in (1, 8, 9, 16, 17, 32, 33, 256, 257)] == [0, 0, 1, 1, 2, 2, 3, 5, 6]


def test_every_row_is_asked_until_the_band_has_its_samples_and_a_forward_time() -> None:
    model = CostModel(CostSettings(min_samples=10, explore=0.0))
    assert _asked(model, 20, 50) == 50  # nothing recorded yet
    model.record_lookup(20, rows=10, hits=0, seconds=0.01)
    assert _asked(model, 20, 50) == 50  # no forward time yet: the saving is unknown
    model.record_forward(20, rows=10, seconds=0.1, replayed=False)
    assert _asked(model, 20, 50) == 0  # no hits: nothing to save
    assert _asked(model, 5, 3) == 3  # another band is not affected


def test_lookups_are_asked_where_the_expected_saving_beats_their_cost() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.0, decay=1.0))
    model.record_forward(20, rows=10, seconds=0.1, replayed=False)  # 10 ms a computed row
    model.record_forward(20, rows=10, seconds=0.05, replayed=True)  # 5 ms a replayed row: 5 ms saved per hit
    model.record_lookup(20, rows=10, hits=5, seconds=0.02)  # 2 ms a row asked; half hit: 2.5 ms expected saving
    assert _asked(model, 20, 20) == 20
    model.record_lookup(20, rows=30, hits=0, seconds=0.06)  # hit rate now 5/40: 0.625 ms against 2 ms
    assert _asked(model, 20, 20) == 0
    [band] = model.estimates()
    assert (band.low, band.high) == (17, 32)
    assert band.hit_rate == pytest.approx(0.125) and band.saving_ms == pytest.approx(5.0)
    assert band.cost_ms == pytest.approx(2.0) and band.worth is False and band.skipped == 20


def test_before_any_replay_is_timed_the_saving_is_the_prior_share_of_a_forward() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.0, decay=1.0))
    model.record_forward(100, rows=1, seconds=0.010, replayed=False)
    model.record_lookup(100, rows=1, hits=1, seconds=0.001)
    [band] = model.estimates()
    assert band.saving_ms == pytest.approx(PRIOR_SAVING * 10.0) and band.worth is True


def test_a_skipped_band_explores_about_its_share_of_rows() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.1, seed=1))
    model.record_forward(20, rows=10, seconds=0.1, replayed=False)
    model.record_lookup(20, rows=10, hits=0, seconds=0.01)
    asked = _asked(model, 20, 2000)
    assert 150 <= asked <= 250


def test_old_batches_weigh_less_so_a_band_whose_traffic_changes_is_followed() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.0, decay=0.5))
    model.record_forward(20, rows=10, seconds=0.1, replayed=False)
    model.record_forward(20, rows=10, seconds=0.02, replayed=True)
    for _ in range(5):
        model.record_lookup(20, rows=10, hits=0, seconds=0.001)
    assert _asked(model, 20, 5) == 0
    for _ in range(5):
        model.record_lookup(20, rows=10, hits=10, seconds=0.001)  # the band starts hitting
    assert _asked(model, 20, 5) == 5


@pytest.mark.parametrize("settings", [dict(min_samples=-1), dict(explore=1.5), dict(decay=0.0)])
def test_bad_settings_are_config_errors_naming_the_values(settings: dict) -> None:
    with pytest.raises(ConfigError, match="CostSettings needs"):
        CostSettings(**settings)
