"""The web dashboard in a real headless Chromium (Debian's `chromium` and `chromedriver`; Selenium
downloads nothing) against a real cluster training the example job: log in through the form, then the
jobs, job, hosts and public pages show the running job's figures, the charts have points, the job page
has its In flight section and updates without a reload, the public page's HTML has its figures before
any script runs, a DeDLOC job's page shows its rounds, and a screenshot of each page (and of the two
sections) is kept (var/test-artifacts/, or $CROWDTRAIN_TEST_ARTIFACTS)."""

import itertools
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas_jobs import BEST_LABEL
from crowdtrain.launch.cluster import Cluster, wait_for
from tests.conftest import EXAMPLE_SPEC, ROOT
from tests.dedloc_cluster import commits, dedloc_spec, start_peers, submit

pytestmark = pytest.mark.integration
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
MERGES_BEFORE_BROWSING = 3


def artifacts() -> Path:
    folder = Path(os.environ.get("CROWDTRAIN_TEST_ARTIFACTS") or ROOT / "var" / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        if os.environ.get("CI") == "true":
            pytest.fail("chromium and chromedriver must be installed under CI=true (.ci/run installs them)")
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1400"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def merges(cluster: Cluster, job_id: int) -> int:
    with cluster.admin() as http:
        return http.get(f"/v1/jobs/{job_id}").json()["merges"]


def text_of(driver: WebDriver, element_id: str, unless: str = "–", timeout: float = 20) -> str:
    """The element's text once the page's script has filled it in."""
    WebDriverWait(driver, timeout).until(lambda d: d.find_element(By.ID, element_id).text not in ("", unless))
    return driver.find_element(By.ID, element_id).text


def rows(driver: WebDriver, table_id: str, timeout: float = 20) -> list[list[str]]:
    """The table's cells, read in one script call: the page redraws its tables on every poll."""
    read = (
        f"return Array.from(document.querySelectorAll('#{table_id} tbody tr'), "
        "r => Array.from(r.cells, c => c.textContent))"
    )
    WebDriverWait(driver, timeout).until(lambda d: d.execute_script(read))
    return driver.execute_script(read)


def count(driver: WebDriver, selector: str) -> int:
    return driver.execute_script(f"return document.querySelectorAll('{selector}').length")


def screenshot(driver: WebDriver, name: str) -> None:
    path = artifacts() / f"dashboard-{name}.png"
    assert driver.save_screenshot(str(path)), path
    assert path.stat().st_size > 10_000


def section_screenshot(driver: WebDriver, element_id: str, name: str) -> None:
    """A picture of one section of the page, scrolled into view."""
    element = driver.find_element(By.ID, element_id)
    driver.execute_script("arguments[0].scrollIntoView()", element)
    path = artifacts() / f"dashboard-{name}.png"
    assert element.screenshot(str(path)), path
    assert path.stat().st_size > 5_000


def log_in(driver: WebDriver, cluster: Cluster) -> None:
    driver.get(f"{cluster.url}/dashboard/login")
    driver.find_element(By.ID, "token").send_keys(cluster.admin_token)
    driver.find_element(By.ID, "login").click()
    WebDriverWait(driver, 10).until(lambda d: d.current_url.endswith("/dashboard/jobs"))


def test_the_dashboard_shows_a_running_job_live_in_chromium(make_cluster, sqlite_url: str, browser: WebDriver) -> None:
    cluster = make_cluster(sqlite_url)
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    spec["stop"]["target_accuracy"] = 0.999  # out of reach: the job is still running while the pages are read
    job_id = cluster.submit(spec)["job_id"]
    cluster.start_client("alice", 2, "--account", "volunteer-alice")
    wait_for(lambda: merges(cluster, job_id) >= MERGES_BEFORE_BROWSING, 180, "no merges", cluster.clients[0])

    # Operator pages need the login: the form, then a cookie.
    browser.get(f"{cluster.url}/dashboard/jobs")
    assert browser.current_url.endswith("/dashboard/login")
    browser.find_element(By.ID, "token").send_keys("wrong")
    browser.find_element(By.ID, "login").click()
    # The form posts and the page is replaced: read the message of the page that answers, not the old one.
    WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: "wrong admin token" in d.find_element(By.ID, "message").text
    )
    browser.find_element(By.ID, "token").send_keys(cluster.admin_token)
    browser.find_element(By.ID, "login").click()
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith("/dashboard/jobs"))
    assert cluster.admin_token not in browser.current_url
    (session,) = browser.get_cookies()
    assert session["httpOnly"] and session["secure"] and session["sameSite"] == "Strict"
    assert cluster.admin_token not in session["value"]

    (job_row,) = rows(browser, "jobs")
    assert job_row[:4] == [str(job_id), "mnist1d-cnn", "vc-asgd", "running"]
    assert not browser.find_element(By.ID, "health-banner").is_displayed(), "every part is up"
    assert job_row[5].endswith("%")
    screenshot(browser, "jobs")

    browser.execute_script("document.querySelector('#jobs tbody a').click()")  # a link of the table, as clicked
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith(f"/dashboard/jobs/{job_id}"))
    assert text_of(browser, "fig-accuracy").endswith("%")
    first = int(text_of(browser, "fig-merges").replace(",", ""))
    assert first >= MERGES_BEFORE_BROWSING
    for chart in ("chart-time", "chart-examples"):
        # A point is an evaluation, which the parameter server records after its merge: the next poll draws it.
        points = f"#{chart} circle.point"
        WebDriverWait(browser, 60).until(lambda d, points=points: count(d, points) >= MERGES_BEFORE_BROWSING)
        assert count(browser, f"#{chart} rect.band") >= 1, chart
    workunits = {row[0]: int(row[2]) for row in rows(browser, "workunits")}
    assert workunits.get("done", 0) >= MERGES_BEFORE_BROWSING
    assert text_of(browser, "fig-staleness") and text_of(browser, "fig-rate")
    assert rows(browser, "problems")
    # In flight: the running assignments, alice's, each with its age, deadline and expected return.
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "in-flight-section").is_displayed())
    assert not browser.find_element(By.ID, "dedloc-section").is_displayed()
    assert int(text_of(browser, "fl-running").split()[0]) >= 0 and text_of(browser, "fl-median").endswith("s")
    assert text_of(browser, "fl-budget") and text_of(browser, "fl-stragglers") and text_of(browser, "fl-duplicates")
    running = rows(browser, "in-flight", timeout=60)
    assert {r[1] for r in running} == {"alice"}
    assert all(r[4].endswith(" s") and ("(host)" in r[6] or "(job)" in r[6] or "(deadline)" in r[6]) for r in running)
    assert f">{BEST_LABEL}<" in browser.page_source
    # Live: more merges appear without a reload.
    WebDriverWait(browser, 60).until(lambda d: int(d.find_element(By.ID, "fig-merges").text.replace(",", "")) > first)
    time.sleep(0.5)  # let the charts of that poll settle before the picture
    screenshot(browser, "job")
    section_screenshot(browser, "in-flight-section", "job-in-flight")

    browser.find_element(By.LINK_TEXT, "hosts").click()
    (host,) = rows(browser, "hosts")
    assert host[1] == "alice" and host[2] == "cpu" and "pytorch" in host[3]
    assert int(host[6]) >= MERGES_BEFORE_BROWSING and host[11] == "no"
    screenshot(browser, "hosts")

    # The public page comes with its figures: the server's HTML has them before any script runs.
    with httpx.Client(base_url=cluster.url) as http:
        first_paint = http.get("/project").text
    assert 'id="fig-results">–<' not in first_paint and "<td>mnist1d-cnn</td>" in first_paint
    browser.find_element(By.LINK_TEXT, "public page").click()
    (public_job,) = rows(browser, "project-jobs")
    assert public_job[:2] == ["mnist1d-cnn", "running"] and public_job[3].endswith("%")
    (volunteer,) = rows(browser, "volunteers")
    assert volunteer[1] == "volunteer-alice" and int(volunteer[3]) >= MERGES_BEFORE_BROWSING
    assert float(volunteer[6].replace(",", "")) > 0, "merged results earn credit"
    (host_credit,) = rows(browser, "host-credit")
    assert host_credit[1] == "volunteer-alice" and float(host_credit[3].replace(",", "")) > 0
    assert "alice" not in [cell for row in rows(browser, "host-credit") for cell in row[:1]], "no host name"
    assert cluster.admin_token not in browser.page_source and cluster.join_token not in browser.page_source
    screenshot(browser, "project")

    # A kind of process missing shows on the operator's pages.
    cluster.service("transitioner").stop()
    browser.get(f"{cluster.url}/dashboard/jobs")
    WebDriverWait(browser, 30).until(lambda d: "transitioner" in d.find_element(By.ID, "health-banner").text)
    assert browser.find_element(By.ID, "health-banner").is_displayed()
    screenshot(browser, "health-banner")

    # Logging out ends the session in this browser.
    browser.get(f"{cluster.url}/dashboard/jobs")
    browser.find_element(By.ID, "logout").click()
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith("/dashboard/login"))
    browser.get(f"{cluster.url}/dashboard/hosts")
    assert browser.current_url.endswith("/dashboard/login")


