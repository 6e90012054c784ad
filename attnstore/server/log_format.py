"""Log lines for the daemon: ``key=value`` text by default, or one JSON object per line."""

from __future__ import annotations

import json
import logging
from typing import Literal

LogFormat = Literal["text", "json"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            data["traceback"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False)


def use_log_format(log_format: LogFormat) -> None:
    """Make every handler of the root logger write ``log_format``."""
    formatter = JsonLinesFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
