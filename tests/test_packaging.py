"""What a user installs: one wheel whose every module lives under `crowdtrain.`, laid out in layers
that import one way (.importlinter), and a client extra that runs without the server's packages."""

import ast
import configparser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import BUILD_LOG

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
PACKAGE_DATA: dict[str, list[str]] = PYPROJECT["tool"]["setuptools"]["package-data"]
SERVER_ONLY = ("fastapi", "sqlalchemy", "celery", "redis", "uvicorn", "alembic", "boto3")
# The version the Makefile pins: any other pulls several GB of CUDA packages.
TORCH = "torch==2.13.0"


def test_the_wheel_installs_one_top_level_name_holding_every_package_folder(built_wheel: Path) -> None:
    with zipfile.ZipFile(built_wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"crowdtrain"}
    # Every package folder of the repository is in the wheel, migrations' revisions included.
    for package, folder in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT / folder)
            assert f"{package.replace('.', '/')}/{rel.as_posix()}" in names, f"{init} is not in the wheel"
    revisions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    assert revisions and all(f"crowdtrain/migrations/versions/{r}" in names for r in revisions)
    # So are the dashboard's pages, styles and script, which the scheduler serves from the package.
    static = sorted(p.name for p in (ROOT / "server" / "api" / "static").iterdir())
    assert static and all(f"crowdtrain/server/api/static/{name}" in names for name in static)


def test_the_wheel_builds_without_a_setuptools_warning(built_wheel: Path) -> None:
    """setuptools warns, in a box on every install, of a folder it packs data from that `packages` does
    not name (the dashboard's static/ was one); the build says no such thing, and the data is packed."""
    log = (built_wheel.parent / BUILD_LOG).read_text()
    assert "Building wheel for crowdtrain" in log, "the build log holds no build output"
    assert "is absent from the `packages` configuration" not in log, log[-4000:]
    assert "SetuptoolsDeprecationWarning" not in log, log[-4000:]
    with zipfile.ZipFile(built_wheel) as zf:
        names = set(zf.namelist())
    static = {f"crowdtrain/server/api/static/{p.name}" for p in (ROOT / "server" / "api" / "static").iterdir()}
    assert static <= names, f"not in the wheel: {sorted(static - names)}"


