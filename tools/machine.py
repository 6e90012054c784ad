"""The machine a measurement ran on, recorded beside every benchmark and evaluation figure, and a process's
resident memory sampled while it runs."""

from __future__ import annotations

import platform
import resource
import sys
import threading
import time
from pathlib import Path

RSS_INTERVAL = 0.5  # seconds between RSS samples


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` says, else "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def peak_rss_bytes() -> int:
    """This process's own peak resident memory since it started (``VmHWM``).

    Not ``ru_maxrss``: Linux carries the spawning process's high-water mark into a
    child across ``fork``/``vfork`` and ``exec``, so a child of a 700 MiB parent
    reports at least 700 MiB whatever it used (measured: a child of a parent that had
    held 1.6 GB reported 1,551 MiB, its own ``VmHWM`` 11 MiB). Where there is no
    /proc, ``ru_maxrss`` is what there is (KiB on Linux, bytes on macOS).
    """
    try:
        return status_bytes("self", "VmHWM")["VmHWM"]
    except (OSError, KeyError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def status_bytes(pid: int | str, *names: str) -> dict[str, int]:
    """The sizes ``names`` (``VmRSS``, ``VmHWM``, ``RssAnon``...) of process ``pid`` (or ``"self"``) in bytes,
    from ``/proc/PID/status``; those it does not list are left out.

    Raises:
        OSError: no such process, or no /proc.
    """
    fields = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in names:
                fields[name] = int(value.split()[0]) * 1024  # kB
    return fields


class RssSampler:
    """Samples VmRSS, RssAnon and RssFile of one process every ``interval`` seconds on a thread."""

    def __init__(self, pid: int, interval: float = RSS_INTERVAL) -> None:
        self._pid = pid
        self._interval = interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._start = time.monotonic()

    def read(self) -> dict[str, float]:
        """One sample now: seconds since start and the three sizes in bytes."""
        fields = status_bytes(self._pid, "VmRSS", "RssAnon", "RssFile")
        return {"t": round(time.monotonic() - self._start, 2), "rss": fields["VmRSS"],
                "anon": fields["RssAnon"], "file": fields["RssFile"]}

    def start(self) -> None:
        """Start sampling on the thread (the clock restarts)."""
        self._start = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling; ``samples`` holds what was taken."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.read())
            self._stop.wait(self._interval)

    def peaks(self) -> dict[str, int]:
        """The first sample's sizes (``*_start``) and the largest of each over all samples, in bytes."""
        if not self.samples:
            raise ValueError("RssSampler.peaks: no sample was taken (start() it first)")
        first = self.samples[0]
        return {**{f"{k}_start": int(first[k]) for k in ("rss", "anon", "file")},
                **{f"{k}_peak": int(max(s[k] for s in self.samples)) for k in ("rss", "anon", "file")}}
