"""Dataset checks at submission: each problem that would give a stuck or silently wrong job is
refused with a message naming the array and the problem."""

import numpy as np
import pytest

from crowdtrain.workgen.datasets import deal_shards, load_dataset, make_dataset, split_shards

RNG = np.random.default_rng(0)


def arrays(n: int = 20, val: int = 10, features: int = 6) -> dict[str, np.ndarray]:
    return {
        "x": RNG.normal(size=(n, features)),
        "y": np.arange(n) % 3,
        "x_val": RNG.normal(size=(val, features)),
        "y_val": np.arange(val) % 3,
    }


def with_nan(a: np.ndarray, at: int) -> np.ndarray:
    a = a.copy()
    a[at, 0] = np.nan
    return a


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        (
            {"x": with_nan(arrays()["x"], 7)},
            "dataset x: 1 values are NaN or infinite as float32 (the first in example 7)",
        ),
        ({"x_val": np.full((10, 6), np.inf)}, "dataset x_val: 60 values are NaN or infinite"),
        ({"x": np.full((20, 6), 1e300)}, "dataset x: 120 values are NaN or infinite as float32"),
        ({"y": np.arange(20) % 3 - 1}, "dataset y: labels must be class indices >= 0, found -1"),
        ({"y_val": np.arange(10) % 4}, "dataset y_val: classes [3] never occur in the training labels y"),
        ({"y": np.zeros(20, dtype=int)}, "every training label is 0"),
        ({"y": np.arange(20) % 3 * 1_000_000}, "implies 2000001 classes"),
        ({"x_val": np.zeros((9, 6))}, "x_val has 9 examples but y_val has 10"),
        ({"x_val": np.zeros((10, 5))}, "dataset x_val: examples are shaped (5,), but x's are (6,)"),
        ({"x": np.zeros((19, 6))}, "x has 19 examples but y has 20"),
        ({"x": np.zeros(20)}, "dataset x: must be shaped (examples, features...), got (20,)"),
        ({"x": np.zeros((20, 0))}, "got (20, 0)"),
        ({"x": np.zeros((0, 6)), "y": np.zeros(0, dtype=int)}, "dataset x: has no examples"),
        ({"x": np.array([["a"] * 6] * 20)}, "dataset x: must hold numbers, it is <U1"),
        ({"y": np.arange(20) % 3 * 1.0}, "dataset y: must hold integer class labels, it is float64"),
        ({"y": np.eye(3, dtype=int)[np.arange(20) % 3]}, "one class index per example"),
        ({"y_val": None}, "give both x_val and y_val, or neither"),
    ],
)
def test_a_bad_dataset_is_refused_naming_the_array(patch: dict, words: str) -> None:
    a = arrays() | patch
    with pytest.raises(ValueError) as err:
        make_dataset(a["x"], a["y"], a["x_val"], a["y_val"])
    assert words in str(err.value)


def test_labels_must_lie_below_the_declared_classes() -> None:
    a = arrays()
    with pytest.raises(ValueError, match=r"dataset y: label 2 is outside \[0, 2\) \(dataset.classes\)"):
        make_dataset(a["x"], a["y"], a["x_val"], a["y_val"], classes=2)
    assert make_dataset(a["x"], a["y"], a["x_val"], a["y_val"], classes=5).num_classes == 5


def test_a_good_dataset_is_converted_and_split() -> None:
    a = arrays()
    data = make_dataset(a["x"], a["y"].astype(np.uint8), None, None, validation_fraction=0.25)
    assert (data.x.dtype, data.y.dtype, len(data.x), len(data.x_val)) == (np.float32, np.int64, 15, 5)
    assert data.input_shape == [6] and data.num_classes == 3
    with pytest.raises(ValueError, match="leave none for training"):
        make_dataset(a["x"][:1], a["y"][:1], None, None)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", r"the file is empty: write it with numpy.savez\(path, x=..., y=...\)"),
        (b"PK\x03\x04 not really a zip", r"it is not an npz file \(not a zip archive\): write it with numpy.savez"),
        (b"x,y\n1,2\n", "it is neither an npz archive nor a .npy array, and pickles are never loaded"),
        (None, "it holds one array"),
    ],
)
def test_an_unreadable_npz_file_is_refused_saying_what_to_fix(tmp_path, content: bytes | None, words: str) -> None:
    path = tmp_path / "data.npz"
    if content is None:
        with path.open("wb") as f:
            np.save(f, np.zeros(3))
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=f"dataset.source: {path} is not a readable npz dataset: {words}"):
        load_dataset(f"npz:{path}")


