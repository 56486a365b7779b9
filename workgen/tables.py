"""csv and parquet tables (feature columns and a label column), sharded in a streaming pass.

A table may be larger than memory, so it is read in bounded batches twice: the first pass reads the
label column only (one int64 per row is held), from which the validation rows and the shards are
dealt exactly as for an in-memory dataset (crowdtrain.workgen.datasets.deal_shards: shuffled and
stratified); the second pass reads the feature columns and writes each row into its part's
float32 file on disk. A part is then read back one at a time. What the scheduler holds at once is
one batch and one shard.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crowdtrain.core.datasetspec import DatasetSpec
from crowdtrain.workgen.datasets import check_labels, deal_shards, validation_rows
from crowdtrain.workgen.optional import require
from crowdtrain.workgen.read_errors import table_problem

BATCH_ROWS = 65_536  # parquet rows per batch
CSV_BLOCK_BYTES = 4 * 1024 * 1024  # csv bytes per batch; a longer row is refused
MAX_ROWS = 50_000_000  # labels and dealing take on the order of 100 bytes per row, whatever the features
MAX_FEATURES = 100_000


@dataclass(frozen=True)
class TableParts:
    """A table dealt into shards and a validation part, each a float32 file on disk (read lazily)."""

    features: list[str]
    label_names: list[str] | None
    num_classes: int
    shards: list[tuple[np.ndarray, np.ndarray]]  # (memory-mapped x, y) per shard
    validation: tuple[np.ndarray, np.ndarray]


def _arrow() -> Any:
    return require("pyarrow", "csv and parquet")


def _batches(fmt: str, path: Path, columns: list[str], as_float: bool) -> Iterator[Any]:
    """Record batches of `columns` of the table, bounded in size; pyarrow's errors as ValueError."""
    pa = _arrow()
    try:
        if fmt == "csv":
            csv = require("pyarrow.csv", fmt)
            types = {c: pa.float32() for c in columns} if as_float else None
            reader = csv.open_csv(
                path,
                read_options=csv.ReadOptions(block_size=CSV_BLOCK_BYTES),
                convert_options=csv.ConvertOptions(include_columns=columns, column_types=types),
            )
            yield from reader
        else:
            parquet = require("pyarrow.parquet", fmt)
            yield from parquet.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"dataset.source: {table_problem(fmt, path.name, str(exc), CSV_BLOCK_BYTES)}") from None


def table_columns(fmt: str, path: Path) -> list[str]:
    """The column names of a csv (its header) or parquet table, reading no more than one block."""
    pa = _arrow()
    if not path.is_file():
        raise ValueError(f"dataset.source: file {path} does not exist on the scheduler")
    try:
        if fmt == "csv":
            csv = require("pyarrow.csv", fmt)
            with csv.open_csv(path, read_options=csv.ReadOptions(block_size=CSV_BLOCK_BYTES)) as reader:
                names: list[str] = reader.schema.names
        else:
            names = require("pyarrow.parquet", fmt).ParquetFile(path).schema_arrow.names
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"dataset.source: {table_problem(fmt, path.name, str(exc), CSV_BLOCK_BYTES)}") from None
    return names


def _feature_columns(spec: DatasetSpec, columns: list[str]) -> list[str]:
    if spec.label_column not in columns:
        raise ValueError(f"dataset.label_column: {spec.label_column!r} is not a column of the table ({columns[:20]})")
    features = spec.feature_columns or [c for c in columns if c != spec.label_column]
    missing = [c for c in features if c not in columns]
    if missing:
        raise ValueError(f"dataset.feature_columns: {missing[:10]} are not columns of the table")
    if spec.label_column in features:
        raise ValueError(f"dataset.feature_columns: {spec.label_column!r} is the label column")
    if not features or len(features) > MAX_FEATURES:
        raise ValueError(f"dataset.feature_columns: a table needs 1 to {MAX_FEATURES} feature columns")
    return features


