"""Each dataset source beyond builtin and npz, staged as a job's shards (crowdtrain.workgen.staging):
csv and parquet tables dealt in a streaming pass, Hugging Face datasets saved to disk, image folders,
and datasets uploaded to storage (a file, or a folder's tar archive)."""

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from crowdtrain.cli.datasets import pack_folder
from crowdtrain.core import keys
from crowdtrain.core.datasetspec import DatasetSpec
from crowdtrain.core.storage import LocalStorage
from crowdtrain.workgen import tables
from crowdtrain.workgen.folders import unpack_archive
from crowdtrain.workgen.image_decoding import ImageBounds
from crowdtrain.workgen.staging import StagedDataset, stage_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ANIMALS = ["cat", "dog", "emu"]


def table(n: int = 90) -> dict[str, list]:
    """Row i: features (i, -i), label ANIMALS[(i * 7) % 3] as a string; the row id travels in `f0`."""
    return {"f0": list(range(n)), "f1": [-i for i in range(n)], "label": [ANIMALS[(i * 7) % 3] for i in range(n)]}


def write_csv(path: Path, columns: dict[str, list]) -> Path:
    names = list(columns)
    rows = [",".join(names)] + [",".join(str(columns[c][i]) for c in names) for i in range(len(columns[names[0]]))]
    path.write_text("\n".join(rows) + "\n")
    return path


def stage(tmp_path: Path, source: str, storage: LocalStorage | None = None, **fields) -> StagedDataset:
    scratch = tmp_path / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    spec = DatasetSpec(source=source, **({"subsets": 3} | fields))
    return stage_dataset(spec, 0, storage or LocalStorage(tmp_path / "storage"), scratch, 10**9)


def every_example(staged: StagedDataset) -> tuple[np.ndarray, np.ndarray]:
    parts = [staged.shard(i) for i in range(len(staged.shard_sizes))] + [staged.validation]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def assert_rows_kept_whole(staged: StagedDataset, n: int) -> None:
    """Every row in exactly one part, its features beside its own label (row id i has label (7i) % 3)."""
    x, y = every_example(staged)
    ids = x[:, 0].astype(int)
    assert sorted(ids.tolist()) == list(range(n))
    np.testing.assert_array_equal(x[:, 1], -x[:, 0])
    np.testing.assert_array_equal(y, (ids * 7) % 3)


def assert_stratified(staged: StagedDataset) -> None:
    counts = np.array([np.bincount(staged.shard(i)[1], minlength=3) for i in range(len(staged.shard_sizes))])
    assert (counts.max(axis=0) - counts.min(axis=0) <= 1).all(), counts


@pytest.mark.parametrize("block_bytes", [tables.CSV_BLOCK_BYTES, 64])
def test_a_csv_with_string_labels_is_dealt_stratified_with_the_names_sorted(tmp_path, monkeypatch, block_bytes) -> None:
    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", block_bytes)  # 64 bytes: many batches, one pass each
    staged = stage(tmp_path, f"csv:{write_csv(tmp_path / 't.csv', table())}")
    assert staged.label_names == ANIMALS
    assert staged.input_shape == [2] and staged.num_classes == 3
    assert len(staged.validation[1]) == 18 and sum(staged.shard_sizes) == 72
    assert_rows_kept_whole(staged, 90)
    assert_stratified(staged)


def test_the_streaming_pass_deals_the_same_shards_whatever_the_batch_size(tmp_path, monkeypatch) -> None:
    path = write_csv(tmp_path / "t.csv", table())
    whole = stage(tmp_path / "a", f"csv:{path}")
    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", 64)
    batched = stage(tmp_path / "b", f"csv:{path}")
    for i in range(3):
        np.testing.assert_array_equal(whole.shard(i)[0], batched.shard(i)[0])


def test_a_parquet_table_takes_the_feature_columns_named_in_their_order(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tables, "BATCH_ROWS", 7)
    columns = table() | {"label": [(i * 7) % 3 for i in range(90)], "noise": [0.5] * 90}
    pq.write_table(pa.table(columns), tmp_path / "t.parquet")
    staged = stage(tmp_path, f"parquet:{tmp_path / 't.parquet'}", feature_columns=["f0", "f1"])
    assert staged.label_names is None and staged.input_shape == [2]
    assert_rows_kept_whole(staged, 90)
    assert_stratified(staged)


def test_label_names_fix_the_order_of_string_labels(tmp_path) -> None:
    staged = stage(tmp_path, f"csv:{write_csv(tmp_path / 't.csv', table())}", label_names=["emu", "dog", "cat"])
    x, y = every_example(staged)
    np.testing.assert_array_equal(y, 2 - (x[:, 0].astype(int) * 7) % 3)