def test_more_shards_than_examples_is_refused() -> None:
    with pytest.raises(ValueError, match="dataset.subsets: cannot split 3 training examples into 4 shards"):
        split_shards(3, 4)


# 1,003 examples of 7 classes of unequal sizes, sorted by class as many files are.
SORTED_Y = np.sort(np.random.default_rng(1).choice(7, 1003, p=[0.3, 0.2, 0.15, 0.15, 0.1, 0.05, 0.05]))


def _check_partition(parts: list[np.ndarray], n: int, shards: int) -> None:
    assert len(parts) == shards
    assert sorted(np.concatenate(parts).tolist()) == list(range(n)), "every example in exactly one shard"
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("shards", [1, 4, 10, 13, 300])
def test_stratified_shards_of_class_sorted_data_hold_every_class_evenly(shards: int) -> None:
    parts = deal_shards(SORTED_Y, shards, "stratified", seed=3)
    _check_partition(parts, len(SORTED_Y), shards)
    totals = np.bincount(SORTED_Y)
    for part in parts:
        counts = np.bincount(SORTED_Y[part], minlength=7)
        assert np.all(np.abs(counts - totals / shards) < 1), "a class is off its share by a whole example"


def test_random_shards_mix_classes_and_none_keeps_todays_slices() -> None:
    parts = deal_shards(SORTED_Y, 10, "random", seed=3)
    _check_partition(parts, len(SORTED_Y), 10)
    # Contiguous slices of class-sorted data have one or two classes; random ones nearly all seven.
    assert min(len(np.unique(SORTED_Y[p])) for p in parts) >= 5
    sliced = deal_shards(SORTED_Y, 10, "none", seed=3)
    assert [(p[0], p[-1] + 1) for p in sliced] == [(sl.start, sl.stop) for sl in split_shards(len(SORTED_Y), 10)]
    assert all(np.array_equal(p, np.arange(p[0], p[-1] + 1)) for p in sliced)
    assert max(len(np.unique(SORTED_Y[p])) for p in sliced) <= 2


@pytest.mark.parametrize("how", ["stratified", "random"])
def test_a_deal_is_a_function_of_seed_and_epoch(how: str) -> None:
    def deal(seed: int, epoch: int) -> list[list[int]]:
        return [p.tolist() for p in deal_shards(SORTED_Y, 8, how, seed, epoch)]

    assert deal(5, 0) == deal(5, 0) and deal(-5, 2) == deal(-5, 2)
    assert deal(5, 0) != deal(6, 0)
    assert deal(5, 1) != deal(5, 0)


def test_an_unknown_shuffle_is_refused() -> None:
    with pytest.raises(ValueError, match="dataset.shuffle: 'sorted' is not one of"):
        deal_shards(SORTED_Y, 4, "sorted", seed=0)


def test_the_builtin_dataset_is_generated_once_then_read_from_the_data_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CROWDTRAIN_DATA_CACHE", str(tmp_path))
    first = load_dataset("builtin:mnist1d")
    (cached,) = tmp_path.glob("mnist1d-*.npz")

    def regenerate(*args, **kwargs):
        raise AssertionError("generated again despite the cache")

    monkeypatch.setattr("mnist1d.data.make_dataset", regenerate)
    again = load_dataset("builtin:mnist1d")
    for name in ("x", "y", "x_val", "y_val"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
        assert getattr(first, name).dtype == getattr(again, name).dtype
    assert cached.is_file() and list(tmp_path.iterdir()) == [cached]


def test_an_unreadable_data_cache_file_is_generated_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CROWDTRAIN_DATA_CACHE", str(tmp_path))
    fresh = load_dataset("builtin:mnist1d")
    (cached,) = tmp_path.glob("mnist1d-*.npz")
    cached.write_bytes(b"not an npz")
    again = load_dataset("builtin:mnist1d")
    assert np.array_equal(fresh.x, again.x) and np.array_equal(fresh.y_val, again.y_val)
    assert np.load(cached)["x"].shape == fresh.x.shape
