"""Which torch device the client trains on: `auto`, `cpu`, `cuda`, `cuda:N` or `mps`.

`resolve_device` is a pure function over what torch reports (`Accelerators`), so the rules are
tested without the hardware; `detect_accelerators` asks the installed torch.
"""

from dataclasses import dataclass

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


class DeviceUnavailable(ValueError):
    """The requested device is unknown or not present on this machine."""


@dataclass(frozen=True)
class Accelerators:
    cuda_devices: int = 0
    mps: bool = False


def detect_accelerators() -> Accelerators:
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return Accelerators(cuda, mps)


def resolve_device(requested: str, found: Accelerators) -> str:
    """The concrete device for `requested`: auto prefers CUDA, then MPS, else CPU.

    CUDA is always named with its index (`cuda` means `cuda:0`) so the operator's host list says
    which GPU a host trains on. Raises DeviceUnavailable naming what this machine has instead.
    """
    name = requested.strip().lower()
    if name == "auto":
        return "cuda:0" if found.cuda_devices else "mps" if found.mps else "cpu"
    if name == "cpu":
        return "cpu"
    if name == "mps":
        if not found.mps:
            raise DeviceUnavailable(f"mps is not available on this machine ({_describe(found)})")
        return "mps"
    if name == "cuda" or name.startswith("cuda:"):
        return f"cuda:{_cuda_index(name, found)}"
    raise DeviceUnavailable(f"unknown device {requested!r}: expected {DEVICE_CHOICES}")


def _cuda_index(name: str, found: Accelerators) -> int:
    text = name.partition(":")[2] or "0"
    if not text.isdigit():
        raise DeviceUnavailable(f"unknown device {name!r}: expected {DEVICE_CHOICES}")
    index = int(text)
    if index >= found.cuda_devices:
        raise DeviceUnavailable(f"{name} is not available on this machine ({_describe(found)})")
    return index


def _describe(found: Accelerators) -> str:
    if not found.cuda_devices and not found.mps:
        return "it has no CUDA or MPS device"
    parts = (
        [f"{found.cuda_devices} CUDA device(s): cuda:0..cuda:{found.cuda_devices - 1}"] if found.cuda_devices else []
    )
    return "it has " + ", ".join(parts + (["mps"] if found.mps else []))
