"""A host scripted over the HTTP API, for tests that need to upload exactly what they choose."""

import time

import httpx

from crowdtrain.core.tensors import Params, decode, encode


class ScriptedHost:
    """Registers with the cluster's join token, asks for work, reads snapshots and uploads results."""

    def __init__(self, url: str, join_token: str, name: str):
        token = httpx.post(f"{url}/v1/hosts", json={"join_token": join_token, "name": name}, timeout=60).json()[
            "host_token"
        ]
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def next_assignment(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            resp = self.http.post("/v1/work", json={"free_slots": 1})
            assert resp.status_code == 200, resp.text
            if resp.json()["assignments"]:
                return resp.json()["assignments"][0]
            time.sleep(0.5)
        raise AssertionError(f"no work within {timeout}s")

    def snapshot(self, assignment: dict) -> Params:
        resp = self.http.get(assignment["snapshot"]["url"])
        assert resp.status_code == 200, resp.text
        return decode(resp.content)

    def upload(self, assignment: dict, params: Params) -> httpx.Response:
        return self.http.put(f"/v1/assignments/{assignment['assignment_id']}/result", content=encode(params))
