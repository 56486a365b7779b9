"""Expert hosts as real processes (`crowdtrain expert-host`) for the tests."""

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from crowdtrain.core.experts import ExpertLayout
from crowdtrain.launch.cluster import Service, free_port, wait_for


def write_layout(directory: Path, layout: ExpertLayout) -> Path:
    path = directory / "layout.json"
    path.write_text(json.dumps(layout.model_dump(mode="json")))
    return path


def start_host(
    directory: Path, name: str, layout: ExpertLayout, uids: Sequence[str] | str = "all"
) -> tuple[Service, str]:
    """A started expert host serving `uids` of `layout`, answering its health check; and its base URL."""
    port = free_port()
    experts = uids if isinstance(uids, str) else ",".join(uids)
    argv = [sys.executable, "-m", "crowdtrain", "expert-host", "--port", str(port), "--experts", experts]
    argv += ["--layout", str(write_layout(directory, layout))]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    service = Service(name, argv, env, directory / f"{name}.log").start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/v1/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 120, f"expert host {name} did not start", service)
    return service, url
