"""How FedBuff combines its buffered updates, per tensor: pure functions over lists of arrays. No I/O.

`median` and `trimmed_mean` are coordinate-wise, so a few hostile updates move the result little
(Yin et al. 2018, "Byzantine-Robust Distributed Learning"); Flower's FedMedian and FedTrimmedAvg
are the same functions over whole client models.
"""

from collections.abc import Sequence

import numpy as np


def mean(arrays: Sequence[np.ndarray]) -> np.ndarray:
    out: np.ndarray = np.mean(np.stack(arrays), axis=0, dtype=arrays[0].dtype)
    return out


def median(arrays: Sequence[np.ndarray]) -> np.ndarray:
    out: np.ndarray = np.median(np.stack(arrays), axis=0).astype(arrays[0].dtype, copy=False)
    return out


def trimmed_mean(arrays: Sequence[np.ndarray], trim_fraction: float) -> np.ndarray:
    """Per coordinate: drop the floor(trim_fraction·n) smallest and largest values, average the rest."""
    if not 0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    n = len(arrays)
    cut = int(trim_fraction * n)
    ordered = np.sort(np.stack(arrays), axis=0)
    out: np.ndarray = np.mean(ordered[cut : n - cut], axis=0, dtype=arrays[0].dtype)
    return out


def combine(kind: str, arrays: Sequence[np.ndarray], trim_fraction: float = 0.2) -> np.ndarray:
    """The combiner the job spec names (`mean`, `median`, `trimmed-mean`) applied to `arrays`."""
    if not arrays:
        raise ValueError("nothing to combine")
    if kind == "mean":
        return mean(arrays)
    if kind == "median":
        return median(arrays)
    if kind == "trimmed-mean":
        return trimmed_mean(arrays, trim_fraction)
    raise ValueError(f"unknown combiner {kind!r}")
