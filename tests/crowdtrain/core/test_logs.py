import json
import logging

from crowdtrain.core.logs import TEXT_FORMAT, JsonFormatter, TextFormatter, ids


def test_json_lines_carry_the_domain_ids() -> None:
    record = logging.LogRecord(
        "crowdtrain.server.services.dispatch", logging.INFO, __file__, 1, "assignment %s: sent", (7,), None
    )
    for k, v in ids(job_id=3, assignment_id=7, host_id=None).items():
        setattr(record, k, v)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "assignment 7: sent"
    assert (line["job_id"], line["assignment_id"]) == (3, 7)
    assert "host_id" not in line and line["level"] == "INFO"


def test_text_lines_cannot_be_forged_by_client_text() -> None:
    forged = (
        "alice\n2024-01-01 00:00:00 INFO crowdtrain.server.ledger.assignments: assignment 9: result uploaded"
        "\r\x1b[2J\u2028"
    )
    record = logging.LogRecord(
        "crowdtrain.server.services.hosts", logging.INFO, __file__, 1, "host %s registered", (forged,), None
    )
    line = TextFormatter(TEXT_FORMAT).format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line
    assert line.endswith(
        "host alice\\n2024-01-01 00:00:00 INFO crowdtrain.server.ledger.assignments: assignment 9: result uploaded"
        "\\r\\x1b[2J\\u2028 registered"
    )


def test_json_timestamps_are_utc_with_an_offset() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", (), None)
    record.created = 0.0
    assert json.loads(JsonFormatter().format(record))["ts"] == "1970-01-01T00:00:00.000+00:00"
