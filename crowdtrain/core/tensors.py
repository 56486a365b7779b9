"""Tensor codec: named numpy arrays <-> safetensors bytes, and content hashes."""

import functools
import hashlib
import io
import json
import math
from typing import Any

import numpy as np
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

Params = dict[str, np.ndarray]


class TensorFormatError(ValueError):
    """The bytes are not a safetensors file."""


def encode(params: Params) -> bytes:
    # ascontiguousarray turns 0-d arrays into 1-d ones: keep each tensor's own shape.
    return _st_save({k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in params.items()})


def decode(blob: bytes) -> Params:
    try:
        return _st_load(blob)
    except Exception as exc:  # safetensors raises its own SafetensorError and others
        raise TensorFormatError(f"not a safetensors file: {exc}") from exc


_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
BF16 = "BF16"


@functools.cache
def bfloat16() -> np.dtype:
    """numpy has no bfloat16; ml_dtypes' is the one safetensors writes (crowdtrain.core.updates sends Δ
    in it). Imported when first needed: the import costs about half a CPU-second, in every process."""
    import ml_dtypes

    dtype: np.dtype = np.dtype(ml_dtypes.bfloat16)
    return dtype


def numpy_dtype(code: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype code ("F32", "BF16", ...); KeyError for another code."""
    return bfloat16() if code == BF16 else np.dtype(_DTYPES[code])


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_RANK = 8


def _no_floats(text: str) -> float:
    raise ValueError(f"number {text[:20]} is not an integer")


def _read_header(buf: memoryview, max_header_bytes: int, max_tensors: int | None) -> tuple[dict[str, Any], int]:
    """The header object and its length, bounded before it is parsed: its byte length, the tensors it
    can list (counted as `"data_offsets"` keys), integer-only numbers, and no nesting past JSON's
    recursion limit."""
    if len(buf) < 8:
        raise ValueError("shorter than a header")
    n = int.from_bytes(buf[:8], "little")
    if n > len(buf) - 8:
        raise ValueError(f"header length {n} exceeds the file")
    if n > max_header_bytes:
        raise ValueError(f"header of {n} bytes exceeds the limit of {max_header_bytes}")
    raw = bytes(buf[8 : 8 + n])
    if max_tensors is not None and raw.count(b'"data_offsets"') > max_tensors:
        raise ValueError(f"header lists more than {max_tensors} tensors")
    try:
        header = json.loads(raw, parse_float=_no_floats, parse_constant=_no_floats)
    except RecursionError:
        raise ValueError("header is nested too deeply") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    if max_tensors is not None and len(header) > max_tensors:
        raise ValueError(f"header lists {len(header)} tensors, more than {max_tensors}")
    return header, n


def _ints(value: object, what: str, length: int | None = None) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} is not a list of non-negative integers")
    if length is not None and len(value) != length or len(value) > MAX_RANK:
        raise ValueError(f"{what} has {len(value)} entries")
    return value


def _layout(header: dict[str, Any], data_size: int) -> list[tuple[str, np.dtype, tuple[int, ...], int, int]]:
    """Each tensor's (name, dtype, shape, start, end), checked to tile the data exactly, as the safetensors
    library requires: no gap, no overlap, nothing after the last tensor."""
    out = []
    for name, info in header.items():
        if not isinstance(info, dict) or (info.get("dtype") not in _DTYPES and info.get("dtype") != BF16):
            raise ValueError(f"tensor {name!r} has no known dtype")
        dtype = numpy_dtype(info["dtype"])
        shape = tuple(_ints(info.get("shape"), f"tensor {name!r} shape"))
        start, end = _ints(info.get("data_offsets"), f"tensor {name!r} data_offsets", 2)
        if not start <= end or end - start != dtype.itemsize * math.prod(shape):
            raise ValueError(f"tensor {name!r} has inconsistent offsets")
        out.append((name, dtype, shape, start, end))
    out.sort(key=lambda t: (t[3], t[4]))
    position = 0
    for name, _, _, start, end in out:
        if start != position:
            raise ValueError(f"tensor {name!r} does not start where the previous one ends")
        position = end
    if position != data_size:
        raise ValueError(f"the tensors cover {position} of {data_size} data bytes")
    return out


def views(
    blob: bytes | bytearray | memoryview, max_header_bytes: int = MAX_HEADER_BYTES, max_tensors: int | None = None
) -> Params:
    """Parse safetensors without copying: numpy arrays that view `blob` (writable if it is).

    The hot path of a merge: decoding a 20 MB model with copies costs more than the merge itself.
    Untrusted bytes are held to the safetensors library's standard (see `_read_header`, `_layout`);
    anything else raises TensorFormatError.
    """
    buf = memoryview(blob)
    try:
        header, n = _read_header(buf, max_header_bytes, max_tensors)
        data = buf[8 + n :]
        return {
            name: np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
            for name, dtype, shape, start, end in _layout(header, len(data))
        }
    except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise TensorFormatError(f"not a safetensors file: {exc}") from exc


def header_limits(manifest: dict[str, Any]) -> tuple[int, int]:
    """(header bytes, tensors) that a result for a model with this manifest may have: room for every
    tensor's entry with its name escaped, and nothing more."""
    entries = sum(6 * len(name) + 160 for name in manifest)
    return 4096 + entries, len(manifest)


def sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


Manifest = dict[str, tuple[list[int], str]]


def manifest_of(params: Params) -> Manifest:
    """Name -> (shape, dtype name); what every result must match."""
    return {k: (list(v.shape), str(v.dtype)) for k, v in params.items()}


def check_layout(tensors: Params, manifest: dict[str, Any], what: str = "") -> None:
    """Raise ValueError naming the first difference from `manifest` (name -> (shape, dtype name)): a
    name missing or unexpected, then a tensor's shape or dtype. `what`, if given, leads the message."""
    lead = f"{what}: " if what else ""
    missing = sorted(set(manifest) - set(tensors))
    extra = sorted(set(tensors) - set(manifest))
    if missing or extra:
        raise ValueError(f"{lead}tensor names differ from the model's: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (shape, dtype) in manifest.items():
        arr = tensors[name]
        if list(arr.shape) != list(shape):
            raise ValueError(f"{lead}tensor {name!r} has shape {list(arr.shape)}, expected {list(shape)}")
        if str(arr.dtype) != dtype:
            raise ValueError(f"{lead}tensor {name!r} has dtype {arr.dtype}, expected {dtype}")


def check_against_manifest(params: Params, manifest: dict[str, Any]) -> None:
    """Raise ValueError naming the first mismatch of names, shapes, dtypes (`check_layout`) or, after
    those, the first tensor with non-finite values."""
    check_layout(params, manifest)
    for name in manifest:
        arr = params[name]
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ValueError(f"tensor {name!r} contains NaN or infinite values")


def encode_shard(x: np.ndarray, y: np.ndarray) -> bytes:
    """A training shard on the wire: an uncompressed npz with arrays `x` and `y`."""
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    return buf.getvalue()


def decode_shard(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as f:
        return f["x"], f["y"]
