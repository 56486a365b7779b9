"""An image folder whose last image is a FIFO: the process that decodes the folder blocks on it until
the test writes the image, so a test knows, without a clock, that decoding is under way, which
process does it, and what else is served meanwhile. POSIX only (os.mkfifo); /proc for `holders`."""

import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

import numpy as np
import psutil
import pytest

GUARD_SECONDS = 120  # only a failing test waits this long: nothing here is timed


def write_folder_with_fifo(folder: Path, per_class: int = 5) -> Path:
    """Two classes of small greyscale PNGs, `a` black and `b` white, and `b/zz.png`, a FIFO; returns it."""
    image = pytest.importorskip("PIL.Image")
    for shade, name in enumerate(["a", "b"]):
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            image.fromarray(np.full((12, 10), 255 * shade, dtype=np.uint8)).save(folder / name / f"{i}.png")
    fifo = folder / "b" / "zz.png"
    os.mkfifo(fifo)
    return fifo


def png_bytes(path: Path, size: tuple[int, int] = (10, 12)) -> bytes:
    """A white PNG of `size` (width, height), written to `path` too."""
    image = pytest.importorskip("PIL.Image")
    image.new("L", size, color=255).save(path)
    return path.read_bytes()


@contextmanager
def opened_by_decoder(fifo: Path, work: Future) -> Iterator[BinaryIO]:
    """`fifo` opened for writing, which returns once the decoding process opens it to read (while
    `work`, what makes it decode, is under way). Fails the test if `work` ends first."""
    with ThreadPoolExecutor(1) as opener:
        opening = opener.submit(open, fifo, "wb")
        done, _ = wait([opening, work], timeout=GUARD_SECONDS, return_when=FIRST_COMPLETED)
        if opening not in done:
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # a reader at last: the opener returns
            opening.result().close()
            outcome = work.exception() or work.result() if work.done() else "nothing yet"
            pytest.fail(f"no process opened the image; what made it decode ended with {outcome!r}")
    with opening.result() as pipe:
        yield pipe


def holders(path: Path) -> dict[int, int]:
    """This process and its descendants that have `path` open: pid -> descriptors on it (Linux /proc)."""
    found: dict[int, int] = {}
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        held = sum(_link(fd) == str(path) for fd in _descriptors(process.pid))
        if held:
            found[process.pid] = held
    return found


def _descriptors(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # the process ended meanwhile
        return []


def _link(fd: Path) -> str | None:
    try:
        return os.readlink(fd)
    except OSError:  # closed meanwhile (the listing's own descriptor, for one)
        return None


def release(fifo: Path, pipe: BinaryIO, tmp: Path) -> None:
    """Let the decoding go on: the image becomes a plain PNG for the decoding pass, and the header pass,
    blocked on the FIFO, reads the same bytes from it."""
    data = png_bytes(tmp / "released.png")
    os.replace(tmp / "released.png", fifo)  # before writing: the header pass still holds the FIFO
    pipe.write(data)


def unblock(fifo: Path) -> None:
    """End the wait of a process still blocked opening `fifo` (it reads an empty image); none is fine."""
    with suppress(OSError):  # ENXIO: no process has it open to read
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
