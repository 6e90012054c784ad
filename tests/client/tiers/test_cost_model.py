"""The cost model: per length band, a map lookup is asked for only where hits save more than lookups cost."""

from __future__ import annotations

import numpy as np
import pytest

from attnstore.errors import ConfigError
from attnstore_client.tiers.cost_model import PRIOR_SAVING, CostModel, CostSettings, ForwardCost


def _asked(model: CostModel, length: int, rows: int) -> int:
    return sum(model.should_ask(length) for _ in range(rows))


def test_bands_double_from_eight_tokens() -> None:
    assert [CostModel.band_of(n) for n in (1, 8, 9, 16, 17, 32, 33, 256, 257)] == [0, 0, 1, 1, 2, 2, 3, 5, 6]


def _forwards(model: CostModel, length: int, *, computed: int, replayed: int, seconds: float, times: int = 1) -> None:
    for _ in range(times):
        model.record_forward(length, computed_tokens=computed, replayed_tokens=replayed, seconds=seconds)


def test_a_band_asks_its_first_samples_then_only_explores_until_a_forward_is_timed() -> None:
    model = CostModel(CostSettings(min_samples=10, explore=0.0))
    assert _asked(model, 20, 50) == 10  # nothing timed yet: the first 10 are the samples, the rest wait
    model.record_lookup(20, rows=10, hits=5, seconds=0.01)
    assert _asked(model, 20, 50) == 0  # no forward time yet: the saving is unknown, so not worth asking yet
    _forwards(model, 20, computed=200, replayed=0, seconds=0.1)
    assert _asked(model, 20, 50) == 50  # half the rows hit and a hit saves more than a lookup costs
    assert _asked(model, 5, 3) == 3  # another band is not affected
    exploring = CostModel(CostSettings(min_samples=10, explore=0.5, seed=0))
    assert 10 < _asked(exploring, 20, 110) < 110  # the samples, then about half the others


def test_the_per_token_times_of_computed_and_replayed_rows_are_fitted_from_mixed_forwards() -> None:
    model = CostModel(CostSettings(decay=1.0))
    c, r = 0.5e-3, 0.3e-3  # seconds per padded token
    for replayed in (0, 64, 128, 256, 512):
        _forwards(model, 20, computed=512 - replayed, replayed=replayed, seconds=c * (512 - replayed) + r * replayed,
                  times=20)
    [band] = model.estimates()
    assert band.saving_ms == pytest.approx(1000 * (c - r) * 32, rel=0.05)  # a hit of the band's longest length


def test_lookups_are_asked_where_the_expected_saving_beats_their_cost() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.0, decay=1.0))
    # 0.5 ms a computed token, 0.25 ms a replayed one: a 20-token hit saves 5 ms.
    _forwards(model, 20, computed=200, replayed=0, seconds=0.1, times=50)
    _forwards(model, 20, computed=0, replayed=200, seconds=0.05, times=50)
    model.record_lookup(20, rows=10, hits=5, seconds=0.02)  # 2 ms a row asked; half hit: 2.5 ms expected saving
    assert _asked(model, 20, 20) == 20
    model.record_lookup(20, rows=30, hits=0, seconds=0.06)  # hit rate now 5/40: 0.625 ms against 2 ms
    assert _asked(model, 20, 20) == 0
    [band] = model.estimates()
    assert (band.low, band.high) == (17, 32)
    assert band.hit_rate == pytest.approx(0.125) and band.saving_ms == pytest.approx(0.25 * 32, rel=0.05)
    assert band.cost_ms == pytest.approx(2.0) and band.worth is False and band.skipped == 20


def test_the_saving_grows_with_the_row_length_within_a_band() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.0, decay=1.0))
    # 1 ms a computed token, 0.5 ms a replayed one: a hit of L tokens saves L / 2 ms.
    _forwards(model, 60, computed=1920, replayed=0, seconds=1.92, times=50)
    _forwards(model, 60, computed=0, replayed=1920, seconds=0.96, times=50)
    model.record_lookup(60, rows=10, hits=1, seconds=0.0185)  # 1.85 ms a row asked at 10% hits: 18.5 ms to save
    assert _asked(model, 34, 5) == 0 and _asked(model, 40, 5) == 5  # 17 ms and 20 ms saved per hit


