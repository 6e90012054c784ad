"""redis-py loads only with a Redis store: telling a URL from a folder, and the client, import none of it."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import attnstore.server.config, attnstore.store.redis.urls, attnstore_client.connection.daemon
light = "redis" in sys.modules
from attnstore.store.redis.mapstore import RedisMapStore
print(light, "redis" in sys.modules)
"""


def test_store_locations_and_the_client_import_no_redis_until_a_redis_store_is_opened():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "False True"
