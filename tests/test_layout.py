"""The tree as an install sees it: every package folder is listed for a non-editable install.

Modules and folders are shaped by concept, not by a size gate (DESIGN.md, fourth wave): no test holds them to a
line or module count.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attnstore", "client", "node", "tools")


def test_every_package_folder_is_listed_for_a_non_editable_install():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    names = {folder: name for name, folder in config["package-dir"].items()}
    found = {names[init.relative_to(ROOT).parts[0]] + "".join("." + part for part in init.relative_to(ROOT).parts[1:-1])
             for package in PACKAGES for init in (ROOT / package).rglob("__init__.py")}
    assert found - set(config["packages"]) == set()
