"""Reading a file of secrets (the daemon's token file, the node's API key file): one reader for both.

A file of secrets should be its owner's alone: a file others may read is read all the
same, with a warning that says how to close it.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

from attnstore.errors import ConfigError


def read_secret_file(path: str | Path, what: str, event: str, log: logging.Logger) -> str:
    """The text of the file of secrets at ``path``; warns on ``log`` when its group or others may use it.

    Args:
        path: the file.
        what: what it is, for the error (``"token file"``, ``"API key file"``).
        event: the warning's event name (``event=NAME path=... mode=...``).
        log: the caller's logger, so the warning is the caller's.

    Raises:
        ConfigError: the file cannot be read (the message names it and why).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("event=%s path=%s mode=%o hint='chmod 600'", event, path, stat.S_IMODE(mode))
    return text
