"""Decoding an image folder in a short-lived child process, so that the scheduler's CPU and GIL keep
serving requests while a dataset's images are decoded.

The child is a fresh interpreter (`python -m crowdtrain.workgen.image_decoding`: neither a fork of a
threaded server nor a re-run of its main module). It reads what to decode as JSON on stdin, lists
and checks the folder (crowdtrain.workgen.folders: the pixel bound is read from the headers first),
decodes the images one at a time into .npy files in a scratch folder and answers with the class
names as JSON on stdout; the caller maps those files, so no large array crosses a pipe. The child is
bounded: it is killed after `max_seconds` of wall time, and where the OS allows it (Linux) its
address space may grow by at most `max_bytes` beyond what it held at start. A child that is killed,
runs out of memory or dies raises ValueError naming the setting that raises the bound. The child
writes only in the scratch folder, whatever happens.
"""

import logging
import math
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ValidationError

from crowdtrain.core.datasetspec import DatasetSpec
from crowdtrain.workgen.folders import FolderArrays, list_image_folder, write_images
from crowdtrain.workgen.read_errors import unreadable_source

if sys.platform != "win32":  # setrlimit is POSIX's: elsewhere the child is bounded in wall time only
    import resource

log = logging.getLogger(__name__)

SECONDS_SETTING = "CROWDTRAIN_DATASET_DECODE_MAX_SECONDS"
BYTES_SETTING = "CROWDTRAIN_DATASET_DECODE_MAX_BYTES"
IMAGES_FILE = "images.npy"
LABELS_FILE = "labels.npy"
PROC_STATM = Path("/proc/self/statm")  # Linux: the process's address space, in pages, comes first
# -P: the working directory does not come first on the child's sys.path, so nothing there shadows crowdtrain.
CHILD = [sys.executable, "-P", "-m", "crowdtrain.workgen.image_decoding"]


@dataclass(frozen=True)
class ImageBounds:
    """What decoding one image folder may cost (crowdtrain.core.settings: dataset_max_pixels,
    dataset_decode_max_seconds, dataset_decode_max_bytes)."""

    max_pixels: int = 100_000_000  # declared by the images' headers, in all
    max_seconds: float = 120.0  # wall time of the decoding process, its start included
    max_bytes: int = 2 * 1024**3  # address space the decoding process may add; 0: unbounded


DEFAULT_IMAGE_BOUNDS = ImageBounds()  # the settings' defaults


class DecodeRequest(BaseModel):
    """What the child decodes (its stdin): the folder at `path` into the files of folder `into`."""

    path: Path
    spec: DatasetSpec
    into: Path
    bounds: ImageBounds


class DecodeAnswer(BaseModel):
    """What the child answers (its stdout): the class names, or why the folder was refused."""

    label_names: list[str] | None = None
    problem: str | None = None  # the message of the ValueError that refused the folder
    out_of_memory: bool = False


def decode_image_folder(path: Path, spec: DatasetSpec, scratch: Path, bounds: ImageBounds) -> FolderArrays:
    """The image folder at `path` (one sub-folder per class), decoded by a child process into the
    empty folder `scratch`, which must outlive the arrays (x is mapped from a file there).

    Raises ValueError naming the problem when the folder is refused (crowdtrain.workgen.folders),
    when decoding takes longer than `bounds.max_seconds` or more memory than `bounds.max_bytes`, or
    when the child dies; RuntimeError when the child fails on a defect of its own (its traceback is in
    the scheduler's log)."""
    request = DecodeRequest(path=path, spec=spec, into=scratch, bounds=bounds).model_dump_json()
    try:
        # On timeout, run kills the child and waits for it.
        done = subprocess.run(
            CHILD, input=request.encode(), stdout=subprocess.PIPE, timeout=bounds.max_seconds, check=False
        )
    except subprocess.TimeoutExpired:
        log.warning("decoding the images of %s stopped after %g s (%s)", path.name, bounds.max_seconds, SECONDS_SETTING)
        raise ValueError(_too_slow(spec, bounds)) from None
    try:
        answer = DecodeAnswer.model_validate_json(done.stdout)
    except ValidationError:
        raise _without_answer(done.returncode, spec, bounds) from None
    if answer.out_of_memory:
        raise ValueError(_out_of_memory(spec, bounds))
    if answer.problem is not None:
        raise ValueError(answer.problem)
    x = np.load(scratch / IMAGES_FILE, mmap_mode="r")
    return FolderArrays(x, np.load(scratch / LABELS_FILE), None, None, answer.label_names)


