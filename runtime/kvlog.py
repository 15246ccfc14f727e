"""Structured ``event key=value ...`` log lines.

Operators grep runtime logs across dozens of pods; one event name followed by
``key=value`` pairs in a fixed order is both readable and machine-parsable.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "ringwright.runtime"


def format_event(event: str, **fields: object) -> str:
    """``event k1=v1 k2=v2``; values with spaces or quotes are quoted."""
    parts = [event]
    for key, value in fields.items():
        parts.append(f"{key}={_format_value(value)}")
    return " ".join(parts)


def log_event(logger: logging.Logger, level: int, event: str, **fields: object) -> None:
    """Log one structured event at ``level``."""
    if logger.isEnabledFor(level):
        logger.log(level, format_event(event, **fields))


def runtime_logger(name: str) -> logging.Logger:
    """The logger for one runtime component, under a common parent."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}")


def _format_value(value: object) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    if text == "" or any(c in text for c in ' "=\n'):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    return text
