"""The client's side of late snapshot binding (scheduling.snapshot_binding "start"): through its own
assignment path (download, verify, train, upload) against a recording HTTP server, a slot that starts
an assignment asks which snapshot to train from, downloads the newer one it is told and trains from it;
when today's download cap cannot take one more snapshot it does not ask, and trains from the one it has."""

import json
from pathlib import Path

import numpy as np
import pytest

import crowdtrain.client.assignment
from crowdtrain.client.assignment import Running
from crowdtrain.client.config import ClientConfig
from crowdtrain.client.preferences import Preferences
from crowdtrain.client.trainers import TrainResult
from crowdtrain.client.trainers import train as real_train
from crowdtrain.client.worker import VolunteerClient
from crowdtrain.core.tensors import Params, decode, encode, sha256
from tests.client.test_optimizer_states import FilesAndUploads, assignment, job_files


class BindingServer(FilesAndUploads):
    """FilesAndUploads that also answers a slot's start with snapshot v3 at /files/snapshot-v3."""

    def __init__(self, files: dict[str, bytes], newer: bytes):
        self.newer = newer
        super().__init__(files | {"/files/snapshot-v3": newer})

    def route(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if method == "POST" and path.endswith("/start"):
            ref = {"url": "/files/snapshot-v3", "sha256": sha256(self.newer), "size": len(self.newer)}
            return 200, json.dumps({"base_version": 3, "snapshot": ref}).encode()
        return super().route(method, path, body)


def _newer(snapshot: bytes) -> bytes:
    """Another snapshot of the same model and size: every parameter moved by 0.5."""
    return encode({name: value + np.float32(0.5) for name, value in decode(snapshot).items()})


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefs: Preferences | None) -> tuple[list, list[Params]]:
    snapshot, shard = job_files()
    newer = _newer(snapshot)
    assert len(newer) == len(snapshot)
    trained_from: list[Params] = []

    def recorded_train(*args, **kwargs) -> TrainResult:
        trained_from.append(args[2])
        return real_train(*args, **kwargs)

    monkeypatch.setattr(crowdtrain.client.assignment, "train", recorded_train)
    server = BindingServer({"/files/snapshot": snapshot, "/files/shard": shard}, newer)
    config = ClientConfig(
        server.url,
        "join",
        cache_dir=tmp_path / "cache",
        checkpoint_seconds=3600,
        frameworks=["pytorch"],
        preferences=prefs,
    )
    volunteer = VolunteerClient(config)
    a = assignment(1, False, snapshot, shard).model_copy(update={"bind_at_start": True})
    try:
        volunteer._work(Running(a))
    finally:
        server.close()
    assert volunteer.completed == 1
    return [(m, p.split("?")[0]) for m, p, _ in server.requests], trained_from


def test_a_slot_trains_from_the_snapshot_the_scheduler_binds_when_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests, trained_from = _run(tmp_path, monkeypatch, None)
    assert requests == [
        ("GET", "/files/snapshot"),
        ("GET", "/files/shard"),
        ("POST", "/v1/assignments/1/start"),
        ("GET", "/files/snapshot-v3"),
        ("PUT", "/v1/assignments/1/result"),
    ]
    snapshot, _ = job_files()
    (params,) = trained_from
    for name, value in decode(_newer(snapshot)).items():
        np.testing.assert_array_equal(params[name], value)


def test_past_the_daily_download_cap_a_slot_trains_from_the_snapshot_it_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cap leaves room for the assignment's own files, not for one more snapshot."""
    snapshot, shard = job_files()
    room = len(snapshot) + len(shard) + len(snapshot) // 2
    requests, trained_from = _run(tmp_path, monkeypatch, Preferences(daily_download_bytes=room))
    assert ("POST", "/v1/assignments/1/start") not in requests
    assert ("GET", "/files/snapshot-v3") not in requests
    (params,) = trained_from
    for name, value in decode(snapshot).items():
        np.testing.assert_array_equal(params[name], value)
