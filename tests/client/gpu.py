"""The devices a test that compares computing places runs on: the CPU everywhere, and the first CUDA
device where torch sees one (skipped elsewhere)."""

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]