def decode(request: DecodeRequest) -> DecodeAnswer:
    """The child's work: bound itself, then list, check and decode the folder."""
    _bound_resources(request.bounds)
    try:
        folder = list_image_folder(request.path, request.spec, request.bounds.max_pixels)
        np.save(request.into / LABELS_FILE, np.array(folder.labels, dtype=np.int64))
        write_images(folder, request.spec, request.into / IMAGES_FILE)
    except ValueError as exc:
        return DecodeAnswer(problem=str(exc))
    except OSError as exc:
        return DecodeAnswer(problem=unreadable_source(exc))
    except MemoryError:  # what was held is freed by now: the answer can still be written
        return DecodeAnswer(out_of_memory=True)
    return DecodeAnswer(label_names=folder.label_names)


def _bound_resources(bounds: ImageBounds) -> None:
    """Bound this (the child's) process: its address space to `max_bytes` beyond what it holds now,
    where /proc says how much that is; its CPU time to just past the wall-time bound, so that a child
    whose scheduler died (and so cannot kill it) still ends."""
    if sys.platform == "win32":
        return
    seconds = math.ceil(bounds.max_seconds) + 1
    _lower_limit(resource.RLIMIT_CPU, seconds)
    if bounds.max_bytes and PROC_STATM.exists():
        held = int(PROC_STATM.read_text().split()[0]) * resource.getpagesize()
        _lower_limit(resource.RLIMIT_AS, held + bounds.max_bytes)


def _lower_limit(kind: int, soft: int) -> None:
    """Set the soft limit `kind` to `soft`, never above the hard limit (which only root may raise)."""
    _, hard = resource.getrlimit(kind)
    resource.setrlimit(kind, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _resize_hint(spec: DatasetSpec) -> str:
    height, width = spec.image_size
    return (
        f"Every image is resized to dataset.image_size {height}x{width} anyway: resize them to about that size "
        "before submitting, or ask the operator to raise the bound"
    )


def _too_slow(spec: DatasetSpec, bounds: ImageBounds) -> str:
    return (
        f"dataset.source: decoding its images took longer than the {bounds.max_seconds:g} s this scheduler "
        f"allows one dataset ({SECONDS_SETTING}), so it was stopped. {_resize_hint(spec)}"
    )


def _out_of_memory(spec: DatasetSpec, bounds: ImageBounds) -> str:
    return (
        f"dataset.source: decoding one of its images needed more than the {bounds.max_bytes:,} bytes of memory "
        f"this scheduler allows it ({BYTES_SETTING}). {_resize_hint(spec)}"
    )


def _without_answer(exitcode: int, spec: DatasetSpec, bounds: ImageBounds) -> Exception:
    """Why a child ended without answering: killed by a signal (out of memory, a crash in an image
    decoder, its CPU bound) is the dataset's problem; an exit of its own is a defect of ours."""
    if exitcode >= 0:
        return RuntimeError(f"the process decoding a dataset's images failed (exit code {exitcode}); see the log")
    try:
        how = signal.Signals(-exitcode).name
    except ValueError:
        how = f"signal {-exitcode}"
    log.warning("the process decoding a dataset's images died (%s)", how)
    return ValueError(
        f"dataset.source: the process decoding its images died ({how}) before it finished: an image it could "
        f"not decode within the {bounds.max_bytes:,} bytes of memory ({BYTES_SETTING}) or "
        f"{bounds.max_seconds:g} s ({SECONDS_SETTING}) this scheduler allows, or one its decoder cannot read. "
        f"{_resize_hint(spec)}"
    )


if __name__ == "__main__":
    sys.stdout.write(decode(DecodeRequest.model_validate_json(sys.stdin.buffer.read())).model_dump_json())
