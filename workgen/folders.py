"""Datasets that are folders: Hugging Face `datasets` written by `save_to_disk` (read with
`datasets.load_from_disk`, locally, never from a hub) and image folders (one sub-folder of images
per class, resized with Pillow); and the safe unpacking of an uploaded folder's tar archive.

A saved dataset is read into memory (a streaming pass is for the tables: crowdtrain.workgen.tables);
an image folder is listed and checked, then decoded one image at a time into a .npy file, in a child
process (crowdtrain.workgen.image_decoding). Every file is bounded before it is decoded.
"""

import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crowdtrain.core.datasetspec import DatasetSpec
from crowdtrain.workgen.datasets import encode_labels
from crowdtrain.workgen.optional import require
from crowdtrain.workgen.read_errors import archive_problem

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
MAX_IMAGES = 1_000_000
MAX_IMAGE_FILE_BYTES = 64 * 1024 * 1024
MAX_IMAGE_PIXELS = 50_000_000  # before decoding: a small file may declare a huge image
MAX_ARCHIVE_MEMBERS = 2_000_000


@dataclass(frozen=True)
class FolderArrays:
    """Examples read from a folder; x_val/y_val are None when it has no validation split."""

    x: np.ndarray
    y: np.ndarray
    x_val: np.ndarray | None
    y_val: np.ndarray | None
    label_names: list[str] | None


def unpack_archive(archive: Path, into: Path, max_bytes: int) -> Path:
    """Unpack an uploaded folder's uncompressed tar archive into `into` and return `into`.

    Refused (ValueError) before anything is written: a compressed or unreadable archive, more than
    MAX_ARCHIVE_MEMBERS members, or members whose sizes add up beyond `max_bytes`. tarfile's `data`
    filter refuses links out of the folder, absolute paths, devices and the like."""
    try:
        with tarfile.open(archive, "r:") as tar:
            members = []
            total = 0
            for member in tar:
                members.append(member)
                total += member.size
                if len(members) > MAX_ARCHIVE_MEMBERS or total > max_bytes:
                    raise ValueError(
                        f"dataset.source: the uploaded folder has more than {MAX_ARCHIVE_MEMBERS:,} files "
                        f"or {max_bytes:,} bytes"
                    )
            tar.extractall(into, members=members, filter="data")
    except (tarfile.TarError, OSError) as exc:
        with archive.open("rb") as f:
            head = f.read(8)
        raise ValueError(f"dataset.source: {archive_problem(str(exc), head)}") from None
    return into


def _column_array(ds: Any, name: str) -> np.ndarray:
    """One column as a numpy array (a list column of equal lengths as one more axis)."""
    values = np.asarray(ds.select_columns([name]).with_format("numpy")[:][name])
    if values.dtype == object and len(values) and isinstance(values[0], np.ndarray):
        raise ValueError(f"dataset {name}: examples differ in shape; every example must have one shape")
    return values


def _hf_examples(
    ds: Any, spec: DatasetSpec, label_names: list[str] | None
) -> tuple[np.ndarray, np.ndarray, list[str] | None]:
    columns = list(ds.column_names)
    if spec.label_column not in columns:
        raise ValueError(f"dataset.label_column: {spec.label_column!r} is not a column of the dataset ({columns[:20]})")
    features = spec.feature_columns or [c for c in columns if c != spec.label_column]
    missing = [c for c in features if c not in columns]
    if missing or not features:
        raise ValueError(f"dataset.feature_columns: {missing[:10] or 'none'} are not columns of the dataset")
    label_feature = ds.features[spec.label_column]
    names = label_names or getattr(label_feature, "names", None)  # a ClassLabel column names its classes
    y, names = encode_labels(_column_array(ds, spec.label_column), names)
    arrays = [_column_array(ds, name) for name in features]
    for name, a in zip(features, arrays, strict=True):
        if a.dtype.kind not in "biuf":
            raise ValueError(f"dataset {name}: a feature column must hold numbers, it holds {a.dtype}")
    x = arrays[0] if len(arrays) == 1 else np.concatenate([a.reshape(len(a), -1) for a in arrays], axis=1)
    if x.ndim == 1:
        x = x.reshape(-1, 1)
    return x, y, names


def read_hf(path: Path, spec: DatasetSpec) -> FolderArrays:
    """A dataset written by `Dataset.save_to_disk` (or a DatasetDict's: its `train` split trains and
    its `validation` or `test` split, if any, validates), read locally."""
    datasets = require("datasets", "hf")
    if not path.is_dir():
        raise ValueError(f"dataset.source: folder {path} does not exist on the scheduler")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - a third party's parser of the operator's files: any failure is theirs
        raise ValueError(f"dataset.source: {path.name} is not a dataset saved with save_to_disk: {exc}") from None
    validation = None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"dataset.source: the saved DatasetDict has no 'train' split ({sorted(loaded)})")
        validation = loaded.get("validation", loaded.get("test"))
        loaded = loaded["train"]
    x, y, names = _hf_examples(loaded, spec, spec.label_names)
    if validation is None:
        return FolderArrays(x, y, None, None, names)
    x_val, y_val, _ = _hf_examples(validation, spec, names)
    return FolderArrays(x, y, x_val, y_val, names)