@pytest.mark.parametrize(
    ("patch", "fields", "words"),
    [
        ({"f1": ["x"] + [1] * 89}, {}, "cannot be read"),
        ({"f1": [""] + [1] * 89}, {}, "dataset f1: row 0 is empty, NaN or infinite"),
        ({"f0": ["nan"] + list(range(1, 90))}, {}, "dataset f0: row 0 is empty, NaN or infinite"),
        ({}, {"label_column": "animal"}, "dataset.label_column: 'animal' is not a column"),
        ({}, {"feature_columns": ["f0", "f9"]}, "dataset.feature_columns: ['f9'] are not columns"),
        ({}, {"feature_columns": ["label"]}, "'label' is the label column"),
        ({}, {"label_names": ["cat", "dog"]}, "labels ['emu'] are not among dataset.label_names"),
        ({"label": [1.5] * 90}, {}, "labels must be integers or strings, they are double"),
        ({"label": ["cat"] * 90}, {}, "every training label is 0"),
    ],
)
def test_a_bad_table_is_refused_naming_the_column(tmp_path, patch, fields, words) -> None:
    path = write_csv(tmp_path / "t.csv", table() | patch)
    with pytest.raises(ValueError) as err:
        stage(tmp_path, f"csv:{path}", **fields)
    assert words in str(err.value)


def test_a_missing_table_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist on the scheduler"):
        stage(tmp_path, f"parquet:{tmp_path / 'nothing.parquet'}")


def test_a_saved_hugging_face_dataset_trains_on_train_and_validates_on_test(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {"x": datasets.Sequence(datasets.Value("float32"), length=4), "label": datasets.ClassLabel(names=["no", "yes"])}
    )

    def split(n: int) -> object:
        return datasets.Dataset.from_dict(
            {"x": [[i, 0, 1, 2] for i in range(n)], "label": [i % 2 for i in range(n)]}, features
        )

    datasets.DatasetDict({"train": split(40), "test": split(10)}).save_to_disk(str(tmp_path / "hf"))
    staged = stage(tmp_path, f"hf:{tmp_path / 'hf'}", subsets=4)
    assert staged.input_shape == [4] and staged.label_names == ["no", "yes"]
    assert staged.shard_sizes == [10, 10, 10, 10] and len(staged.validation[1]) == 10
    x, y = staged.shard(0)
    np.testing.assert_array_equal(y, x[:, 0].astype(int) % 2)


def write_images(folder: Path, per_class: int = 6) -> None:
    image = pytest.importorskip("PIL.Image")
    for c, name in enumerate(["stripes", "blank"]):
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((10 + i, 12), 255 * c, dtype=np.uint8)  # sizes differ: every one is resized
            image.fromarray(pixels).save(folder / name / f"{i}.png")
    (folder / "blank" / "notes.txt").write_text("not an image")


def test_an_image_folder_gives_one_class_per_sub_folder_resized(tmp_path) -> None:
    write_images(tmp_path / "images")
    staged = stage(tmp_path, f"images:{tmp_path / 'images'}", subsets=2, image_size=(8, 6), image_mode="L")
    assert staged.label_names == ["blank", "stripes"]
    assert staged.input_shape == [1, 8, 6]
    x, y = every_example(staged)
    assert len(y) == 12
    np.testing.assert_allclose(x.reshape(12, -1).mean(axis=1), 1.0 - y)  # blank is white, class 0


def test_an_unreadable_image_is_refused_naming_it(tmp_path) -> None:
    write_images(tmp_path / "images")
    (tmp_path / "images" / "blank" / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"dataset image bad.png: cannot be read as an image"):
        stage(tmp_path, f"images:{tmp_path / 'images'}", subsets=2)


def store(storage: LocalStorage, blob: Path) -> str:
    sha = hashlib.sha256(blob.read_bytes()).hexdigest()
    storage.put_file(keys.dataset_key(sha), blob)
    return sha


def test_an_uploaded_table_and_an_uploaded_folder_are_read_from_storage(tmp_path) -> None:
    storage = LocalStorage(tmp_path / "storage")
    sha = store(storage, write_csv(tmp_path / "t.csv", table()))
    assert_rows_kept_whole(stage(tmp_path, f"csv:sha256:{sha}", storage), 90)
    write_images(tmp_path / "images")
    pack_folder(tmp_path / "images", tmp_path / "images.tar")
    staged = stage(tmp_path, f"images:sha256:{store(storage, tmp_path / 'images.tar')}", storage, subsets=2)
    assert staged.label_names == ["blank", "stripes"] and sum(staged.shard_sizes) + len(staged.validation[1]) == 12


