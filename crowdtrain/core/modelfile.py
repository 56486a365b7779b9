"""The exported model: a finished job's W_s as safetensors, saying in its header what it is.

The safetensors header's `__metadata__` (string -> string, the only kind the format allows) holds
the job spec and the model config as JSON, the framework, the model's name, the parameter version,
the validation accuracy of exactly that version and the crowdtrain version that wrote it: enough to
rebuild the model and load the tensors without asking the scheduler (docs/operator/jobs.md, "The
exported model"). Only the header changes: the tensors' bytes are those of W_s as the parameter store holds
them. No I/O.
"""

import json
from typing import Any

from crowdtrain import __version__
from crowdtrain.core.frameworks import job_framework
from crowdtrain.core.tensors import MAX_HEADER_BYTES, TensorFormatError

FORMAT = "crowdtrain-model/1"  # the value of the `format` key, changed if the keys change meaning


def model_metadata(
    job_id: int,
    job_name: str,
    spec: dict[str, Any],
    model_config: dict[str, Any],
    param_version: int,
    val_accuracy: float | None,
) -> dict[str, str]:
    """The header metadata of a job's exported model; `val_accuracy` "" when it could not be evaluated."""
    return {
        "format": FORMAT,
        "crowdtrain_version": __version__,
        "job_id": str(job_id),
        "job_name": job_name,
        "job_spec": json.dumps(spec, sort_keys=True),
        "framework": job_framework(model_config),
        "model_name": str(model_config["name"]),
        "model_config": json.dumps(model_config, sort_keys=True),
        "param_version": str(param_version),
        "val_accuracy": "" if val_accuracy is None else repr(float(val_accuracy)),
    }


def _split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, data) of a safetensors file; TensorFormatError if the header cannot be read."""
    if len(blob) < 8:
        raise TensorFormatError("not a safetensors file: shorter than its header's length")
    size = int.from_bytes(blob[:8], "little")
    if size > min(MAX_HEADER_BYTES, len(blob) - 8):
        raise TensorFormatError(f"not a safetensors file: a header of {size} bytes")
    try:
        header = json.loads(blob[8 : 8 + size])
    except (UnicodeDecodeError, ValueError) as exc:
        raise TensorFormatError(f"not a safetensors file: its header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise TensorFormatError("not a safetensors file: its header is not an object")
    return header, blob[8 + size :]


def with_metadata(blob: bytes, metadata: dict[str, str]) -> bytes:
    """`blob` (safetensors) with its header's `__metadata__` replaced by `metadata`.

    The tensors' names, dtypes, shapes and offsets stay as they are and the data section is copied
    byte for byte, so the file decodes to exactly the tensors of `blob`. The header is padded with
    spaces to a multiple of 8 bytes, as the safetensors library writes it, keeping the data aligned.
    """
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("safetensors metadata maps strings to strings")
    header, data = _split(blob)
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def read_metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file ({} if it has none)."""
    header, _ = _split(blob)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise TensorFormatError("not a safetensors file: __metadata__ is not an object")
    return {str(k): str(v) for k, v in metadata.items()}
