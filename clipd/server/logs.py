"""Logging for ``clipd serve``: text or JSON lines on stderr, and structured events.

``configure(level, fmt)`` sets up the root logger once. ``event(logger, name, **fields)``
logs one structured line: ``aggregation.created aggregation=abc layers=3`` as text, and
``{"ts": ..., "level": "info", "logger": ..., "message": ..., "event": "aggregation.created",
"aggregation": "abc", "layers": 3}`` as JSON. A plain ``log.info(..., extra={"event": name})``
gets its ``event`` key in JSON too.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_BASE_KEYS = ("ts", "level", "logger", "message", "event")
# Record attributes: ``event`` (also set by ``log.info(..., extra={"event": name})``) and event()'s fields.
_EVENT, _FIELDS = "event", "event_fields"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts (UTC, ISO 8601), level, logger, message, and an event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        name = getattr(record, _EVENT, None)
        if name is not None:
            out["event"] = name
            fields = getattr(record, _FIELDS, None)
            for key, value in (fields if isinstance(fields, dict) else {}).items():
                out[f"{key}_" if key in _BASE_KEYS else key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Sends every log record at ``level`` or above to ``stream`` (stderr) as text or JSON lines.

    Replaces the root logger's handlers (calling it again reconfigures). Returns the handler.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    logging.captureWarnings(True)
    return handler


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text == "" or any(c.isspace() or c in '="' for c in text):
        return json.dumps(text)  # quoted, so that the line still splits on spaces
    return text


def event(logger: logging.Logger | str, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Logs the event ``name`` with ``fields``: ``name key=value ...`` as text; its own keys as JSON."""
    if isinstance(logger, str):
        logger = logging.getLogger(logger)
    if not logger.isEnabledFor(level):
        return
    text = " ".join([name, *(f"{key}={_text_value(value)}" for key, value in fields.items())])
    logger.log(level, "%s", text, extra={_EVENT: name, _FIELDS: fields}, stacklevel=2)