def test_the_packages_list_names_every_package_folder() -> None:
    """Every folder with an __init__.py, and every folder of data alone that package-data packs from."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {
        ".".join((package, *init.parent.relative_to(ROOT / folder).parts))
        for package, folder in PACKAGE_DIRS.items()
        for init in (ROOT / folder).rglob("__init__.py")
    } | set(PACKAGE_DATA)
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--no-cache", str(ROOT / ".importlinter")],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_import_contract_holds_on_the_installed_layout(installed_tree: Path) -> None:
    """.importlinter's layers, the client's isolation and acyclic packages, checked on the wheel's tree
    (the editable install maps folders with an import hook, which import-linter cannot follow)."""
    done = _lint_imports(installed_tree)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


# One import that breaks each contract of .importlinter (by its section name), appended to a module
# of a copy of the installed tree.
VIOLATIONS = {
    "layers": ("crowdtrain/core/keys.py", "import crowdtrain.server.ledger.models"),
    "client": ("crowdtrain/client/worker.py", "import crowdtrain.server.paramstore.store"),
    "paramstore": ("crowdtrain/server/paramstore/store.py", "import sqlalchemy"),
    "routes": ("crowdtrain/server/api/routes/hosts.py", "import crowdtrain.server.ledger.models"),
    "acyclic": ("crowdtrain/sim/hosts.py", "import crowdtrain.sim.training"),
}


def test_each_import_contract_fails_on_a_deliberate_violation(installed_tree: Path, tmp_path: Path) -> None:
    """The contracts are not vacuous: with one violating import per contract, lint-imports reports
    every contract broken, each by its name."""
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    names = {
        section.removeprefix("importlinter:contract:"): config[section]["name"]
        for section in config.sections()
        if section.startswith("importlinter:contract:")
    }
    assert set(names) == set(VIOLATIONS), "every contract needs a violation here"
    tree = tmp_path / "tree"
    shutil.copytree(installed_tree, tree)
    for module, line in VIOLATIONS.values():
        with (tree / module).open("a") as f:
            f.write(f"\n{line}\n")
    done = _lint_imports(tree)
    assert done.returncode != 0
    report = " ".join(done.stdout.split())  # long names are wrapped to the terminal's width
    for contract, name in names.items():
        assert f"{' '.join(name.split())} BROKEN" in report, f"{contract}: not reported broken\n{done.stdout[-4000:]}"


def _imports_in_functions(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                if any(n == "crowdtrain" or n.startswith("crowdtrain.") for n in names):
                    yield f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"


def test_no_function_imports_one_of_our_modules() -> None:
    """Layers import downward at the top of a module; an import hidden in a function is how a cycle
    used to be dodged. (Optional third-party frameworks may still be imported lazily.)"""
    found = [
        hit
        for folder in PACKAGE_DIRS.values()
        for path in sorted((ROOT / folder).rglob("*.py"))
        for hit in _imports_in_functions(path)
    ]
    assert found == []


def link_distribution(name: str, into: Path, linked: set[str] | None = None) -> set[str]:
    """Symlink the installed distribution `name` and those it requires (extras aside), files and
    metadata, into the folder `into`: a path entry that holds them and nothing else. Returns the
    distributions linked."""
    linked = set() if linked is None else linked
    dist = importlib.metadata.distribution(name)
    key = canonicalize_name(dist.metadata["Name"])
    if key in linked:
        return linked
    linked.add(key)
    for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:  # ".." : scripts in bin/
        source, target = Path(str(dist.locate_file(top))), into / top
        if source.exists() and not target.exists():
            target.symlink_to(source)
    for requirement in map(Requirement, dist.requires or []):
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            link_distribution(requirement.name, into, linked)
    return linked


@pytest.mark.integration
def test_the_client_extra_runs_the_client_without_the_server_packages(built_wheel: Path, tmp_path: Path) -> None:
    """`pip install 'crowdtrain[client]'` in a fresh venv: the client imports and its CLI answers, and none
    of the server's packages is there."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # torch comes from this suite's own environment, linked in with what it requires (pip sees it
    # installed and keeps it): unpacking its wheel again is most of an install's time and says nothing
    # about which packages the client extra brings. Everything else the extra needs is installed here.
    reused = tmp_path / "reused"
    reused.mkdir()
    link_distribution("torch", reused)
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    (site / "reused-torch.pth").write_text(f"{reused}\n")
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "--disable-pip-version-check",
            TORCH,
            f"{built_wheel}[client]",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert not (site / "torch").exists(), "torch was installed again instead of reused"
    probe = (
        "import importlib.util, sys\n"
        f"absent = [m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is not None]\n"
        "assert not absent, f'server packages installed: {absent}'\n"
        "import crowdtrain.client.worker, crowdtrain.client.trainers.pytorch\n"
        "print('client ok')\n"
    )
    done = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "client ok" in done.stdout, done.stderr[-3000:]
    for args in (["--help"], ["client", "--help"]):
        done = subprocess.run(
            [str(env_dir / "bin" / "crowdtrain"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"crowdtrain {' '.join(args)}: {done.stderr[-3000:]}"
    assert "--join-token" in done.stdout or "--server" in done.stdout
    completion = {"_CROWDTRAIN_COMPLETE": "complete_bash", "COMP_WORDS": "crowdtrain ", "COMP_CWORD": "1"}
    done = subprocess.run(
        [str(env_dir / "bin" / "crowdtrain")],
        env={**os.environ, **completion},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "client" in done.stdout.split(), f"completion: {done.stderr[-3000:]}"