def test_a_folder_packs_to_the_same_bytes_every_time(tmp_path) -> None:
    write_images(tmp_path / "images")
    pack_folder(tmp_path / "images", tmp_path / "a.tar")
    (tmp_path / "images" / "blank" / "0.png").touch()  # a new modification time changes nothing
    pack_folder(tmp_path / "images", tmp_path / "b.tar")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()


def test_a_dataset_never_uploaded_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=f"no dataset with sha256 {'a' * 64} was uploaded"):
        stage(tmp_path, f"csv:sha256:{'a' * 64}")


def tar_of(*members: tuple[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize(
    ("archive", "limit", "words"),
    [
        (tar_of(("../escape.txt", b"x")), 100, "not a readable tar archive"),
        (tar_of(("a", b"x" * 60), ("b", b"x" * 60)), 100, "more than"),
        (b"not a tar at all", 100, "not a readable tar archive"),
    ],
)
def test_an_uploaded_archive_that_would_escape_or_exceed_its_bound_is_refused(tmp_path, archive, limit, words) -> None:
    (tmp_path / "a.tar").write_bytes(archive)
    with pytest.raises(ValueError, match=words):
        unpack_archive(tmp_path / "a.tar", tmp_path / "out", limit)
    assert not (tmp_path / "escape.txt").exists()


def test_an_image_folder_over_the_pixel_bound_is_refused_from_its_headers_before_decoding(tmp_path) -> None:
    """A 3000x3000 PNG cut after its header: its pixels cannot even be decoded, so the refusal that
    names the pixel bound shows the sizes were read from the headers before any image was decoded."""
    image = pytest.importorskip("PIL.Image")
    write_images(tmp_path / "images")
    whole = tmp_path / "big.png"
    image.new("L", (3000, 3000)).save(whole)
    (tmp_path / "images" / "blank" / "big.png").write_bytes(whole.read_bytes()[:200])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    spec = DatasetSpec(source=f"images:{tmp_path / 'images'}", subsets=2)

    with pytest.raises(ValueError) as refused:
        stage_dataset(spec, 0, LocalStorage(tmp_path / "storage"), scratch, 10**9, ImageBounds(max_pixels=1_000_000))

    message = str(refused.value)
    assert "13 images declare 9,00" in message and "more than the 1,000,000 pixels" in message, message
    assert "CROWDTRAIN_DATASET_MAX_PIXELS" in message and "resize" in message, message


HEADER_AND_ROWS = "f0,f1,label\n" + "".join(f"{i},{-i},{ANIMALS[i % 3]}\n" for i in range(60))


@pytest.mark.parametrize(
    ("fmt", "text", "words"),
    [
        ("csv", HEADER_AND_ROWS + "1,2," + "c" * 5000 + "\n" + HEADER_AND_ROWS[12:], "a row of t.csv is longer than"),
        ("csv", HEADER_AND_ROWS + '1,"2,cat\n' + HEADER_AND_ROWS, "close every quote"),
        ("csv", HEADER_AND_ROWS + "1,2\n", "a row of t.csv has 2 values where its header names 3 columns"),
        ("csv", "", "t.csv is empty: a csv needs a header row"),
        ("parquet", HEADER_AND_ROWS, "t.parquet is not a parquet file"),
    ],
    ids=["row-longer-than-a-block", "quote-never-closed", "missing-value", "empty", "csv-named-parquet"],
)
def test_a_table_the_parser_cannot_read_is_refused_saying_what_to_fix(tmp_path, monkeypatch, fmt, text, words) -> None:
    """Not pyarrow's "straddling object straddles two block boundaries": what is wrong with the file."""
    monkeypatch.setattr(tables, "CSV_BLOCK_BYTES", 2048)
    path = tmp_path / f"t.{fmt}"
    path.write_text(text)
    with pytest.raises(ValueError) as refused:
        stage(tmp_path, f"{fmt}:{path}")
    assert words in str(refused.value), refused.value


@pytest.mark.parametrize(
    ("mode", "words"),
    [("w:gz", "a gzip-compressed tar archive, which is not read"), ("w:bz2", "a bzip2-compressed tar archive")],
)
def test_a_compressed_archive_is_refused_saying_to_upload_it_uncompressed(tmp_path, mode, words) -> None:
    with tarfile.open(tmp_path / "a.tar", mode) as tar:
        tar.add(Path(__file__), arcname="a/x.png")
    with pytest.raises(ValueError) as refused:
        unpack_archive(tmp_path / "a.tar", tmp_path / "out", 10**9)
    assert words in str(refused.value) and "tar -cf" in str(refused.value), refused.value
