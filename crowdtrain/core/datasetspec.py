"""The dataset section of a job spec: where the training examples come from (`builtin:mnist1d`, or
an npz file on the scheduler's machine), their classes, and how they are dealt to shards; and how a
spec file's relative npz path becomes the absolute one the scheduler reads."""

from pathlib import Path, PurePath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_CLASSES = 100_000


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        ...,
        description="builtin:mnist1d, or npz:PATH with an absolute PATH on the scheduler's "
        "machine (`crowdtrain job submit` resolves a relative one against the "
        "spec file's folder)",
    )
    subsets: int = Field(10, ge=1, le=100_000, description="Number of training shards")
    validation_fraction: float = Field(0.2, gt=0, lt=1, description="Used when the npz has no x_val/y_val")
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

    @model_validator(mode="after")
    def _known_source(self) -> "DatasetSpec":
        if self.source != "builtin:mnist1d" and not self.source.startswith("npz:"):
            raise ValueError(f"dataset.source must be 'builtin:mnist1d' or 'npz:PATH', got {self.source!r}")
        path = self.npz_path
        if path is not None and not PurePath(path).is_absolute():
            raise ValueError(
                f"dataset.source: {path!r} is a relative path, but the scheduler reads dataset files "
                "on its own machine: give an absolute path (`crowdtrain job submit` resolves a "
                "relative one against the spec file's folder)"
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

    @property
    def npz_path(self) -> str | None:
        return self.source[len("npz:") :] if self.source.startswith("npz:") else None


def resolve_relative_source(dataset: object, folder: Path) -> str | None:
    """Make a relative `npz:PATH` source of a spec file's raw `dataset` section absolute, against
    `folder` (the spec file's), since the scheduler reads it on its own machine. The note to show
    the operator when it did; None when there was nothing to resolve."""
    source = dataset.get("source") if isinstance(dataset, dict) else None
    if not (
        isinstance(dataset, dict)
        and isinstance(source, str)
        and source.startswith("npz:")
        and not Path(source[4:]).is_absolute()
    ):
        return None
    resolved = (folder / Path(source[4:]).expanduser()).resolve()
    dataset["source"] = f"npz:{resolved}"
    return (
        f"dataset.source: {source!r} is read relative to the spec file, as {resolved} "
        "(the scheduler reads that path on its own machine)"
    )
