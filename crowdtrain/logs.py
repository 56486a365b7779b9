"""Log set-up: human-readable lines, or one JSON object per line with the ids of what it is about.

Lifecycle log calls pass `extra=ids(job_id=..., assignment_id=...)`; the JSON format makes those
fields, so a log pipeline can follow one workunit or assignment across every process.
"""

import json
import logging
import sys

ID_FIELDS = ("job_id", "epoch", "workunit_id", "assignment_id", "host_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def ids(**fields: int | None) -> dict:
    """`extra=` for a log call: the domain ids it concerns."""
    return {k: v for k, v in fields.items() if v is not None}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        out.update({k: getattr(record, k) for k in ID_FIELDS if hasattr(record, k)})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
