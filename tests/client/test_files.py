"""The client's files are replaced whole (crowdtrain.client.files)."""

import stat

import pytest

from crowdtrain.client.files import replace_file, replacing


def test_a_file_is_replaced_whole_and_no_temporary_file_is_left(tmp_path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    replace_file(path, '{"new": 1}')
    assert path.read_text() == '{"new": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path) -> None:
    path = tmp_path / "journal.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), replacing(path) as tmp:
        tmp.write_bytes(b"half of the new")
        raise RuntimeError("the disk filled up")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["journal.safetensors"]


def test_a_private_file_is_readable_by_its_owner_only(tmp_path) -> None:
    path = tmp_path / "identities.json"
    replace_file(path, b"{}", private=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    replace_file(path, b"{}", private=True)  # and stays so when replaced
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
