"""The fuzz harness's shared tally, printed at the end of the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fuzz_harness import Tally


@pytest.fixture(scope="session")
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    tally = Tally()
    yield tally
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in tally.lines():
            reporter.write_line(line)
