import json
import logging

from crowdtrain.logs import JsonFormatter, ids


def test_json_lines_carry_the_domain_ids() -> None:
    record = logging.LogRecord("server.dispatch", logging.INFO, __file__, 1, "assignment %s: sent", (7,), None)
    for k, v in ids(job_id=3, assignment_id=7, host_id=None).items():
        setattr(record, k, v)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "assignment 7: sent"
    assert (line["job_id"], line["assignment_id"]) == (3, 7)
    assert "host_id" not in line and line["level"] == "INFO"
