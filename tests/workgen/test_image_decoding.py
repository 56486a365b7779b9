"""crowdtrain.workgen.image_decoding: an image folder is decoded by a child process into files the
caller maps; a child that runs out of its memory bound, or dies, is a ValueError naming the setting
that raises the bound, and leaves only files in its scratch folder."""

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from crowdtrain.core.datasetspec import DatasetSpec
from crowdtrain.workgen.image_decoding import BYTES_SETTING, PROC_STATM, ImageBounds, decode_image_folder
from tests.workgen.blocking_image import GUARD_SECONDS, holders, opened_by_decoder, release, write_folder_with_fifo

image = pytest.importorskip("PIL.Image")
linux = pytest.mark.skipif(not PROC_STATM.exists(), reason="the memory bound and /proc are Linux's")


def spec_of(folder: Path) -> DatasetSpec:
    return DatasetSpec(source=f"images:{folder}", subsets=2, image_size=(6, 5), image_mode="L")


@linux
def test_the_child_decodes_into_files_the_caller_maps(tmp_path) -> None:
    fifo = write_folder_with_fifo(tmp_path / "images")
    (tmp_path / "scratch").mkdir()
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(
            decode_image_folder, tmp_path / "images", spec_of(tmp_path / "images"), tmp_path / "scratch", ImageBounds()
        )
        with opened_by_decoder(fifo, decoding) as pipe:
            assert os.getpid() in holders(fifo) and len(holders(fifo)) == 2  # this process writes, its child reads
            release(fifo, pipe, tmp_path)
        arrays = decoding.result(timeout=GUARD_SECONDS)
    assert isinstance(arrays.x, np.memmap) and arrays.x.shape == (11, 1, 6, 5)
    np.testing.assert_array_equal(arrays.y, [0] * 5 + [1] * 6)
    np.testing.assert_allclose(arrays.x.reshape(11, -1).mean(axis=1), arrays.y)  # `a` black, `b` white
    assert arrays.label_names == ["a", "b"]


@linux
def test_a_decoding_process_that_dies_is_refused_naming_the_memory_bound(tmp_path) -> None:
    """Killed as the kernel's out-of-memory killer would kill it, while it reads an image."""
    fifo = write_folder_with_fifo(tmp_path / "images")
    (tmp_path / "scratch").mkdir()
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(
            decode_image_folder, tmp_path / "images", spec_of(tmp_path / "images"), tmp_path / "scratch", ImageBounds()
        )
        with opened_by_decoder(fifo, decoding):
            (child,) = (pid for pid in holders(fifo) if pid != os.getpid())
            os.kill(child, signal.SIGKILL)
        with pytest.raises(ValueError) as refused:
            decoding.result(timeout=GUARD_SECONDS)
    message = str(refused.value)
    assert "the process decoding its images died (SIGKILL)" in message and BYTES_SETTING in message, message
    assert "resize them" in message, message


@linux
def test_an_image_beyond_the_memory_bound_is_refused_naming_the_setting(tmp_path) -> None:
    """A 3000x3000 RGB image takes 27 MB once decoded, more than the 16 MiB the child may add."""
    for name in ("a", "b"):
        (tmp_path / "images" / name).mkdir(parents=True)
        image.new("RGB", (3000, 3000)).save(tmp_path / "images" / name / "0.png")
    (tmp_path / "scratch").mkdir()
    bounds = ImageBounds(max_bytes=16 * 2**20)
    with pytest.raises(ValueError) as refused:
        decode_image_folder(tmp_path / "images", spec_of(tmp_path / "images"), tmp_path / "scratch", bounds)
    message = str(refused.value)
    assert "more than the 16,777,216 bytes of memory" in message and BYTES_SETTING in message, message