def test_the_job_page_of_a_dedloc_job_shows_its_rounds_in_chromium(make_cluster, browser: WebDriver) -> None:
    """Two real peers commit steps; the job page's DeDLOC section counts them, their members and their
    examples against the target batch, and says why a step can exceed it."""
    cluster = make_cluster(assimilator_concurrency=1)
    spec = dedloc_spec(max_steps=50)  # out of reach: still running while the page is read
    job_id = submit(cluster, spec)
    # Each stops at half the target batch: a step needs both peers.
    peers = start_peers(cluster, job_id, 2, "--examples-per-step", str(spec["dedloc"]["target_batch_size"] // 2))
    wait_for(lambda: len(commits(cluster, job_id)) >= 2, 240, "no two steps committed", peers[0])

    log_in(browser, cluster)
    browser.get(f"{cluster.url}/dashboard/jobs/{job_id}")
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "dedloc-section").is_displayed())
    assert not browser.find_element(By.ID, "in-flight-section").is_displayed()
    committed, max_steps = (int(n.replace(",", "")) for n in text_of(browser, "dl-steps").split(" / "))
    assert committed >= 2 and max_steps == 50
    last, seen, _live = (int(n) for n in text_of(browser, "dl-members").split(" / "))
    assert 1 <= last <= seen <= 2
    assert text_of(browser, "dl-round").endswith("s")
    target = spec["dedloc"]["target_batch_size"]
    assert text_of(browser, "dl-target").startswith(f"{target} ")
    steps = rows(browser, "dedloc-steps")
    assert len(steps) >= 2 and all(1 <= int(s[2]) <= 2 and int(s[3]) >= target for s in steps)
    assert [int(s[4]) for s in steps] == [int(s[3]) - target for s in steps]
    caption = browser.find_element(By.ID, "dl-caption").text
    assert "the step closes once the sum of their reports reaches the target" in caption
    screenshot(browser, "dedloc-job")
    section_screenshot(browser, "dedloc-section", "job-dedloc")


