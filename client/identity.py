"""What a client keeps about its registration with each scheduler, in `identity.json` in its cache:
the host id, the host token, the download origins the scheduler named when the host registered
(pinned: a later reply cannot add one; see crowdtrain.client.origins), the project key it trusts
and the jobs it has refused (see crowdtrain.client.trust). The file is readable by its owner only.
"""

import json
from pathlib import Path

from crowdtrain.client.files import replace_file


class Identities:
    def __init__(self, path: Path):
        self.path = Path(path)

    def _read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.is_file() else {}

    def _write(self, ids: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, json.dumps(ids), private=True)

    def get(self, server_url: str) -> dict | None:
        """{"host_id", "host_token", "download_origins", "project_public_key", "refused_jobs"} for
        `server_url` (the last two may be missing), or None if not registered."""
        return self._read().get(server_url)

    def save(
        self,
        server_url: str,
        host_id: int,
        host_token: str,
        download_origins: list[str],
        project_public_key: str | None = None,
        refused_jobs: list[int] | None = None,
    ) -> dict:
        ids = self._read()
        ids[server_url] = {
            "host_id": host_id,
            "host_token": host_token,
            "download_origins": download_origins,
            "project_public_key": project_public_key,
            "refused_jobs": refused_jobs or [],
        }
        self._write(ids)
        return ids[server_url]

    def update(self, server_url: str, **fields: object) -> None:
        """Change fields of a registration (the pinned key, the refused jobs); nothing if not registered."""
        ids = self._read()
        if server_url in ids:
            ids[server_url].update(fields)
            self._write(ids)

    def forget(self, server_url: str) -> None:
        ids = self._read()
        ids.pop(server_url, None)
        self._write(ids)
