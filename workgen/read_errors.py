"""What is wrong with an operator's dataset file, in words the operator can act on.

The parsers that read a dataset (pyarrow's csv and parquet readers, tarfile, numpy's npz loader)
speak of their own workings ("straddling object straddles two block boundaries", "truncated
header"); these functions turn their messages into what the file lacks and how to fix it, keeping
the parser's own words last for reference. Pure functions of the message and the file's first
bytes; no I/O.
"""

import re

# The first bytes of what operators upload in place of an uncompressed tar archive.
COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"(\xb5/\xfd": "zstd"}
ZIP_MAGIC = b"PK\x03\x04"
PACK_HINT = "pack the folder with `tar -cf` (no compression), or give `crowdtrain job submit` the folder's path"


def table_problem(fmt: str, name: str, message: str, block_bytes: int) -> str:
    """What is wrong with the csv or parquet table `name`, from its reader's error `message`."""
    columns = re.search(r"Expected (\d+) columns, got (\d+): ?(.*)", message, re.DOTALL)
    if "straddl" in message:
        problem = (
            f"a row of {name} is longer than {block_bytes / 2**20:g} MiB, the most one row may take: split very "
            "long rows, and check that no quoted field is left open (it would run on to the end of the file)"
        )
    elif "out of sync with chunker" in message or "newlines_in_values" in message or _quote_runs_on(columns):
        problem = (
            f"a value of {name} spans several lines (a line break inside a quoted field, or a quote never "
            "closed): remove line breaks from values and close every quote"
        )
    elif columns is not None:
        expected, got, row = columns.groups()
        problem = (
            f"a row of {name} has {got} values where its header names {expected} columns "
            f"(the row begins {row[:80]!r}): check that row's commas and quotes"
        )
    elif "Empty CSV file" in message:
        problem = f"{name} is empty: a csv needs a header row naming its columns, then one row per example"
    elif "magic bytes not found" in message:
        problem = (
            f"{name} is not a parquet file (it lacks parquet's footer): it may be truncated, or another "
            "format; name the format that matches the file (csv:, parquet:, npz:)"
        )
    else:
        return f"{fmt} table {name} cannot be read: {message}"
    return f"{problem} ({fmt} reader: {message[:200]})"


def _quote_runs_on(columns: re.Match[str] | None) -> bool:
    """Whether a row with too few values is a quoted field that runs over the following lines."""
    return columns is not None and '"' in columns.group(3) and "\n" in columns.group(3).rstrip("\n")


def archive_problem(message: str, head: bytes) -> str:
    """What is wrong with an uploaded folder's archive, from tarfile's `message` and its first bytes."""
    compression = next((kind for magic, kind in COMPRESSED.items() if head.startswith(magic)), None)
    if compression is not None:
        return f"the uploaded folder is a {compression}-compressed tar archive, which is not read: {PACK_HINT}"
    if head.startswith(ZIP_MAGIC):
        return f"the uploaded folder is a zip archive, not a tar archive: {PACK_HINT}"
    return f"the uploaded folder is not a readable tar archive ({message}): {PACK_HINT}"


def npz_problem(message: str) -> str:
    """What is wrong with an npz dataset, from numpy's (or zipfile's) error `message`."""
    save = "write it with numpy.savez(path, x=..., y=...)"
    if "No data left in file" in message:
        return f"the file is empty: {save}"
    if "not a zip file" in message:
        return f"it is not an npz file (not a zip archive): {save} ({message})"
    if "Object arrays cannot be loaded" in message:
        return (
            "it holds object arrays, which would need unpickling and are never loaded: save numeric arrays "
            f"(x as numbers, y as integers) ({message})"
        )
    if "pickled" in message:
        return f"it is neither an npz archive nor a .npy array, and pickles are never loaded: {save}"
    return message


def unreadable_source(exc: OSError) -> str:
    """A dataset path the scheduler may not read, or a folder that changed while it was read."""
    return f"dataset.source: cannot be read on the scheduler: {exc.strerror or exc}"
