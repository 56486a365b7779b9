"""Training datasets a job can name: `builtin:mnist1d` (generated locally) and `npz:PATH`."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Dataset:
    x: np.ndarray
    y: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray

    @property
    def input_shape(self) -> list[int]:
        return list(self.x.shape[1:])

    @property
    def num_classes(self) -> int:
        return int(max(self.y.max(), self.y_val.max())) + 1


def _mnist1d() -> Dataset:
    """4,000 train / 1,000 test examples, generated deterministically by the mnist1d package."""
    from mnist1d.data import get_dataset_args, make_dataset

    d = make_dataset(get_dataset_args())
    return Dataset(d["x"].astype(np.float32), d["y"].astype(np.int64),
                   d["x_test"].astype(np.float32), d["y_test"].astype(np.int64))


def _npz(path: Path, validation_fraction: float) -> Dataset:
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    with np.load(path, allow_pickle=False) as f:
        if "x" not in f or "y" not in f:
            raise ValueError(f"{path}: an npz dataset needs arrays 'x' and 'y', it has {sorted(f.files)}")
        x, y = f["x"], f["y"]
        has_val = "x_val" in f and "y_val" in f
        x_val, y_val = (f["x_val"], f["y_val"]) if has_val else (None, None)
    if len(x) != len(y):
        raise ValueError(f"{path}: x has {len(x)} examples but y has {len(y)}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{path}: y must hold integer class labels, it is {y.dtype}")
    if x_val is None:
        n_val = max(1, int(len(x) * validation_fraction))
        x, x_val, y, y_val = x[:-n_val], x[-n_val:], y[:-n_val], y[-n_val:]
    return Dataset(x.astype(np.float32), y.astype(np.int64), x_val.astype(np.float32), y_val.astype(np.int64))


def load_dataset(source: str, validation_fraction: float = 0.2) -> Dataset:
    if source == "builtin:mnist1d":
        return _mnist1d()
    if source.startswith("npz:"):
        return _npz(Path(source[4:]), validation_fraction)
    raise ValueError(f"unknown dataset source {source!r}")


def split_shards(n_examples: int, subsets: int) -> list[slice]:
    """Contiguous, near-equal slices; the first `n % subsets` shards get one extra example."""
    if subsets > n_examples:
        raise ValueError(f"cannot split {n_examples} examples into {subsets} shards")
    bounds = np.linspace(0, n_examples, subsets + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
