"""The extra a missing package names comes from the install's own metadata (pyproject.toml's
optional dependencies)."""

import tomllib
from pathlib import Path

from crowdtrain.cli.errors import EXTRA_OF, missing_extra

ROOT = Path(__file__).resolve().parents[3]


def test_each_package_an_extra_requires_names_the_first_extra_listing_it() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert EXTRA_OF["httpx"] == "client" and "httpx>=0.27" in extras["fleet"]  # the client's, listed first
    assert EXTRA_OF["boto3"] == "fleet" and "boto3>=1.34" in extras["server"]
    assert {EXTRA_OF[p] for p in ("sqlalchemy", "celery", "redis", "psycopg", "prometheus_client")} == {"server"}
    assert EXTRA_OF["tensorflow"] == "tensorflow" and EXTRA_OF["pyarrow"] == "data"
    assert "pytest" not in EXTRA_OF  # the dev extra tests the project; no command needs it


def test_a_module_installed_by_another_requirement_names_that_requirements_extra() -> None:
    assert (EXTRA_OF["PIL"], EXTRA_OF["botocore"], EXTRA_OF["keras"]) == ("data", "fleet", "tensorflow")
    assert missing_extra("keras") == (
        "this command needs the tensorflow extra: pip install 'crowdtrain[tensorflow]' (no module named 'keras' here)"
    )
    assert EXTRA_OF["starlette"] == "experts"  # declared by the smallest extra, ahead of the server's fastapi
    assert missing_extra("leftpad") == "this command needs the package 'leftpad' (no module named 'leftpad' here)"
