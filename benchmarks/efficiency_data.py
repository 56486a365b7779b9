"""The data generators that learning-efficiency task files (benchmarks/tasks/*.yaml) name: a
registry of functions, each deterministic in its `seed`, each returning the arrays x, y, x_val and
y_val of an npz dataset. Not a benchmark of its own: efficiency_tasks.py imports it."""

from collections.abc import Callable

import numpy as np

from crowdtrain.workgen.datasets import gaussian_clusters

Arrays = dict[str, np.ndarray]


def tabular_arrays(
    seed: int = 0,
    n_train: int = 4000,
    n_val: int = 1000,
    classes: int = 5,
    features: int = 24,
    latent: int = 8,
    clusters: int = 8,
    spread: float = 2.5,
    noise: float = 0.2,
) -> Arrays:
    """A `classes`-class tabular task of `n_train` + `n_val` rows and `features` columns: each class
    is a mixture of `clusters` Gaussians in a `latent`-dimensional space, seen through a random linear
    map followed by sin (even features) or tanh (odd features), plus noise. With the defaults (the
    small `tabular` task) one MLP process reaches about 0.91."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, spread, size=(classes, clusters, latent))
    mixing = rng.normal(size=(latent, features)) / np.sqrt(latent)
    freq = rng.uniform(0.5, 1.5, size=features)
    even = np.arange(features) % 2 == 0

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, classes, n)
        h = (means[y, rng.integers(0, clusters, n)] + rng.normal(size=(n, latent))) @ mixing
        x = 2.0 * np.where(even, np.sin(freq * h), np.tanh(h)) + noise * rng.normal(size=(n, features))
        return x.astype(np.float32), y.astype(np.int64)

    x, y = draw(n_train)
    x_val, y_val = draw(n_val)
    return {"x": x, "y": y, "x_val": x_val, "y_val": y_val}


def image_arrays(
    seed: int = 0,
    n_train: int = 50000,
    n_val: int = 5000,
    classes: int = 10,
    size: int = 16,
    coarse: int = 4,
    shift: int = 4,
    noise: float = 1.0,
) -> Arrays:
    """Grey `size` x `size` images (shape (1, size, size)) of `classes` classes: each class has a
    prototype, a `coarse` x `coarse` random field upsampled to `size` x `size`; an image is its class's
    prototype shifted circularly by up to `shift` pixels each way, scaled by a contrast in [0.5, 1.5],
    plus Gaussian noise of standard deviation `noise`. Telling classes apart under the shifts is
    what a convolutional network with pooling does and a linear model does not."""
    rng = np.random.default_rng(seed)
    cell = -(-size // coarse)
    protos = np.kron(rng.normal(size=(classes, coarse, coarse)), np.ones((cell, cell)))[:, :size, :size]
    protos = (protos - protos.mean(axis=(1, 2), keepdims=True)) / protos.std(axis=(1, 2), keepdims=True)
    grid = np.arange(size)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, classes, n)
        dy, dx = rng.integers(-shift, shift + 1, (2, n))
        rows, cols = (grid[None, :] + dy[:, None]) % size, (grid[None, :] + dx[:, None]) % size
        images = protos[y[:, None, None], rows[:, :, None], cols[:, None, :]]
        images = images * rng.uniform(0.5, 1.5, (n, 1, 1)) + noise * rng.normal(size=(n, size, size))
        return images[:, None].astype(np.float32), y.astype(np.int64)

    x, y = draw(n_train)
    x_val, y_val = draw(n_val)
    return {"x": x, "y": y, "x_val": x_val, "y_val": y_val}


def cluster_arrays(
    seed: int, n_train: int = 6000, n_val: int = 1000, dim: int = 8, clusters: int = 40, classes: int = 10
) -> Arrays:
    """Gaussian clusters that no linear model separates (crowdtrain.workgen.datasets.gaussian_clusters,
    the examples of `builtin:clusters`): expert-parallel training's task. `seed` draws the examples."""
    x, y, x_val, y_val = gaussian_clusters(seed, n_train, n_val, dim, clusters, classes)
    return {"x": x, "y": y, "x_val": x_val, "y_val": y_val}


GENERATORS: dict[str, Callable[..., Arrays]] = {
    "tabular": tabular_arrays,
    "images": image_arrays,
    "clusters": cluster_arrays,
}
