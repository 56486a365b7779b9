"""The list of a job's published parameter snapshots, against a real (private) Redis."""

from crowdtrain.core import keys
from crowdtrain.server.ledger import snapshot_list


def test_snapshot_retention_returns_the_versions_beyond_the_newest_few(private_redis) -> None:
    expired = [snapshot_list.note_snapshot(private_redis, 5, v, keep=3) for v in range(6)]
    assert expired == [[], [], [], [0], [1], [2]]
    assert [int(v) for v in private_redis.lrange(keys.snapshots(5), 0, -1)] == [5, 4, 3]