def test_before_any_replay_is_timed_the_saving_is_the_prior_share_of_a_forward() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.0, decay=1.0))
    _forwards(model, 100, computed=100, replayed=0, seconds=0.010)  # 0.1 ms a token
    model.record_lookup(100, rows=1, hits=1, seconds=0.001)
    [band] = model.estimates()
    assert band.saving_ms == pytest.approx(PRIOR_SAVING * 0.1 * 128) and band.worth is True


def test_a_band_whose_rows_all_hit_prices_a_computed_row_by_the_prior_and_keeps_asking() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.0, decay=1.0))
    _forwards(model, 20, computed=0, replayed=320, seconds=0.08, times=10)  # 0.25 ms a replayed token
    model.record_lookup(20, rows=100, hits=100, seconds=0.1)  # 1 ms a row asked, every row a hit
    [band] = model.estimates()
    # A computed token at 0.25 / (1 - PRIOR_SAVING) ms: a 32-token hit saves 32 * 0.0625 = 2 ms.
    assert band.saving_ms == pytest.approx(32 * 0.25 * PRIOR_SAVING / (1 - PRIOR_SAVING), rel=0.05)
    assert band.worth is True and _asked(model, 20, 5) == 5


def test_a_skipped_band_explores_about_its_share_of_rows() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.1, seed=1))
    _forwards(model, 20, computed=200, replayed=0, seconds=0.1)
    model.record_lookup(20, rows=10, hits=0, seconds=0.01)
    asked = _asked(model, 20, 2000)
    assert 150 <= asked <= 250


def test_old_batches_weigh_less_so_a_band_whose_traffic_changes_is_followed() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.0, decay=0.5))
    _forwards(model, 20, computed=200, replayed=0, seconds=0.1)
    _forwards(model, 20, computed=0, replayed=200, seconds=0.02)
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


def test_maps_are_worth_writing_back_while_a_hit_saves_more_than_its_lookup_whatever_the_hit_rate() -> None:
    model = CostModel(CostSettings(min_samples=0, explore=0.0, decay=1.0))
    assert model.replay_pays(20)  # nothing timed yet (a namespace without a projector has no lookups)
    _forwards(model, 20, computed=200, replayed=0, seconds=0.1, times=50)
    _forwards(model, 20, computed=0, replayed=200, seconds=0.05, times=50)  # a 20-token hit saves 5 ms
    model.record_lookup(20, rows=40, hits=0, seconds=0.08)  # 2 ms a row asked, no hit yet
    assert model.replay_pays(20) and _asked(model, 20, 10) == 0  # not asked at that hit rate, yet worth storing
    model.record_lookup(20, rows=10, hits=0, seconds=0.5)  # now 11.6 ms a row: more than a hit saves
    assert not model.replay_pays(20)
    assert model.estimates()[0].skipped == 10  # replay_pays counts nothing


def test_a_forwards_fixed_per_token_and_attention_costs_are_fitted_once_there_are_enough_forwards() -> None:
    model = CostModel(CostSettings(min_forwards=10, decay=1.0))
    truth = ForwardCost(fixed=0.01, per_token=2e-4, per_token_position=5e-7)
    shapes = [(rows, padded) for rows in (1, 4, 16) for padded in (8, 32, 128)]
    for k, (rows, padded) in enumerate(shapes):
        replayed = rows * padded // 2 if k % 2 else 0  # the kind of the rows does not matter to this fit
        seconds = float(truth.seconds(np.array(rows), np.array(padded)))
        _forwards(model, padded, computed=rows * padded - replayed, replayed=replayed, seconds=seconds)
    assert model.forward_cost() is None  # 9 forwards, 10 needed
    _forwards(model, 8, computed=8, replayed=0, seconds=float(truth.seconds(np.array(1), np.array(8))))
    fitted = model.forward_cost()
    assert fitted is not None
    assert (fitted.fixed, fitted.per_token, fitted.per_token_position) == pytest.approx(
        (truth.fixed, truth.per_token, truth.per_token_position), rel=1e-6
    )


def test_the_forward_fit_never_gives_a_negative_cost() -> None:
    model = CostModel(CostSettings(min_forwards=1, decay=1.0))
    # Times that fall with the padding past a point would fit a negative attention term: it is dropped.
    for rows, padded, seconds in [(1, 8, 0.010), (4, 32, 0.030), (8, 64, 0.050), (16, 128, 0.052)]:
        _forwards(model, padded, computed=rows * padded, replayed=0, seconds=seconds)
    fitted = model.forward_cost()
    assert fitted is not None
    assert min(fitted.fixed, fitted.per_token, fitted.per_token_position) >= 0.0
