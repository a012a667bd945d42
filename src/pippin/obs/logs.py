"""Log formats: `text` (default) and `json` (one JSON object per line).

Structured fields go in ``extra={"fields": {...}}``; the text format appends them as
``key=value``, the JSON format as keys of the object.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

LOG_FORMATS = ("text", "json")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return getattr(record, "fields", None) or {}


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        tail = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        head, sep, rest = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {tail}{sep}{rest}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        body: dict[str, Any] = {
            "time": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


# The last setup_logging call's (level, format): an engine process repeats it.
CURRENT: tuple[str, str] | None = None


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger; uvicorn's loggers propagate to it (log_config=None)."""
    global CURRENT
    CURRENT = (level, fmt)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