def test_artifacts_folder_is_ignored_by_git() -> None:
    """Screenshots land in var/, which git ignores."""
    assert shutil.which("git") is None or "var/" in (ROOT / ".gitignore").read_text().split()


STATIC = ROOT / "server" / "api" / "static"


def test_epoch_labels_of_a_long_job_never_overlap_in_chromium(browser: WebDriver, tmp_path) -> None:
    """The chart of 20, 30 and 40 epochs in 580 px (bands of 29, 19 and 14.5 px; the last two narrower
    than a label such as "e117" or "e23"): each label drawn keeps clear of the one before it, and
    labels are still drawn where they fit. A job's own chart draws the same function."""
    page = tmp_path / "chart.html"
    page.write_text(
        f"<html><head><style>{STATIC.joinpath('dashboard.css').read_text()}</style></head><body>"
        '<svg id="c" class="chart" viewBox="0 0 640 280" width="640" height="280"></svg>'
        f"<script>{STATIC.joinpath('dashboard.js').read_text()}</script></body></html>"
    )
    browser.get(page.as_uri())
    boxes = (
        "const svg = document.getElementById('c');"
        "const pts = []; for (let e = 1; e <= arguments[0]; e++) for (let k = 0; k < 4; k++)"
        "  pts.push({x: (e - 1) * 4 + k, y: 0.5 + e / (2 * arguments[0]), epoch: e + arguments[1]});"
        "lineChart(svg, pts, 'examples', 0.9);"
        "return Array.from(svg.querySelectorAll('.band-label'),"
        "  t => { const b = t.getBBox(); return [b.x, b.width]; });"
    )
    for epochs, first in ((20, 0), (30, 100), (40, 0)):
        drawn = browser.execute_script(boxes, epochs, first)
        assert len(drawn) >= 5, (epochs, first, drawn)
        assert all(w > 0 for _, w in drawn)
        for (x0, w0), (x1, _) in itertools.pairwise(drawn):
            assert x0 + w0 < x1, (epochs, first, drawn)


