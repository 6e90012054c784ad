"""API keys: the key file, and the check of a request's ``Authorization: Bearer`` header.

Key file: one key per line, optionally after a label (``label key``: the label
names the key in logs, the key never is); blank lines and ``#`` comments are
ignored. Keys are compared in constant time. SIGHUP reloads the file (rotation,
as the daemon's token file): the new keys take over at once, and a file that no
longer parses leaves the previous keys in force. Without a key file the node
serves anyone, and says so at start.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

from attnstore.errors import ConfigError
from attnstore.protocol.secret_file import read_secret_file
from attnstore_node.errors import ApiError

log = logging.getLogger(__name__)

# Shorter keys are guessable; refuse them rather than serve behind them (the daemon's rule for tokens).
MIN_KEY_CHARS = 16


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The keys a node accepts."""

    keys: tuple[bytes, ...]
    source: str = ""  # where they came from, for logs

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is one of the keys (constant time per key)."""
        candidate = key.encode()
        found = False
        for known in self.keys:
            found |= hmac.compare_digest(candidate, known)
        return found


def parse_keys(text: str, source: str = "<string>") -> ApiKeys:
    """Parse key file contents (see the module docstring).

    Raises:
        ConfigError: a line with more than two fields, a key shorter than ``MIN_KEY_CHARS`` or listed twice,
            or no key at all. Messages name the line, never the key.
    """
    keys: list[bytes] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) > 2:
            raise ConfigError(f"{source} line {number}: expected 'key' or 'label key', got {len(fields)} fields")
        key = fields[-1].encode()
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"{source} line {number}: key is shorter than {MIN_KEY_CHARS} characters")
        if key in keys:
            raise ConfigError(f"{source} line {number}: key is listed twice")
        keys.append(key)
    if not keys:
        raise ConfigError(f"{source} holds no key: nobody could call the node (omit --api-key-file to disable keys)")
    return ApiKeys(tuple(keys), source)


def load_keys(path: Path) -> ApiKeys:
    """Read and parse a key file; warn when others may read it.

    Raises:
        ConfigError: the file cannot be read or is malformed (see ``parse_keys``).
    """
    text = read_secret_file(path, "API key file", "key_file_permissions", log)
    return parse_keys(text, str(path))


class KeyCheck:
    """The keys in force (None: no keys, everyone is served); ``reload`` swaps them from their file.

    Args:
        path: the key file, or None to serve without keys.

    Raises:
        ConfigError: the key file cannot be read or is malformed.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.keys = None if path is None else load_keys(path)

    def reload(self) -> None:
        """Read the key file again; on a bad file keep the keys in force (logged)."""
        if self.path is None:
            log.warning("event=reload_ignored reason='no --api-key-file: keys are off'")
            return
        try:
            self.keys = load_keys(self.path)
        except ConfigError as exc:
            log.error("event=key_reload_failed error=%s detail='the previous keys stay in force'", exc)
            return
        log.info("event=keys_reloaded keys=%d", len(self.keys.keys))

    def check(self, authorization: str | None) -> None:
        """Accept a request's ``Authorization`` header value.

        Raises:
            ApiError: 401 when keys are on and the header holds no key, or a wrong one.
        """
        keys = self.keys
        if keys is None:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "You didn't provide an API key: send 'Authorization: Bearer KEY'", "missing_api_key")
        if not keys.accepts(key.strip()):
            raise ApiError(401, "Incorrect API key provided", "invalid_api_key")
