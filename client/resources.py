"""The resources a client reports when it registers and asks for work: CPUs, RAM, GPU, frameworks."""

import os

from crowdtrain.client.trainers import available_frameworks
from crowdtrain.core.frameworks import Framework
from crowdtrain.core.schemas import Resources


def detect_resources(device: str, frameworks: list[Framework] | None = None) -> Resources:
    """What this machine offers the scheduler: CPU count, RAM, the GPU behind a `cuda` device, and the
    training frameworks installed (all that are, unless `frameworks` names some)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    gpu = ""
    if device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else ""
    return Resources(
        cpus=os.cpu_count() or 1, ram_bytes=ram, gpu=gpu, device=device, frameworks=frameworks or available_frameworks()
    )
