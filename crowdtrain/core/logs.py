"""Log set-up: human-readable lines, or one JSON object per line with the ids of what it is about.

Lifecycle log calls pass `extra=ids(job_id=..., assignment_id=...)`; the JSON format makes those
fields, so a log pipeline can follow one workunit or assignment across every process.
"""

import json
import logging
import sys
from datetime import UTC, datetime

ID_FIELDS = ("job_id", "epoch", "workunit_id", "assignment_id", "host_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# Control characters (CR, LF, ESC, ...) and the Unicode line separators, as visible escapes: text
# from clients (names, messages, paths) must not start a forged line or drive the terminal.
_ESCAPES = (
    {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F]}
    | {0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
    | {c: f"\\u{c:04x}" for c in (0x85, 0x2028, 0x2029)}
)


def escape(text: str) -> str:
    """`text` on one line: control characters become visible escapes."""
    return text.translate(_ESCAPES)


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT lines whose message is escaped; the traceback after it keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)


def ids(**fields: int | None) -> dict[str, int]:
    """`extra=` for a log call: the domain ids it concerns."""
    return {k: v for k, v in fields.items() if v is not None}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        out = {"ts": ts, "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update({k: getattr(record, k) for k in ID_FIELDS if hasattr(record, k)})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
