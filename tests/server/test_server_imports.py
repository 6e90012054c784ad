"""The daemon stays light: serving a store loads no model framework."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import attnstore.server.daemon
print(sorted(m for m in ("torch", "transformers", "safetensors.torch") if m in sys.modules))
"""


def test_the_daemon_imports_neither_torch_nor_transformers() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