def test_the_job_page_of_a_moe_job_shows_its_experts_in_chromium(make_cluster, sqlite_url, browser: WebDriver) -> None:
    """Two expert hosts serve a moe job's experts and a client trains its trunk, reporting its calls: the
    job page's Experts section shows every expert served by the two hosts, with their call figures."""
    spec = load_job_spec(ROOT / "examples" / "clusters-moe.yaml").model_dump(mode="json")
    spec["stop"] = {"target_accuracy": 0.999, "max_epochs": 1000}  # out of reach: still running while read
    cluster = make_cluster(sqlite_url)
    job_id = cluster.submit(spec)["job_id"]
    with cluster.admin() as http:
        mixture = http.get(f"/v1/jobs/{job_id}").json()["mixture_id"]
    experts = spec["experts"]["layers"] * spec["experts"]["grid"][0] * spec["experts"]["grid"][1]
    for name in ("host-a", "host-b"):
        cluster.start_expert_host(name, mixture, experts)
    cluster.start_client("trainer", tasks=1)
    wait_for(lambda: merges(cluster, job_id) >= 2, 240, "no two merges", cluster.service("trainer"))

    log_in(browser, cluster)
    browser.get(f"{cluster.url}/dashboard/jobs/{job_id}")
    # Each section shows once its own request is answered, in no set order: the experts', and the in-flight
    # section of its trunk's workunits, as a vc-asgd job's.
    for section in ("experts-section", "in-flight-section"):
        WebDriverWait(browser, 20).until(lambda d, section=section: d.find_element(By.ID, section).is_displayed())
    # (A lease can lapse for a moment on a loaded machine: the page shows it, and the next heartbeat.)
    served = f"{experts} / {experts}"
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "ex-served").text == served)
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "ex-hosts").text == "2")
    assert float(text_of(browser, "ex-rate")) > 0

    # Reported on: at least the k experts of each layer that the first rows were routed to. A report
    # counts for an expert only while the host it names still serves it, so one that moved in a lapse
    # of its lease waits for the trainer's next report (every workunit: the job runs on).
    reported = spec["experts"]["k"] * spec["experts"]["layers"]

    def all_served(driver: WebDriver) -> list[list[str]] | None:
        """The table once every expert has a host whose lease runs ahead, and enough were reported on."""
        table = rows(driver, "experts")
        ok = (
            len(table) == experts
            and all(r[2].startswith("http://127.0.0.1:") and r[3].startswith("in ") for r in table)
            and sum(r[6] != "–" for r in table) >= reported
        )
        return table if ok else None

    WebDriverWait(browser, 120).until(all_served, f"not every expert served, or fewer than {reported} reported on")
    screenshot(browser, "moe-job")
    section_screenshot(browser, "experts-section", "job-experts")
