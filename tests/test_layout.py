"""The tree's shape as DESIGN.md and STYLE.md ask it: modules of at most 500 lines, folders of at most 12."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attnstore", "client", "node", "tools")
GENERATED = ROOT / "attnstore" / "protocol" / "v1"  # the wire stubs, made by scripts/gen_proto.sh
MAX_LINES = 500
MAX_MODULES = 12  # per folder, __init__.py aside


def _modules() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py")) if GENERATED not in p.parents]


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_package_folder_holds_more_than_12_modules():
    counts: dict[Path, int] = {}
    for path in _modules():
        if path.name != "__init__.py":
            counts[path.parent] = counts.get(path.parent, 0) + 1
    crowded = {str(d.relative_to(ROOT)): n for d, n in counts.items() if n > MAX_MODULES}
    assert crowded == {}


def test_every_package_folder_is_listed_for_a_non_editable_install():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    names = {folder: name for name, folder in config["package-dir"].items()}
    found = {names[init.relative_to(ROOT).parts[0]] + "".join("." + part for part in init.relative_to(ROOT).parts[1:-1])
             for package in PACKAGES for init in (ROOT / package).rglob("__init__.py")}
    assert found - set(config["packages"]) == set()
