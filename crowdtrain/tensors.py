"""Tensor codec: named numpy arrays <-> safetensors bytes, and content hashes."""

import hashlib
import io
import json

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


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def views(blob: bytes | bytearray | memoryview) -> Params:
    """Parse safetensors without copying: numpy arrays that view `blob` (writable if it is).

    The hot path of a merge: decoding a 20 MB model with copies costs more than the merge itself.
    """
    buf = memoryview(blob)
    try:
        if len(buf) < 8:
            raise ValueError("shorter than a header")
        n = int.from_bytes(buf[:8], "little")
        if n > len(buf) - 8 or n > 100_000_000:
            raise ValueError(f"header length {n} exceeds the file")
        header = json.loads(bytes(buf[8:8 + n]))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        data = buf[8 + n:]
        out: Params = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = np.dtype(_DTYPES[info["dtype"]])
            start, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
            if not 0 <= start <= end <= len(data) or end - start != dtype.itemsize * int(np.prod(shape)):
                raise ValueError(f"tensor {name!r} has inconsistent offsets")
            out[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
        return out
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise TensorFormatError(f"not a safetensors file: {exc}") from exc


def sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


Manifest = dict[str, tuple[list[int], str]]


def manifest_of(params: Params) -> Manifest:
    """Name -> (shape, dtype name); what every result must match."""
    return {k: (list(v.shape), str(v.dtype)) for k, v in params.items()}


def check_against_manifest(params: Params, manifest: dict) -> None:
    """Raise ValueError naming the first mismatch of names, shapes, dtypes or non-finite values."""
    missing = sorted(set(manifest) - set(params))
    extra = sorted(set(params) - set(manifest))
    if missing or extra:
        raise ValueError(f"tensor names differ from the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (shape, dtype) in manifest.items():
        arr = params[name]
        if list(arr.shape) != list(shape):
            raise ValueError(f"tensor {name!r} has shape {list(arr.shape)}, the model has {list(shape)}")
        if str(arr.dtype) != dtype:
            raise ValueError(f"tensor {name!r} has dtype {arr.dtype}, the model has {dtype}")
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
