"""What a client keeps about its registration with each scheduler, in `identity.json` in its cache:
the host id, the host token, and the download origins the scheduler named when the host registered
(pinned: a later reply cannot add one; see crowdtrain.client.origins). The file is readable by its owner only.
"""

import json
import os
from pathlib import Path


class Identities:
    def __init__(self, path: Path):
        self.path = Path(path)

    def _read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.is_file() else {}

    def _write(self, ids: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(json.dumps(ids))
        os.replace(tmp, self.path)

    def get(self, server_url: str) -> dict | None:
        """{"host_id", "host_token", "download_origins"} for `server_url`, or None if not registered."""
        return self._read().get(server_url)

    def save(self, server_url: str, host_id: int, host_token: str, download_origins: list[str]) -> dict:
        ids = self._read()
        ids[server_url] = {"host_id": host_id, "host_token": host_token, "download_origins": download_origins}
        self._write(ids)
        return ids[server_url]

    def forget(self, server_url: str) -> None:
        ids = self._read()
        ids.pop(server_url, None)
        self._write(ids)
