"""Files the client keeps (its journal, checkpoints, identities, status, quota, the CPU self-test's
verdict) are replaced whole: written beside the file under a temporary name, then renamed over it in
one step, so that a reader, or the client after a crash, finds the old file or the new one and never a
part of one."""

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` for the caller to write the new file to; on leaving the block it
    replaces `path` in one rename, or, when the block raised, is removed and `path` left as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_file(path: Path, data: bytes | str, private: bool = False) -> None:
    """Replace `path` with `data` (str as UTF-8) in one rename; `private`: readable by its owner only
    (0600) from the moment it is created."""
    raw = data.encode() if isinstance(data, str) else data
    with replacing(path) as tmp, os.fdopen(_created(tmp, 0o600 if private else 0o666), "wb") as f:
        f.write(raw)


def _created(path: Path, mode: int) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
