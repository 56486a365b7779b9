"""The README is short and points into the manual; the manual (docs/, mkdocs.yml) builds with
`mkdocs build --strict`, so every link between its pages and every anchor resolves, and the files it
names exist."""

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_BYTES = 12 * 1024


def test_the_readme_is_under_12_kb() -> None:
    size = README.stat().st_size
    assert size < README_MAX_BYTES, f"README.md is {size} bytes; move material into docs/ (limit {README_MAX_BYTES})"


def test_the_readme_shows_the_two_commands_first() -> None:
    text = README.read_text()
    headings = re.findall(r"^## (.*)$", text, flags=re.M)
    assert headings[0] == "Two commands"
    first_block = re.search(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S)
    assert first_block is not None
    assert first_block[1] == "sh"
    assert [line.split("#")[0].strip() for line in first_block[2].splitlines()] == ["make demo", "make test"]
    assert text.index("```") < text.index("## What it is")


def test_the_readme_draws_every_part() -> None:
    text = README.read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S)
    picture = next(block for language, block in blocks if not language and "+--" in block)
    for part in ("scheduler", "parameter servers", "Redis", "database", "object storage", "client"):
        assert part in picture, part
    assert "work generator" in picture
    assert "transitioner" in picture


def test_the_readme_links_resolve_into_the_manual() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    pages = [link for link in links if link.startswith("docs/")]
    assert {"docs/quick-start.md", "docs/operator/troubleshooting.md", "docs/volunteer.md"} <= set(pages)
    for link in links:
        assert (ROOT / link).exists(), f"README.md links to {link}, which does not exist"


def nav_pages(nav: list) -> list[str]:
    out: list[str] = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_the_nav_lists_every_page_of_the_manual() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    assert sorted(pages) == sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert config["strict"] is True
    assert config["validation"]["anchors"] == "warn"  # strict turns each warning into a failure


def test_mkdocs_builds_the_manual_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "operator" / "troubleshooting" / "index.html").is_file()


def test_mkdocs_strict_refuses_a_broken_link(tmp_path: Path) -> None:
    """The build above can fail: a page linking to a missing anchor stops it."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[gone](other.md#nowhere)\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["nav"] = ["index.md", "other.md"]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "nowhere" in done.stdout + done.stderr


def test_the_files_the_manual_names_exist() -> None:
    """Every benchmark script, test file and example the README and the manual name is in the repository."""
    named = {
        path
        for page in [README, *DOCS.rglob("*.md")]
        for path in re.findall(r"\b((?:benchmarks|tests|examples)/[\w./-]+\.(?:py|yaml|json|sh))\b", page.read_text())
    }
    assert "benchmarks/dispatch_throughput.py" in named
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"the manual names files that do not exist: {missing}"


def test_every_benchmark_figure_has_its_command_machine_and_date() -> None:
    page = (DOCS / "benchmarks.md").read_text()
    table = page.split("| figures | command | machine | date | where |", 1)[1].split("\n\n", 1)[0]
    rows = [row.split(" | ") for row in table.strip().splitlines()[1:]]
    assert len(rows) >= 10
    for figures, command, machine, date, where in rows:
        assert command.strip() and machine.strip(), figures
        assert re.search(r"\b2\d{3}-\d{2}-\d{2}\b", date), f"{figures}: no date"
        assert re.search(r"\]\([\w/.-]*(#[\w-]+)?\)", where), f"{figures}: no page"
