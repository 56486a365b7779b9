"""The dataset section's source syntax: builtin, FORMAT:/absolute/path, FORMAT:sha256:HEX."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from crowdtrain.core.datasetspec import DatasetSpec, resolve_relative_source

HEX = "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("source", "fmt", "path", "uploaded"),
    [
        ("builtin:mnist1d", "builtin", None, None),
        ("npz:/data/x.npz", "npz", "/data/x.npz", None),
        ("csv:/data/t.csv", "csv", "/data/t.csv", None),
        ("parquet:/data/t.parquet", "parquet", "/data/t.parquet", None),
        ("hf:/data/saved", "hf", "/data/saved", None),
        ("images:/data/pets", "images", "/data/pets", None),
        (f"csv:sha256:{HEX}", "csv", None, HEX),
        (f"images:sha256:{HEX}", "images", None, HEX),
    ],
)
def test_a_source_names_its_format_and_its_path_or_upload(source, fmt, path, uploaded) -> None:
    spec = DatasetSpec(source=source)
    assert (spec.format, spec.path, spec.uploaded_sha256) == (fmt, path, uploaded)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"source": "builtin:cifar10"}, "FORMAT one of npz, csv, parquet, hf, images"),
        ({"source": "xlsx:/data/t.xlsx"}, "FORMAT one of"),
        ({"source": "csv:"}, "FORMAT one of"),
        ({"source": "csv:t.csv"}, "'t.csv' is a relative path"),
        ({"source": "csv:sha256:abc"}, "is not sha256: and 64 lowercase hex digits"),
        ({"source": f"csv:sha256:{HEX.upper()}"}, "64 lowercase hex digits"),
        ({"source": "images:/x", "image_size": (0, 8)}, "dataset.image_size: each side must lie in [1, 1024]"),
        ({"source": "csv:/x", "label_names": ["only"]}, "label_names"),
    ],
)
def test_a_bad_dataset_section_is_refused_naming_the_field(fields, words) -> None:
    with pytest.raises(ValidationError, match=words.replace("[", r"\[").replace("(", r"\(")):
        DatasetSpec(**fields)


def test_a_relative_path_of_any_format_is_resolved_against_the_spec_files_folder(tmp_path: Path) -> None:
    dataset = {"source": "images:../pets"}
    note = resolve_relative_source(dataset, tmp_path / "jobs")
    assert dataset["source"] == f"images:{tmp_path / 'pets'}"
    assert note is not None and "read relative to the spec file" in note
    for untouched in ("builtin:mnist1d", f"csv:sha256:{HEX}", "csv:/abs/t.csv"):
        assert resolve_relative_source({"source": untouched}, tmp_path) is None
