"""``build.fit``: training and calibration shared by ``attnstore build`` and ``admin train-projector``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import tokenize
from attnstore_tools.build.fit import FitConfig, SpilledArrays, fit_projector, format_fit
from attnstore_tools.build.training import TrainConfig
from tests.support.caches import sentences, tiny_loaded

_QUICK = TrainConfig(max_epochs=3, patience=1)


def _spilled(tmp_path: Path, count: int) -> tuple[list[list[int]], list[torch.Tensor], list[Path], list[Path]]:
    loaded = tiny_loaded("bert")
    adapter = adapter_for(loaded)
    batch = tokenize(loaded.tokenizer, sentences(count, seed=3, min_words=5, max_words=6))
    capture = adapter.capture(batch)
    maps, outputs = [], []
    for row, (m, h) in enumerate(zip(capture.maps, capture.hidden, strict=True)):
        maps.append(tmp_path / f"{row}.maps.npy")
        outputs.append(tmp_path / f"{row}.out.npy")
        np.save(maps[-1], m.to(torch.float16).numpy())
        np.save(outputs[-1], h.to(torch.float16).numpy())
    ids = [batch.row_ids(row) for row in range(batch.size)]
    return ids, adapter.feature_source(batch), maps, outputs


def test_spilled_arrays_load_each_file_on_access_and_slice(tmp_path: Path) -> None:
    paths = [tmp_path / f"{i}.npy" for i in range(3)]
    for i, path in enumerate(paths):
        np.save(path, np.full((2, 2), i, np.float16))
    spilled = SpilledArrays(paths)
    assert len(spilled) == 3 and float(spilled[2][0, 0]) == 2.0
    assert [float(a[0, 0]) for a in spilled[1:]] == [1.0, 2.0]


def test_fit_trains_on_a_seeded_sample_of_train_limit_inputs_and_calibrates_on_all(tmp_path: Path) -> None:
    ids, sources, maps, outputs = _spilled(tmp_path, 40)
    adapter = adapter_for(tiny_loaded("bert"))
    config = FitConfig(train_limit=30, train=_QUICK, progress=False)
    projector, report = fit_projector(adapter, ids, sources, maps, outputs, config)
    assert report.train.train_items + report.train.val_items == 30
    assert report.calibration is not None and report.calibration.pairs > 30  # pseudo-queries of every input
    again, _ = fit_projector(adapter, ids, sources, maps, outputs, config)
    np.testing.assert_array_equal(projector.project(sources), again.project(sources))  # seeded
    lines = format_fit(report.train, report.calibration)
    assert lines[0].startswith("projector: ") and lines[1].startswith("calibration: ")


def test_fit_without_calibration_leaves_the_projector_uncalibrated(tmp_path: Path) -> None:
    ids, sources, maps, outputs = _spilled(tmp_path, 20)
    adapter = adapter_for(tiny_loaded("bert"))
    projector, report = fit_projector(adapter, ids, sources, maps, outputs,
                                      FitConfig(train=_QUICK, calibration=None, progress=False))
    assert report.calibration is None and projector.calibration is None and projector.gate is None
    assert format_fit(report.train, None)[0].startswith("projector: 17 train / 3 val")
