#!/usr/bin/env bash
# The static checks CI runs before the tests: ruff (lint and import order) and mypy
# (types of attnstore, attnstore_client and attnstore_node), both configured in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
# mypy takes module names from folder names: give the client its import name (see pyproject).
mkdir -p build/typecheck
ln -sfn ../../client build/typecheck/attnstore_client
ln -sfn ../../node build/typecheck/attnstore_node
mypy
