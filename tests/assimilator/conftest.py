"""Fixtures of the parameter server's tests: the merge's services on a real SQLite ledger, file
storage and a private Redis."""

import pytest

from crowdtrain.assimilator.merge import MergeServices
from crowdtrain.core.storage import open_storage
from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger.db import session_factory


@pytest.fixture
def services(sqlite_url, private_redis, tmp_path) -> MergeServices:
    upgrade(sqlite_url)
    return MergeServices(
        session_factory(sqlite_url), open_storage((tmp_path / "storage").as_uri()), private_redis, snapshots_kept=3
    )
