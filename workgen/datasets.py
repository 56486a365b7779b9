"""Training datasets held in memory: `builtin:mnist1d` and `builtin:clusters` (generated locally) and
`npz:PATH`, and the
checks and label encoding every source shares (crowdtrain.workgen.staging picks the source).

Every dataset is checked before a job is made of it (`make_dataset`): a problem that would leave
a job stuck or silently wrong (NaN inputs, labels the model has no logit for, validation arrays
that disagree with the training ones) raises ValueError naming the array and the problem.
"""

import importlib.metadata
import os
import tempfile
import zipfile
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from crowdtrain.core.datasetspec import MAX_CLASSES
from crowdtrain.core.settings import Settings, user_cache_dir
from crowdtrain.workgen.read_errors import npz_problem


@dataclass(frozen=True)
class Dataset:
    x: np.ndarray
    y: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    classes: int | None = None  # declared in the spec; else the largest label + 1

    @property
    def input_shape(self) -> list[int]:
        return list(self.x.shape[1:])

    @property
    def num_classes(self) -> int:
        return self.classes or int(max(self.y.max(), self.y_val.max())) + 1


def _check_shapes(x: np.ndarray, y: np.ndarray, x_name: str, y_name: str) -> None:
    if x.dtype.kind not in "biuf":
        raise ValueError(f"dataset {x_name}: must hold numbers, it is {x.dtype}")
    if x.ndim < 2 or 0 in x.shape[1:]:
        raise ValueError(f"dataset {x_name}: must be shaped (examples, features...), got {x.shape}")
    if y.dtype.kind not in "iu":
        raise ValueError(f"dataset {y_name}: must hold integer class labels, it is {y.dtype}")
    if y.ndim != 1:
        raise ValueError(f"dataset {y_name}: must be one class index per example, shaped (examples,), got {y.shape}")
    if len(x) != len(y):
        raise ValueError(f"dataset: {x_name} has {len(x)} examples but {y_name} has {len(y)}")
    if len(x) == 0:
        raise ValueError(f"dataset {x_name}: has no examples")


def _check_finite(x: np.ndarray, name: str) -> None:
    bad = ~np.isfinite(x)
    if bad.any():
        first = int(np.argmax(bad.reshape(len(x), -1).any(axis=1)))
        raise ValueError(
            f"dataset {name}: {int(bad.sum())} values are NaN or infinite as float32 (the first in example {first})"
        )


def check_labels(y: np.ndarray, y_val: np.ndarray, classes: int | None) -> None:
    lowest = min(int(y.min()), int(y_val.min()))
    if lowest < 0:
        name = "y" if int(y.min()) < 0 else "y_val"
        raise ValueError(f"dataset {name}: labels must be class indices >= 0, found {lowest}")
    highest = max(int(y.max()), int(y_val.max()))
    if classes is not None and highest >= classes:
        name = "y" if int(y.max()) >= classes else "y_val"
        raise ValueError(f"dataset {name}: label {highest} is outside [0, {classes}) (dataset.classes)")
    if classes is None and highest + 1 > MAX_CLASSES:
        raise ValueError(f"dataset y: label {highest} implies {highest + 1} classes, more than {MAX_CLASSES}")
    trained = np.unique(y)
    if len(trained) < 2:
        raise ValueError(f"dataset y: every training label is {int(trained[0])}; there is nothing to learn")
    unseen = np.setdiff1d(np.unique(y_val), trained)
    if len(unseen):
        raise ValueError(f"dataset y_val: classes {unseen[:10].tolist()} never occur in the training labels y")


def make_dataset(
    x: np.ndarray,
    y: np.ndarray,
    x_val: np.ndarray | None,
    y_val: np.ndarray | None,
    validation_fraction: float = 0.2,
    classes: int | None = None,
) -> Dataset:
    """Check arrays and convert them (float32 inputs, int64 labels); without `x_val`/`y_val` the last
    `validation_fraction` of the examples validates. Raises ValueError naming the array and problem."""
    _check_shapes(x, y, "x", "y")
    if (x_val is None) != (y_val is None):
        raise ValueError("dataset: give both x_val and y_val, or neither (then validation_fraction applies)")
    if x_val is None or y_val is None:  # both None (checked just above)
        n_val = max(1, int(len(x) * validation_fraction))
        if n_val >= len(x):
            raise ValueError(
                f"dataset x: {len(x)} examples leave none for training after validation_fraction {validation_fraction}"
            )
        x, x_val, y, y_val = x[:-n_val], x[-n_val:], y[:-n_val], y[-n_val:]
    _check_shapes(x_val, y_val, "x_val", "y_val")
    if x_val.shape[1:] != x.shape[1:]:
        raise ValueError(f"dataset x_val: examples are shaped {x_val.shape[1:]}, but x's are {x.shape[1:]}")
    check_labels(y, y_val, classes)
    with np.errstate(over="ignore"):  # values beyond float32 become inf, refused just below
        data = Dataset(
            x.astype(np.float32), y.astype(np.int64), x_val.astype(np.float32), y_val.astype(np.int64), classes
        )
    _check_finite(data.x, "x")
    _check_finite(data.x_val, "x_val")
    return data


