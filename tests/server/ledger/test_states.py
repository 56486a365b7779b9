import ast
from pathlib import Path

import pytest

from crowdtrain.server.ledger import states
from crowdtrain.server.ledger.states import AssignmentStatus as A
from crowdtrain.server.ledger.states import IllegalTransition
from crowdtrain.server.ledger.states import JobStatus as J
from crowdtrain.server.ledger.states import WorkunitStatus as W


class Obj:
    def __init__(self, status: str):
        self.id = 1
        self.status = status


LEGAL = [
    (W.ready, W.in_progress),
    (W.in_progress, W.done),
    (W.in_progress, W.ready),
    (W.in_progress, W.failed),
    (W.ready, W.cancelled),
    (W.in_progress, W.cancelled),
    (W.ready, W.done),  # W_s holds a result of an assignment the ledger had ended (ledger.merges.record_merges)
    (A.in_progress, A.uploaded),
    (A.uploaded, A.merged),
    (A.uploaded, A.rejected),
    (A.in_progress, A.timed_out),
    (A.in_progress, A.abandoned),
    (A.in_progress, A.client_error),
    (A.in_progress, A.superseded),
    (A.uploaded, A.superseded),
    (A.rejected, A.merged),  # the same: W_s holds it after all
    (J.pending, J.running),
    (J.running, J.succeeded),
    (J.running, J.failed),
    (J.running, J.cancelled),
]

ILLEGAL = [
    (W.done, W.ready),
    (W.failed, W.ready),
    (W.ready, W.failed),
    (W.cancelled, W.ready),
    (W.done, W.in_progress),
    (A.merged, A.uploaded),
    (A.merged, A.merged),
    (A.timed_out, A.uploaded),
    (A.in_progress, A.merged),
    (A.rejected, A.uploaded),
    (A.rejected, A.superseded),
    (A.abandoned, A.in_progress),
    (A.superseded, A.merged),
    (A.merged, A.superseded),
    (J.succeeded, J.running),
    (J.cancelled, J.running),
    (J.pending, J.succeeded),
]


@pytest.mark.parametrize(("current", "new"), LEGAL)
def test_legal_transitions_change_the_status(current, new) -> None:
    obj = Obj(current.value)
    states.move(obj, new)
    assert obj.status == new.value


@pytest.mark.parametrize(("current", "new"), ILLEGAL)
def test_illegal_transitions_raise_and_leave_the_status(current, new) -> None:
    obj = Obj(current.value)
    with pytest.raises(IllegalTransition):
        states.move(obj, new)
    assert obj.status == current.value


def test_every_status_appears_in_the_table_or_is_terminal() -> None:
    for enum, table in states.TRANSITIONS.items():
        targets = {s for targets in table.values() for s in targets}
        assert set(enum) == set(table) | targets, enum


REPO = Path(__file__).resolve().parents[3]
PACKAGE_FOLDERS = ("crowdtrain", "server", "assimilator", "workgen", "client", "migrations")
LEDGER = REPO / "server" / "ledger"


SIMULATOR = REPO / "crowdtrain" / "sim"


def _modules_outside_the_ledger() -> list[Path]:
    return sorted(p for folder in PACKAGE_FOLDERS for p in (REPO / folder).rglob("*.py") if LEDGER not in p.parents)


def _imported(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _moves(tree: ast.Module) -> list[int]:
    """Lines that call crowdtrain.server.ledger.states.move, however it was imported."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {alias.asname for alias in node.names if alias.name == "crowdtrain.server.ledger.states"}
        elif isinstance(node, ast.ImportFrom) and node.module == "crowdtrain.server.ledger":
            modules |= {alias.asname or alias.name for alias in node.names if alias.name == "states"}
        elif isinstance(node, ast.ImportFrom) and node.module == "crowdtrain.server.ledger.states":
            functions |= {alias.asname or alias.name for alias in node.names if alias.name == "move"}
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id in functions)
            or (
                isinstance(node.func, ast.Attribute)
                and node.func.attr == "move"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in modules
            )
        )
    ]


def _status_writes(tree: ast.Module) -> list[int]:
    """Lines that set a `status` attribute (other than an object's own `self.status`) or pass
    `status=` to an UPDATE's values()."""
    lines = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AugAssign | ast.AnnAssign)
            else []
        )
        for target in targets:
            for t in ast.walk(target):
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr == "status"
                    and isinstance(t.ctx, ast.Store)
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                ):
                    lines.append(t.lineno)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "values"
            and any(k.arg == "status" for k in node.keywords)
        ):
            lines.append(node.lineno)
    return lines


def test_statuses_change_only_in_the_ledger() -> None:
    """No module outside crowdtrain.server.ledger uses the transition table's `move`, or writes the
    status of a ledger row itself: every life-cycle procedure is the ledger's. The simulator moves its
    own in-memory records (never a ledger row) by the same table, and only by it."""
    modules = _modules_outside_the_ledger()
    assert len(modules) > 50, "the scan must see the source tree"
    offenders = []
    for path in modules:
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(REPO)
        if SIMULATOR not in path.parents:
            offenders += [f"{where}:{line}: calls states.move" for line in _moves(tree)]
        else:
            offenders += [f"{where}:{line}: writes a status besides the table" for line in _status_writes(tree)]
        if any(name.startswith("crowdtrain.server.ledger.models") for name in _imported(tree)):
            offenders += [f"{where}:{line}: writes a status" for line in _status_writes(tree)]
    assert offenders == []
