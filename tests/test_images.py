"""The Dockerfiles: what each image installs and builds on, where its wheels come from, and that it
copies every package folder that .dockerignore lets through.

No Docker engine is needed: the Dockerfiles are read as text.
"""

import re
import tomllib
from pathlib import Path

import pytest

from tests.compose_files import ROOT, dockerfile_entrypoint


def _pip_installs(dockerfile: Path) -> list[str]:
    text = dockerfile.read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if line.startswith("RUN") and "pip install" in line]


def test_the_client_image_installs_the_client_extra_only() -> None:
    installs = " ".join(_pip_installs(ROOT / "Dockerfile.client"))
    assert '".[${CLIENT_EXTRAS}]"' in installs and _args(ROOT / "Dockerfile.client")["CLIENT_EXTRAS"] == "client"
    assert "[server]" not in installs and "[dev]" not in installs
    assert dockerfile_entrypoint(ROOT / "Dockerfile.client") == ["crowdtrain"]


def test_the_server_image_installs_the_server_tensorflow_and_data_extras() -> None:
    # Parameter servers evaluate TensorFlow jobs and Keras JSON models with TensorFlow; the scheduler
    # reads every dataset format at submission.
    installs = " ".join(_pip_installs(ROOT / "Dockerfile"))
    assert ".[server,tensorflow,data]" in installs and "[dev]" not in installs


def _args(dockerfile: Path) -> dict[str, str]:
    """The build arguments a Dockerfile declares, with their defaults."""
    args = {}
    for line in dockerfile.read_text().splitlines():
        if line.startswith("ARG "):
            name, _, default = line.removeprefix("ARG ").partition("=")
            args[name.strip()] = default.strip()
    return args


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.client"])
def test_images_install_the_makefiles_torch_cpu_build_first(dockerfile: str) -> None:
    pinned = re.search(r"torch==[\w.]+", (ROOT / "Makefile").read_text()).group()
    installs = _pip_installs(ROOT / dockerfile)
    assert pinned in installs[0] and '--index-url "$TORCH_INDEX_URL"' in installs[0], installs
    # Production builds take the CPU-only build from PyTorch's index unless told otherwise.
    assert _args(ROOT / dockerfile)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.client"])
def test_images_build_on_the_official_python_image_unless_told_otherwise(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    assert _args(ROOT / dockerfile)["BASE_IMAGE"] == "python:3.11-slim"
    froms = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
    assert froms and set(froms) == {"${BASE_IMAGE}"}, froms
    # Pip installs into a virtual environment (Debian's own Python refuses system installs, PEP 668),
    # which the image's PATH puts first, so `crowdtrain` and `python` are the environment's.
    assert "python3 -m venv /opt/venv" in text and "PATH=/opt/venv/bin:$PATH" in text


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.client"])
def test_images_take_wheels_from_the_wheelhouse_but_do_not_keep_them(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    assert "COPY wheelhouse /wheelhouse" in text
    assert all("--find-links /wheelhouse" in line for line in _pip_installs(ROOT / dockerfile))
    # The final stage copies the virtual environment alone, not the wheelhouse or the sources.
    final_stage = text.rsplit("\nFROM ", 1)[1]
    assert "COPY --from=build /opt/venv /opt/venv" in final_stage and "wheelhouse" not in final_stage


def test_the_wheelhouse_ships_empty() -> None:
    """Production builds find nothing there: git keeps its README alone."""
    assert (ROOT / "wheelhouse" / "README.md").is_file()
    assert "wheelhouse/*.whl" in (ROOT / ".gitignore").read_text().splitlines()


def test_the_client_image_has_a_tensorflow_variant() -> None:
    assert _args(ROOT / "Dockerfile.client")["CLIENT_EXTRAS"] == "client"
    assert "CLIENT_EXTRAS=client,tensorflow" in (ROOT / "Dockerfile.client").read_text()
    assert "tensorflow" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _copied(dockerfile: Path) -> set[str]:
    """The build-context paths a Dockerfile's COPY instructions take."""
    sources = set()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY") and "--from" not in line:
            args = [a for a in line.split()[1:] if not a.startswith("--")]
            sources.update(a.rstrip("/") for a in args[:-1])
    return sources


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.client"])
def test_each_image_copies_every_package_folder(dockerfile: str) -> None:
    """The wheel is built from every folder of `package-dir`; an image that left one out could not build it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders <= _copied(ROOT / dockerfile)


def test_dockerignore_keeps_what_the_images_copy() -> None:
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for dockerfile in ("Dockerfile", "Dockerfile.client"):
        for source in _copied(ROOT / dockerfile):
            assert source not in ignored, f"{dockerfile} copies {source}, which .dockerignore leaves out"
    assert {".venv", ".git", ".env", "var"} <= ignored
