"""A host scripted over the HTTP API, for tests and benchmarks that need to upload exactly what they choose."""

import time

import httpx
import numpy as np

from crowdtrain.core.tensors import Params, decode, decode_shard, encode


class ScriptedHost:
    """Registers with the cluster's join token (under a volunteer `account`, if given), asks for work,
    reads snapshots and shards, and uploads results; every request from `local_address` if given (hosts
    on one machine bound to 127.0.1.1, 127.0.2.1, .. count as separate networks)."""

    def __init__(self, url: str, join_token: str, name: str, account: str = "", local_address: str = ""):
        self.http = httpx.Client(
            base_url=url,
            timeout=60,
            transport=httpx.HTTPTransport(local_address=local_address) if local_address else None,
        )
        resp = self.http.post("/v1/hosts", json={"join_token": join_token, "name": name, "account": account})
        assert resp.status_code == 201, resp.text
        registered = resp.json()
        self.host_id: int = registered["host_id"]
        self.http.headers["Authorization"] = f"Bearer {registered['host_token']}"

    def ask(self, slots: int = 1) -> list[dict]:
        """One request for work: the assignments given (none when there is nothing for this host)."""
        resp = self.http.post("/v1/work", json={"free_slots": slots})
        assert resp.status_code == 200, resp.text
        return resp.json()["assignments"]

    def next_assignment(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            given = self.ask()
            if given:
                return given[0]
            time.sleep(0.5)
        raise AssertionError(f"no work within {timeout}s")

    def _get(self, url: str) -> bytes:
        resp = self.http.get(url)
        assert resp.status_code == 200, resp.text
        return resp.content

    def snapshot(self, assignment: dict) -> Params:
        return decode(self._get(assignment["snapshot"]["url"]))

    def shard(self, assignment: dict) -> tuple[np.ndarray, np.ndarray]:
        """The assignment's training examples and labels, as the client reads them."""
        return decode_shard(self._get(assignment["shard"]["url"]))

    def upload(self, assignment: dict, params: Params, metrics: dict | None = None) -> httpx.Response:
        """PUT W_c (a job whose upload is `weights`), with the metrics a client reports (train_loss,
        examples, seconds) if given."""
        return self.http.put(
            f"/v1/assignments/{assignment['assignment_id']}/result", content=encode(params), params=metrics or {}
        )
