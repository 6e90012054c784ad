"""What the fuzz tests share: their hypothesis settings and the tally of what they ran."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings

# The profile of a long run (tests/conftest.py registers it; scripts/fuzz.sh loads it).
LONG_PROFILE = "long"


def fuzz_settings(*, fast_examples: int) -> settings:
    """In the suite, ``fast_examples`` derandomised examples (the same calls every run); under
    ``--hypothesis-profile long``, the profile's examples, new ones every run."""
    if settings.get_current_profile_name() == LONG_PROFILE:
        return settings(settings.default, suppress_health_check=list(HealthCheck), deadline=None)
    return settings(max_examples=fast_examples, deadline=None, suppress_health_check=list(HealthCheck),
                    derandomize=True)


@dataclass
class Tally:
    """What the harness ran: calls, rows and their kinds per test, and the configurations seen."""

    calls: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)
    configurations: dict[str, set[str]] = field(default_factory=dict)

    def count(self, test: str, configuration: str, kinds: tuple[str, ...]) -> None:
        """One call of ``test`` in ``configuration`` whose rows came back as ``kinds``."""
        self.calls[test] = self.calls.get(test, 0) + 1
        self.rows[test] = self.rows.get(test, 0) + len(kinds)
        self.configurations.setdefault(test, set()).add(configuration)
        seen = self.kinds.setdefault(test, {})
        for kind in kinds:
            seen[kind] = seen.get(kind, 0) + 1

    def lines(self) -> list[str]:
        return [f"fuzz {test}: {calls} calls, {self.rows[test]} rows, kinds {self.kinds[test]},"
                f" {len(self.configurations[test])} configurations" for test, calls in self.calls.items()]
