"""What ``attnstore bench gpu`` carries to a lent GPU machine: wheels of the packages its image lacks, model
folders and a little data, and the size check that keeps the whole carry under the device tool's limit.

A lent machine starts bare and reaches no package registry. Its image already has torch, transformers,
sentence-transformers, grpcio, protobuf, pytest, hypothesis, httpx and onnxruntime (docs/BENCHMARKS.md, "GPU");
what the project needs beyond them travels as wheels for CPython 3.12 manylinux, pinned to the versions of the
environment that prepares them. The working tree and every ignored file carried beside it must fit in
``CARRY_LIMIT`` together.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from attnstore.errors import ConfigError

CARRY_LIMIT = 64 * 1024 * 1024  # bytes: the working tree plus the ignored paths a `run` call carries
PYTHON_VERSION = "3.12"  # the lent machines' Python
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# Distributions the lent image lacks, with why the project needs each (dependencies of dependencies included).
MISSING: dict[str, str] = {
    "faiss-cpu": "the daemon's vector indexes",
    "lmdb": "the on-disk store",
    "zarr": "the store's zarr layout",
    "donfig": "zarr's configuration",
    "google-crc32c": "zarr's checksums",
    "numcodecs": "the store's codecs",
    "crc32c": "the wire's frame checksums",
    "redis": "the Redis backend (imported by the store package)",
    "PyJWT": "redis's dependency",
    "grpcio-health-checking": "the daemon's health service",
    "grpcio-reflection": "the daemon's reflection service",
    "starlette": "attnstore node's app",
    "uvicorn": "attnstore node's server",
    "httptools": "uvicorn's HTTP parser",
}
# Distributions the image has, carried too and installed only where its version is older than the generated
# stubs need (the gRPC stubs refuse an older grpcio, the protobuf ones an older protobuf).
AT_LEAST: dict[str, str] = {
    "grpcio": "the gRPC stubs need at least the version they were generated with",
    "protobuf": "the protobuf stubs need at least the version they were generated with",
}


@dataclass(frozen=True, slots=True)
class CarriedSize:
    """The bytes a `run` call carries: the working tree and the ignored folder beside it."""

    tree_bytes: int  # tracked files and untracked files git does not ignore
    carried_bytes: int  # the ignored folder (wheels, models, data)
    limit_bytes: int = CARRY_LIMIT

    @property
    def total_bytes(self) -> int:
        return self.tree_bytes + self.carried_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.limit_bytes

    def to_json_dict(self) -> dict[str, object]:
        return {"tree_bytes": self.tree_bytes, "carried_bytes": self.carried_bytes, "total_bytes": self.total_bytes,
                "limit_bytes": self.limit_bytes, "fits": self.fits}

    def line(self) -> str:
        """One line for the output: the sizes in MiB and whether they fit."""
        mib = 1024 * 1024
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return (f"carried: {self.total_bytes / mib:.1f} MiB (working tree {self.tree_bytes / mib:.1f} MiB + "
                f"carried folder {self.carried_bytes / mib:.1f} MiB) of {self.limit_bytes / mib:.0f} MiB: {verdict}")


def folder_bytes(folder: Path) -> int:
    """The bytes of every plain file under ``folder`` (links not followed); 0 when it does not exist."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
    return total


def tree_bytes(repo: Path) -> int:
    """The bytes of the working tree as the device tool copies it: tracked files and untracked ones git does not
    ignore. Without git (a copy that is not a checkout), every file outside ``.git``.
    """
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                                capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return folder_bytes(repo) - folder_bytes(repo / ".git")
    names = {name for name in listed.decode("utf-8", "surrogateescape").split("\0") if name}
    paths = (repo / name for name in names)
    return sum(path.stat().st_size for path in paths if path.is_file() and not path.is_symlink())


def carried_size(repo: Path, carried: Path, *, limit: int = CARRY_LIMIT) -> CarriedSize:
    """The working tree's and the carried folder's sizes."""
    return CarriedSize(tree_bytes(repo), folder_bytes(carried), limit)


def python_tag(version: str) -> str:
    """``"3.12"`` -> ``"cp312"``.

    Raises:
        ConfigError: not MAJOR.MINOR.
    """
    major, _, minor = version.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ConfigError(f"bench gpu: --python {version!r} is not MAJOR.MINOR (such as {PYTHON_VERSION})")
    return f"cp{major}{minor}"


def pinned(names: Iterable[str]) -> list[str]:
    """``NAME==VERSION`` for each distribution, at the version installed here.

    Raises:
        ConfigError: one is not installed here (install the project's dependencies first).
    """
    requirements = []
    for name in names:
        try:
            requirements.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(f"bench gpu --prepare: {name!r} is not installed here; install the project first "
                              "(bash scripts/install.sh)") from None
    return requirements


def download_command(requirement: str, dest: Path, python_version: str) -> list[str]:
    """The ``pip download`` of one binary wheel for CPython ``python_version`` on manylinux x86-64, no deps."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(dest), requirement]


def download_wheels(dest: Path, python_version: str = PYTHON_VERSION,
                    names: Sequence[str] = (*MISSING, *AT_LEAST)) -> list[Path]:
    """Download the wheels of ``names`` (pinned to this environment's versions) into ``dest``, emptied first.

    Returns:
        The wheel files.

    Raises:
        ConfigError: a distribution is not installed here, or has no such wheel.
    """
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for requirement in pinned(names):
        done = subprocess.run(download_command(requirement, dest, python_version), capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise ConfigError(f"bench gpu --prepare: no CPython {python_version} manylinux wheel of {requirement}: "
                              f"{done.stderr.strip().splitlines()[-1:] or done.returncode}")
    return sorted(dest.glob("*.whl"))


def wheel_name_version(wheel: Path) -> tuple[str, str]:
    """A wheel file's distribution name (normalised: lower case, ``-``) and version."""
    name, version = wheel.name.split("-")[:2]
    return name.replace("_", "-").lower(), version


def release(version: str) -> tuple[int, ...]:
    """A version's release numbers, ``"7.36.2rc1"`` -> ``(7, 36, 2)``: enough to order the versions compared
    here (pre-release and local tags are ignored)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


def wheels_to_install(wheels: Iterable[Path]) -> list[tuple[Path, str]]:
    """Which carried wheels this environment needs, and why: a distribution it lacks, or (``AT_LEAST``) one it
    has at an older version than the wheel's."""
    at_least = {name.lower() for name in AT_LEAST}
    chosen = []
    for wheel in sorted(wheels):
        name, version = wheel_name_version(wheel)
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            chosen.append((wheel, "not installed"))
            continue
        if name in at_least and release(installed) < release(version):
            chosen.append((wheel, f"installed {installed} < {version}"))
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnstore_tools.bench.gpu_carry WHEEL_DIR``: print the wheels to install, one path a line
    (the reasons go to stderr); gpu_check.sh installs them."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m attnstore_tools.bench.gpu_carry WHEEL_DIR", file=sys.stderr)
        return 2
    for wheel, why in wheels_to_install(Path(args[0]).glob("*.whl")):
        print(f"installing {wheel.name}: {why}", file=sys.stderr)
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