def data_cache_dir() -> Path:
    """Where generated datasets are kept between processes: Settings.data_cache
    ($CROWDTRAIN_DATA_CACHE), else $XDG_CACHE_HOME/crowdtrain (by default ~/.cache/crowdtrain). The
    settings are read anew (not get_settings' cached copy): the call is rare, and a test sets its own."""
    configured = Settings().data_cache
    if configured is not None:
        return configured
    return user_cache_dir()


# A SeedSequence word kept apart from deal_shards' epochs, so the validation pick is its own stream.
VALIDATION_STREAM = 2**32 + 7


def encode_labels(values: np.ndarray, label_names: list[str] | None) -> tuple[np.ndarray, list[str] | None]:
    """Class indices of `values` and the class names in index order (None for integer labels
    without `label_names`). String labels become their index in `label_names`, default the names
    sorted: a stable order, the same whatever order the rows come in. Raises ValueError for a
    label outside `label_names` or labels that are neither integers nor strings."""
    values = np.asarray(values)
    if values.dtype.kind in "iu":
        return values.astype(np.int64), label_names
    if values.dtype.kind not in "UO" or not all(isinstance(v, str) for v in values[:1000].tolist()):
        raise ValueError(f"dataset labels: must be integers or strings, they are {values.dtype}")
    found, codes = np.unique(values.astype(str), return_inverse=True)
    names = label_names or sorted(found.tolist())
    order = {name: i for i, name in enumerate(names)}
    unknown = [v for v in found.tolist() if v not in order]
    if unknown:
        raise ValueError(f"dataset labels: {unknown[:10]} are not among dataset.label_names")
    return np.array([order[v] for v in found.tolist()], dtype=np.int64)[codes.reshape(-1)], names


def validation_rows(n: int, fraction: float, seed: int) -> np.ndarray:
    """A seeded random pick of `fraction` of `n` rows (at least one, leaving one), as a boolean mask:
    the validation rows of a source without its own validation split. Deterministic in its
    arguments; rows sorted by class (image folders, many tables) still validate on every class."""
    n_val = max(1, int(n * fraction))
    if n_val >= n:
        raise ValueError(f"dataset: {n} examples leave none for training after validation_fraction {fraction}")
    rng = np.random.default_rng([seed % 2**64, VALIDATION_STREAM])
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, n_val, replace=False)] = True
    return mask


def _mnist1d() -> Dataset:
    """4,000 train / 1,000 test examples, generated deterministically by the mnist1d package.

    Generating them takes seconds of CPU, and every submission of a job on them needs them: the
    arrays are kept in the data cache folder (an npz named by the package's version), written
    atomically, and generated again if that file is missing or unreadable. Where the folder cannot
    be written, they are generated each time."""
    cached = data_cache_dir() / f"mnist1d-{importlib.metadata.version('mnist1d')}.npz"
    try:
        with np.load(cached, allow_pickle=False) as f:
            return Dataset(f["x"], f["y"], f["x_val"], f["y_val"])
    except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile):
        pass
    from mnist1d.data import get_dataset_args
    from mnist1d.data import make_dataset as make_mnist1d

    d = make_mnist1d(get_dataset_args())
    data = Dataset(
        d["x"].astype(np.float32), d["y"].astype(np.int64), d["x_test"].astype(np.float32), d["y_test"].astype(np.int64)
    )
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cached.parent, suffix=".npz", delete=False) as tmp:
            try:
                np.savez(tmp, x=data.x, y=data.y, x_val=data.x_val, y_val=data.y_val)
            except BaseException:
                os.unlink(tmp.name)
                raise
        os.replace(tmp.name, cached)
    except OSError:
        pass  # no cache: the next submission generates them again
    return data


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """The arrays x, y and, if present, x_val and y_val of an .npz file (never unpickling)."""
    if not path.is_file():
        raise ValueError(f"dataset.source: file {path} does not exist on the scheduler")
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError("it holds one array; an npz with named arrays x and y is needed")
        with loaded as f:
            if "x" not in f or "y" not in f:
                raise ValueError(f"an npz dataset needs arrays 'x' and 'y', it has {sorted(f.files)}")
            return {name: f[name] for name in ("x", "y", "x_val", "y_val") if name in f}
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        problem = npz_problem(str(exc) or type(exc).__name__)
    raise ValueError(f"dataset.source: {path} is not a readable npz dataset: {problem}")