def _declared_pixels(image_module: Any, files: list[Path]) -> int:
    """The pixels `files` declare in all, from their headers (Pillow's `open` decodes nothing)."""
    total = 0
    for path in files:
        if path.stat().st_size > MAX_IMAGE_FILE_BYTES:
            raise ValueError(f"dataset image {path.name}: larger than {MAX_IMAGE_FILE_BYTES:,} bytes")
        try:
            with image_module.open(path) as im:
                width, height = im.size
        except (OSError, image_module.DecompressionBombError) as exc:
            raise ValueError(f"dataset image {path.name}: cannot be read as an image: {exc}") from None
        total += width * height
    return total


def _check_pixels(image_module: Any, files: list[Path], spec: DatasetSpec, max_pixels: int) -> None:
    """Refuse a folder whose images would cost too much to decode, before one is decoded."""
    total = _declared_pixels(image_module, files)
    if total > max_pixels:
        height, width = spec.image_size
        raise ValueError(
            f"dataset.source: its {len(files):,} images declare {total:,} pixels in all, more than the "
            f"{max_pixels:,} pixels this scheduler decodes for one dataset (CROWDTRAIN_DATASET_MAX_PIXELS). "
            f"Every image is resized to dataset.image_size {height}x{width} anyway: resize them to about "
            "that size before submitting, or ask the operator to raise the bound"
        )


def _read_image(image_module: Any, path: Path, spec: DatasetSpec) -> np.ndarray:
    """One image as float32 in [0, 1], channels first, resized to spec.image_size."""
    if path.stat().st_size > MAX_IMAGE_FILE_BYTES:
        raise ValueError(f"dataset image {path.name}: larger than {MAX_IMAGE_FILE_BYTES:,} bytes")
    try:
        with image_module.open(path) as im:
            width, height = im.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ValueError(
                    f"dataset image {path.name}: {width}x{height} is more than {MAX_IMAGE_PIXELS:,} pixels"
                )
            height_out, width_out = spec.image_size
            pixels = np.asarray(im.convert(spec.image_mode).resize((width_out, height_out)), dtype=np.float32)
    except (OSError, image_module.DecompressionBombError) as exc:
        raise ValueError(f"dataset image {path.name}: cannot be read as an image: {exc}") from None
    pixels = pixels / 255.0
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


@dataclass(frozen=True)
class ImageFolder:
    """An image folder listed and checked, not yet decoded: its image files and each one's class index."""

    files: list[Path]
    labels: list[int]
    label_names: list[str]


def list_image_folder(path: Path, spec: DatasetSpec, max_pixels: int) -> ImageFolder:
    """One sub-folder per class (its name is the class name; classes in `label_names` order, default
    sorted). Refused before any image is decoded when their headers declare more than `max_pixels` in all."""
    image_module = require("PIL.Image", "images")
    if not path.is_dir():
        raise ValueError(f"dataset.source: folder {path} does not exist on the scheduler")
    folders = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    names = spec.label_names or folders
    unknown = sorted(set(folders) - set(names))
    if unknown:
        raise ValueError(f"dataset.source: sub-folders {unknown[:10]} are not among dataset.label_names")
    files: list[Path] = []
    labels: list[int] = []
    for index, name in enumerate(names):
        folder = path / name
        found = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
        if len(files) + len(found) > MAX_IMAGES:
            raise ValueError(f"dataset.source: more than {MAX_IMAGES:,} images")
        files.extend(found)
        labels.extend([index] * len(found))
    if not files:
        raise ValueError(
            f"dataset.source: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in the class sub-folders of {path.name}"
        )
    _check_pixels(image_module, files, spec, max_pixels)
    return ImageFolder(files, labels, names)


def write_images(folder: ImageFolder, spec: DatasetSpec, into: Path) -> None:
    """Decode the folder's images into the .npy file `into`, float32 shaped (images, channels, height,
    width), one image at a time: only one decoded image is held in memory at once."""
    image_module = require("PIL.Image", "images")
    with into.open("wb") as out:
        for i, path in enumerate(folder.files):
            pixels = _read_image(image_module, path, spec)
            if i == 0:  # every image has the shape of the first: one mode, one size
                header = {"descr": "<f4", "fortran_order": False, "shape": (len(folder.files), *pixels.shape)}
                np.lib.format.write_array_header_2_0(out, header)
            out.write(np.ascontiguousarray(pixels, dtype="<f4").tobytes())
