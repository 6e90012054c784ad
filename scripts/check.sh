#!/usr/bin/env bash
# The static checks CI runs before the tests, each configured in pyproject.toml: ruff (lint and import
# order), mypy (types of attnstore, attnstore_client
# and attnstore_node), import-linter (the architecture's contracts:
# layers, independent store backends, the client's boundary, no import circle) and deptry (every import
# declared, every declared package imported).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
# mypy takes module names from folder names: give the client its import name (see pyproject).
mkdir -p build/typecheck
ln -sfn ../../client build/typecheck/attnstore_client
ln -sfn ../../node build/typecheck/attnstore_node
mypy
lint-imports
deptry .
