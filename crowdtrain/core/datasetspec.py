"""The dataset section of a job spec: where the training examples come from, their classes, and how
they are dealt to shards; and how a spec file's relative dataset path becomes an absolute one.

A source is `builtin:mnist1d` or `FORMAT:LOCATION`:

- FORMAT is `npz` (arrays x, y and optionally x_val, y_val), `csv` or `parquet` (a table: feature
  columns and a label column), `hf` (a Hugging Face `datasets` folder written by `save_to_disk`,
  loaded locally, never from a hub) or `images` (a folder with one sub-folder of images per class);
- LOCATION is an absolute path on the scheduler's machine, or `sha256:HEX`: a dataset uploaded to
  the scheduler's object storage (`crowdtrain job submit` uploads a local file or folder and
  rewrites the source so). A folder (hf, images) is uploaded as one tar archive.
"""

import re
from pathlib import Path, PurePath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CLASSES = 100_000
# mnist1d: 4,000 + 1,000 1-D signals of 10 digits; clusters: 6,000 + 1,000 examples of 40 Gaussian clusters in 8
# dimensions, four per class, which no linear model separates (crowdtrain.workgen.datasets.gaussian_clusters)
BUILTIN_SOURCES = ("builtin:mnist1d", "builtin:clusters")
FORMATS = ("npz", "csv", "parquet", "hf", "images")
TABLE_FORMATS = ("csv", "parquet")
FOLDER_FORMATS = ("hf", "images")  # uploaded as a tar archive of the folder
UPLOADED = "sha256:"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MAX_IMAGE_SIDE = 1024


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        ...,
        description="builtin:mnist1d, builtin:clusters, or FORMAT:LOCATION with FORMAT one of npz, csv, parquet, hf "
        "(datasets.save_to_disk), images (a sub-folder per class) and LOCATION an absolute path on the "
        "scheduler's machine or sha256:HEX of a dataset uploaded to the scheduler (`crowdtrain job "
        "submit` uploads a local path and resolves a relative one against the spec file's folder)",
    )
    subsets: int = Field(10, ge=1, le=100_000, description="Number of training shards")
    validation_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="Used when the data has no validation split: npz validates on its last rows, the "
        "other formats on a seeded random pick of rows",
    )
    classes: int | None = Field(
        None,
        ge=2,
        le=MAX_CLASSES,
        description="Number of classes; labels must lie in [0, classes). Default: largest label + 1",
    )
    shuffle: Literal["stratified", "random", "none"] = Field(
        "stratified",
        description="How examples are dealt to shards: shuffled with every class spread evenly "
        "over the shards (stratified), shuffled (random), or contiguous slices (none)",
    )
    reshuffle_each_epoch: bool = Field(False, description="Deal the examples to shards anew for every epoch")
    label_column: str = Field("label", min_length=1, description="csv, parquet, hf: the column of class labels")
    feature_columns: list[str] | None = Field(
        None,
        min_length=1,
        max_length=100_000,
        description="csv, parquet, hf: the feature columns, in order; default every column but the label",
    )
    label_names: list[str] | None = Field(
        None,
        min_length=2,
        max_length=MAX_CLASSES,
        description="The class names in class-index order, for string labels (and image sub-folders). "
        "Default: the names sorted; the scheduler records the order it used in the job",
    )
    image_size: tuple[int, int] = Field((28, 28), description="images: every image is resized to [height, width]")
    image_mode: Literal["L", "RGB"] = Field("RGB", description="images: grey (L, one channel) or RGB (three)")

    @model_validator(mode="after")
    def _known_source(self) -> "DatasetSpec":
        if self.source in BUILTIN_SOURCES:
            return self
        fmt, _, location = self.source.partition(":")
        if fmt not in FORMATS or not location:
            raise ValueError(
                f"dataset.source must be 'builtin:mnist1d', 'builtin:clusters' or FORMAT:LOCATION with FORMAT one of "
                f"{', '.join(FORMATS)}, got {self.source!r}"
            )
        if location.startswith(UPLOADED):
            if not SHA256_HEX.fullmatch(location[len(UPLOADED) :]):
                raise ValueError(f"dataset.source: {location!r} is not sha256: and 64 lowercase hex digits")
        elif not PurePath(location).is_absolute():
            raise ValueError(
                f"dataset.source: {location!r} is a relative path, but the scheduler reads dataset files "
                "on its own machine: give an absolute path (`crowdtrain job submit` resolves a "
                "relative one against the spec file's folder, and uploads it)"
            )
        return self

    @model_validator(mode="after")
    def _reshuffle_needs_a_shuffle(self) -> "DatasetSpec":
        if self.reshuffle_each_epoch and self.shuffle == "none":
            raise ValueError(
                "dataset.reshuffle_each_epoch needs dataset.shuffle 'stratified' or 'random': "
                "contiguous slices ('none') are the same every epoch"
            )
        return self

    @model_validator(mode="after")
    def _image_size_bounded(self) -> "DatasetSpec":
        if not all(1 <= side <= MAX_IMAGE_SIDE for side in self.image_size):
            raise ValueError(f"dataset.image_size: each side must lie in [1, {MAX_IMAGE_SIDE}], got {self.image_size}")
        return self

    @property
    def format(self) -> str:
        """`builtin`, or one of FORMATS."""
        return self.source.partition(":")[0]

    @property
    def path(self) -> str | None:
        """The dataset's absolute path on the scheduler's machine; None for builtin and uploaded data."""
        location = self.source.partition(":")[2]
        if self.source in BUILTIN_SOURCES or location.startswith(UPLOADED):
            return None
        return location

    @property
    def npz_path(self) -> str | None:
        return self.path if self.format == "npz" else None

    @property
    def uploaded_sha256(self) -> str | None:
        """The hash of the uploaded dataset the source names; None for a path or a builtin."""
        location = self.source.partition(":")[2]
        return location[len(UPLOADED) :] if location.startswith(UPLOADED) else None


def local_source_path(source: object) -> tuple[str, str] | None:
    """(format, path) of a raw source string naming a path (relative or absolute); None otherwise."""
    if not isinstance(source, str) or source in BUILTIN_SOURCES:
        return None
    fmt, _, location = source.partition(":")
    if fmt not in FORMATS or not location or location.startswith(UPLOADED):
        return None
    return fmt, location


def resolve_relative_source(dataset: object, folder: Path) -> str | None:
    """Make a relative `FORMAT:PATH` source of a spec file's raw `dataset` section absolute, against
    `folder` (the spec file's). The note to show the operator when it did; None when there was
    nothing to resolve."""
    if not isinstance(dataset, dict):
        return None
    source = dataset.get("source")
    named = local_source_path(source)
    if named is None or Path(named[1]).is_absolute():
        return None
    resolved = (folder / Path(named[1]).expanduser()).resolve()
    dataset["source"] = f"{named[0]}:{resolved}"
    return f"dataset.source: {source!r} is read relative to the spec file, as {resolved}"