def read_labels(
    fmt: str, path: Path, column: str, label_names: list[str] | None
) -> tuple[np.ndarray, list[str] | None]:
    """First pass: the class index of every row, and the class names in index order (None for
    integer labels without `label_names`). String labels are numbered in the order of
    `label_names`, default sorted, as crowdtrain.workgen.datasets.encode_labels does."""
    pa, pc = _arrow(), require("pyarrow.compute", fmt)
    codes: list[np.ndarray] = []
    seen: dict[str, int] = {}  # string label -> provisional index, in order of first sight
    kinds: set[str] = set()
    rows = 0
    for batch in _batches(fmt, path, [column], as_float=False):
        labels = batch.column(0)
        rows += len(labels)
        if rows > MAX_ROWS:
            raise ValueError(f"dataset.source: the table has more than {MAX_ROWS:,} rows")
        if labels.null_count:
            raise ValueError(f"dataset {column}: {labels.null_count} labels are empty")
        if pa.types.is_integer(labels.type):
            kinds.add("integer")
            codes.append(labels.to_numpy().astype(np.int64))
        elif pa.types.is_string(labels.type) or pa.types.is_large_string(labels.type):
            kinds.add("string")
            encoded = pc.dictionary_encode(labels)
            lookup = np.array([seen.setdefault(v, len(seen)) for v in encoded.dictionary.to_pylist()], dtype=np.int64)
            codes.append(lookup[encoded.indices.to_numpy(zero_copy_only=False)])
        else:
            raise ValueError(f"dataset {column}: labels must be integers or strings, they are {labels.type}")
    if len(kinds) > 1:
        raise ValueError(f"dataset {column}: labels mix integers and strings")
    if not codes:
        raise ValueError(f"dataset.source: table {path.name} has no rows")
    y = np.concatenate(codes)
    if kinds == {"integer"}:
        return y, label_names
    names = label_names or sorted(seen)
    order = {name: i for i, name in enumerate(names)}
    unknown = [v for v in seen if v not in order]
    if unknown:
        raise ValueError(f"dataset {column}: labels {unknown[:10]} are not among dataset.label_names")
    return np.array([order[v] for v in seen], dtype=np.int64)[y], names


def _write_features(fmt: str, path: Path, features: list[str], slot: np.ndarray, table: np.ndarray) -> None:
    """Second pass: each row's features into `table[slot[row]]`, batch by batch."""
    start = 0
    for batch in _batches(fmt, path, features, as_float=True):
        n = batch.num_rows
        if start + n > len(slot):
            raise ValueError(f"dataset.source: table {path.name} changed while it was read")
        x = np.empty((n, len(features)), dtype=np.float32)
        for i, name in enumerate(features):
            column = batch.column(batch.schema.get_field_index(name))
            x[:, i] = column.to_numpy(zero_copy_only=False)  # a null becomes NaN, refused just below
        bad = ~np.isfinite(x)
        if bad.any():
            row, col = np.argwhere(bad)[0]
            raise ValueError(
                f"dataset {features[col]}: row {start + int(row)} is empty, NaN or infinite as float32 "
                f"({int(bad.sum())} such values in rows {start}-{start + n - 1})"
            )
        table[slot[start : start + n]] = x
        start += n
    if start != len(slot):
        raise ValueError(f"dataset.source: table {path.name} changed while it was read")


def stage_table(fmt: str, path: Path, spec: DatasetSpec, seed: int, scratch: Path) -> TableParts:
    """Check a csv or parquet table and deal it into shards on disk under `scratch` (two streaming
    passes). Raises ValueError naming the column and the problem; nothing is written to storage.

    The rows are laid out in one float32 file, shard after shard and the validation rows last, so
    each part is a contiguous slice of it."""
    features = _feature_columns(spec, table_columns(fmt, path))
    y, names = read_labels(fmt, path, spec.label_column, spec.label_names)
    is_val = validation_rows(len(y), spec.validation_fraction, seed)
    train_rows, val_rows = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    classes = spec.classes or (len(names) if names else None)
    check_labels(y[train_rows], y[val_rows], classes)
    groups = [train_rows[picked] for picked in deal_shards(y[train_rows], spec.subsets, spec.shuffle, seed)]
    groups.append(val_rows)
    order = np.concatenate(groups)  # the table row at each slot
    slot = np.empty(len(y), dtype=np.int64)
    slot[order] = np.arange(len(y))
    table = np.lib.format.open_memmap(scratch / "table.npy", mode="w+", dtype=np.float32, shape=(len(y), len(features)))
    _write_features(fmt, path, features, slot, table)
    table.flush()
    bounds = np.cumsum([0, *(len(g) for g in groups)])
    parts = [(table[a:b], y[g]) for a, b, g in zip(bounds[:-1], bounds[1:], groups, strict=True)]
    return TableParts(features, names, classes or int(y.max()) + 1, parts[:-1], parts[-1])
