"""A job's dataset, from whichever source its spec names, checked and dealt to shards before
anything is stored: the one place that picks the loader of a `dataset.source`.

Uploaded datasets (`FORMAT:sha256:HEX`) are read from the scheduler's object storage; paths from the
scheduler's disk. Tables (csv, parquet) are dealt in a streaming pass into files under `scratch`;
an image folder is decoded by a child process into a file there (crowdtrain.workgen.image_decoding);
the other sources are read into memory.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crowdtrain.core import keys
from crowdtrain.core.datasetspec import FOLDER_FORMATS, TABLE_FORMATS, DatasetSpec
from crowdtrain.core.storage import ObjectNotFound, Storage
from crowdtrain.workgen.datasets import Dataset, deal_shards, load_dataset, make_dataset, validation_rows
from crowdtrain.workgen.folders import FolderArrays, read_hf, unpack_archive
from crowdtrain.workgen.image_decoding import DEFAULT_IMAGE_BOUNDS, ImageBounds, decode_image_folder
from crowdtrain.workgen.read_errors import unreadable_source
from crowdtrain.workgen.tables import stage_table


@dataclass(frozen=True)
class StagedDataset:
    """A checked dataset dealt to shards; `shard(i)` gives shard i's (x, y), one at a time."""

    input_shape: list[int]
    num_classes: int
    label_names: list[str] | None  # class names in index order, recorded in the job
    shard_sizes: list[int]
    shard: Callable[[int], tuple[np.ndarray, np.ndarray]]
    validation: tuple[np.ndarray, np.ndarray]


def _in_memory(data: Dataset, dealt: list[np.ndarray], label_names: list[str] | None) -> StagedDataset:
    return StagedDataset(
        data.input_shape,
        data.num_classes,
        label_names,
        [len(picked) for picked in dealt],
        lambda i: (data.x[dealt[i]], data.y[dealt[i]]),
        (data.x_val, data.y_val),
    )


def _from_folder(arrays: FolderArrays, spec: DatasetSpec, seed: int) -> StagedDataset:
    x, y, x_val, y_val = arrays.x, arrays.y, arrays.x_val, arrays.y_val
    if x_val is None:  # no split of its own: a seeded random pick validates (folders are sorted by class)
        is_val = validation_rows(len(y), spec.validation_fraction, seed)
        x, y, x_val, y_val = x[~is_val], y[~is_val], x[is_val], y[is_val]
    classes = spec.classes or (len(arrays.label_names) if arrays.label_names else None)
    data = make_dataset(x, y, x_val, y_val, classes=classes)
    return _in_memory(data, deal_shards(data.y, spec.subsets, spec.shuffle, seed), arrays.label_names)


def _local_copy(spec: DatasetSpec, storage: Storage, scratch: Path, max_bytes: int) -> Path:
    """Where the dataset the spec names lies on this machine: its path, or the uploaded object
    (unpacked, for a folder)."""
    sha = spec.uploaded_sha256
    if sha is None:
        return Path(spec.path or "")
    key = keys.dataset_key(sha)
    path = storage.local_path(key)
    if path is None:
        path = scratch / "upload"
        try:
            storage.get_file(key, path)
        except ObjectNotFound:
            path = None
    if path is None:
        raise ValueError(
            f"dataset.source: no dataset with sha256 {sha} was uploaded to this scheduler "
            "(`crowdtrain job submit` uploads a local path)"
        )
    if spec.format in FOLDER_FORMATS:
        return unpack_archive(path, scratch / "unpacked", max_bytes)
    return path


def stage_dataset(
    spec: DatasetSpec,
    seed: int,
    storage: Storage,
    scratch: Path,
    max_bytes: int,
    images: ImageBounds = DEFAULT_IMAGE_BOUNDS,
) -> StagedDataset:
    """Load, check and deal the dataset of `spec`; raises ValueError naming the problem.

    `scratch` is an empty folder that must outlive the StagedDataset (tables' shards and decoded images
    are files there); `max_bytes` bounds an unpacked upload, `images` what decoding an image folder may
    cost (pixels, seconds, memory). Nothing is written to storage."""
    try:
        return _stage(spec, seed, storage, scratch, max_bytes, images)
    except OSError as exc:
        raise ValueError(unreadable_source(exc)) from None


def _stage(
    spec: DatasetSpec, seed: int, storage: Storage, scratch: Path, max_bytes: int, images: ImageBounds
) -> StagedDataset:
    if spec.format in ("builtin", "npz") and spec.uploaded_sha256 is None:
        data = load_dataset(spec.source, spec.validation_fraction, spec.classes)
        return _in_memory(data, deal_shards(data.y, spec.subsets, spec.shuffle, seed), spec.label_names)
    path = _local_copy(spec, storage, scratch, max_bytes)
    if spec.format == "npz":
        data = load_dataset(f"npz:{path}", spec.validation_fraction, spec.classes)
        return _in_memory(data, deal_shards(data.y, spec.subsets, spec.shuffle, seed), spec.label_names)
    if spec.format in TABLE_FORMATS:
        parts = stage_table(spec.format, path, spec, seed, scratch)
        return StagedDataset(
            [len(parts.features)],
            parts.num_classes,
            parts.label_names,
            [len(y) for _, y in parts.shards],
            lambda i: (np.asarray(parts.shards[i][0]), parts.shards[i][1]),
            (np.asarray(parts.validation[0]), parts.validation[1]),
        )
    if spec.format == "hf":
        return _from_folder(read_hf(path, spec), spec, seed)
    decoded = scratch / "decoded"
    decoded.mkdir()
    return _from_folder(decode_image_folder(path, spec, decoded, images), spec, seed)
