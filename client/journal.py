"""What a client keeps on disk about its running assignments, so that a restart can resume them.

Each running assignment has a journal entry (the assignment as the server sent it, with the heartbeat
interval of the work reply that brought it) and, once
training has run for a while, a checkpoint (model and optimizer state plus the position in the
data). Both are removed when the assignment ends: uploaded, abandoned or failed. A client that
is killed leaves them behind; when it starts again it resumes every assignment whose deadline
has not passed and that the server still wants.
"""

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors.numpy import load_file, save_file

from crowdtrain.client.files import replace_file, replacing
from crowdtrain.core.schemas import AssignmentOut
from crowdtrain.core.tensors import Params

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JournalEntry:
    """An assignment an earlier run left behind, and the seconds between its heartbeats that its work
    reply named (None: an entry written before the journal kept them)."""

    assignment: AssignmentOut
    heartbeat_every: float | None


def _seconds(value: object) -> float | None:
    """A journaled interval, or None when it is missing or not a positive number (the default then)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


class AssignmentJournal:
    """One JSON file per running assignment under `root`, keyed by server URL and assignment id."""

    def __init__(self, root: Path, server_url: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.server_url = server_url

    def _path(self, assignment_id: int) -> Path:
        return self.root / f"{assignment_id}.json"

    def checkpoint_path(self, assignment_id: int, framework: str) -> Path:
        """Per framework: a client restarted with other frameworks must not read another trainer's state."""
        return self.root / f"{assignment_id}.{framework}.checkpoint.safetensors"

    def record(self, a: AssignmentOut, heartbeat_every: float) -> None:
        entry = {"server": self.server_url, "assignment": a.model_dump(mode="json"), "heartbeat_every": heartbeat_every}
        replace_file(self._path(a.assignment_id), json.dumps(entry).encode())

    def forget(self, assignment_id: int) -> None:
        self._path(assignment_id).unlink(missing_ok=True)
        for checkpoint in self.root.glob(f"{assignment_id}.*.checkpoint.safetensors"):
            checkpoint.unlink(missing_ok=True)

    def pending(self) -> list[JournalEntry]:
        """Assignments of this server left behind by an earlier run, oldest first."""
        found = []
        for path in sorted(self.root.glob("*.json")):
            try:
                entry = json.loads(path.read_text())
                if entry["server"] == self.server_url:
                    every = _seconds(entry.get("heartbeat_every"))
                    found.append(JournalEntry(AssignmentOut.model_validate(entry["assignment"]), every))
            except (OSError, ValueError, KeyError) as exc:
                log.warning("ignoring unreadable journal entry %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
        return found


class FileCheckpoint:
    """The trainers' `Checkpoint`: saved every `interval` seconds to one safetensors file.

    The progress dict travels as JSON in the file's metadata; a write replaces the file
    atomically, so a kill during a save leaves the previous checkpoint intact.
    """

    PROGRESS = "crowdtrain.progress"

    def __init__(self, path: Path, interval: float):
        self.path = Path(path)
        self.interval = interval
        self.saves = 0
        self._last = time.monotonic()
        self.resumed: tuple[Params, dict] | None = self._load()

    def _load(self) -> tuple[Params, dict] | None:
        if not self.path.is_file():
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(self.path), framework="numpy") as f:
                progress = json.loads((f.metadata() or {})[self.PROGRESS])
            return load_file(str(self.path)), progress
        except Exception as exc:  # a torn or foreign file: start the assignment over
            log.warning("checkpoint %s unreadable (%s); starting from the snapshot", self.path.name, exc)
            return None

    def due(self) -> bool:
        return self.interval > 0 and time.monotonic() - self._last >= self.interval

    def save(self, tensors: Params, progress: dict) -> None:
        with replacing(self.path) as tmp:
            save_file(tensors, str(tmp), metadata={self.PROGRESS: json.dumps(progress)})
        self.saves += 1
        self._last = time.monotonic()