def load_dataset(source: str, validation_fraction: float = 0.2, classes: int | None = None) -> Dataset:
    """The checked dataset of a spec's `dataset.source`; raises ValueError naming the problem."""
    if source == "builtin:mnist1d":
        d = _mnist1d()
        return make_dataset(d.x, d.y, d.x_val, d.y_val, classes=classes)
    if source == "builtin:clusters":
        x, y, x_val, y_val = gaussian_clusters(seed=0)
        return make_dataset(x, y, x_val, y_val, classes=classes)
    if source.startswith("npz:"):
        a = _read_npz(Path(source[4:]))
        return make_dataset(a["x"], a["y"], a.get("x_val"), a.get("y_val"), validation_fraction, classes)
    raise ValueError(f"unknown dataset source {source!r}")


def gaussian_clusters(
    seed: int, n_train: int = 6000, n_val: int = 1000, dim: int = 8, clusters: int = 40, classes: int = 10
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, x_val, y_val): Gaussian clusters (fixed centres, spread 0.3) with `clusters // classes`
    clusters per class, so that no linear model separates the classes (one reaches about 0.63 with the
    defaults, an MLP 0.99): a task where a mixture-of-experts model's experts must do the work.
    `seed` draws the examples."""
    centres = np.random.default_rng(12345).normal(size=(clusters, dim))
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        which = rng.integers(0, clusters, n)
        x = centres[which] + 0.3 * rng.normal(size=(n, dim))
        return x.astype(np.float32), (which % classes).astype(np.int64)

    return (*draw(n_train), *draw(n_val))


def split_shards(n_examples: int, subsets: int) -> list[slice]:
    """Contiguous, near-equal slices; the first `n % subsets` shards get one extra example."""
    if subsets > n_examples:
        raise ValueError(f"dataset.subsets: cannot split {n_examples} training examples into {subsets} shards")
    bounds = np.linspace(0, n_examples, subsets + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in pairwise(bounds)]


SHUFFLES = ("stratified", "random", "none")


def deal_shards(y: np.ndarray, shards: int, how: str, seed: int, epoch: int = 0) -> list[np.ndarray]:
    """The example indices of each of `shards` shards: every example in exactly one, sizes within 1.

    - `none`: today's contiguous slices (`split_shards`), whatever the seed;
    - `random`: a permutation seeded by (seed, epoch), cut into those sizes;
    - `stratified`: every class spread evenly: each shard holds floor or ceil of (class count ÷
      shards) examples of each class. Within a shard the order is random too.

    Deterministic in (y, shards, how, seed, epoch); a new `epoch` deals anew. No I/O.
    """
    if how not in SHUFFLES:
        raise ValueError(f"dataset.shuffle: {how!r} is not one of {', '.join(SHUFFLES)}")
    n = len(y)
    slices = split_shards(n, shards)
    if how == "none":
        return [np.arange(sl.start, sl.stop) for sl in slices]
    # A job seed may be any integer; a SeedSequence takes non-negative ones.
    rng = np.random.default_rng([seed % 2**64, epoch])
    if how == "random":
        order = rng.permutation(n)
        return [order[sl] for sl in slices]
    # Line the examples up class by class (classes and the examples within each in random order),
    # then deal the line round-robin: a class's run of c examples gives each shard floor or ceil
    # of c / shards. Relabelling the shards at random spreads the remainders' extra examples.
    _, class_of = np.unique(y, return_inverse=True)
    class_rank = rng.permutation(int(class_of.max()) + 1)[class_of]
    line = np.lexsort((rng.random(n), class_rank))
    owner = np.empty(n, dtype=np.int64)
    owner[line] = rng.permutation(shards)[np.arange(n) % shards]
    grouped = np.lexsort((rng.random(n), owner))  # by shard, in random order within each
    return np.split(grouped, np.cumsum(np.bincount(owner, minlength=shards))[:-1])
