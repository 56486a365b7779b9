"""The public page's server-side rendering (crowdtrain.server.api.public_page): the script's formats,
and every value escaped."""

from importlib import resources

import pytest

from crowdtrain.core.schemas_dashboard import HostCredit, ProjectJob, ProjectPublic, Volunteer
from crowdtrain.core.states import JobStatus
from crowdtrain.server.api.public_page import credit, pct, render


@pytest.mark.parametrize(
    ("x", "shown"), [(None, "–"), (0.0, "0"), (1.5, "1.50"), (0.0123, "0.0123"), (100.0, "100"), (12345.6, "12,346")]
)
def test_credit_is_written_as_the_script_writes_it(x, shown) -> None:
    assert credit(x) == shown


def test_every_value_is_escaped() -> None:
    evil = "<script>alert(1)</script>"
    p = ProjectPublic(
        jobs=[
            ProjectJob(
                name=evil,
                status=JobStatus.running,
                current_epoch=2,
                max_epochs=10,
                best_accuracy=0.875,
                results_merged=1234,
                examples=5,
            )
        ],
        volunteers=[Volunteer(name=evil, hosts=1, results_merged=1, results_valid=1, examples=5, credit=0.5)],
        hosts=[HostCredit(host_id=7, account=evil, credit=0.5, results=1)],
        hosts_active=1,
        results_merged=1234,
        examples=5,
        credit=0.5,
    )
    template = (resources.files("crowdtrain.server.api") / "static" / "project.html").read_text(encoding="utf-8")
    page = render(template, p)
    assert evil not in page and page.count("&lt;script&gt;") == 3
    assert f'<td>2 / 10</td><td class="num">{pct(0.875)}</td><td class="num">1,234</td>' in page
    assert 'id="fig-credit">0.500<' in page
