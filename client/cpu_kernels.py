"""Whether PyTorch's oneDNN kernels train a convolutional network on this CPU, checked once per machine.

PyTorch runs CPU convolutions through oneDNN, 2-3x faster than its own kernels (the zoo's cnn1d: 6-9
against 18 ms a step). Some builds crash or hang inside a convolution's backward pass on some CPUs:
torch 2.13.0+cpu on an AMD EPYC with AVX2 and no AVX-512 stopped in the second or third backward
pass of the zoo's resnet, with a segmentation fault or at 100% of a core, one thread or two
(oneDNN's own tracker has such corner cases, e.g. uxlfoundation/oneDNN#5942). A crash there kills
the client on every workunit, and a hang holds its slot until the deadline.

So before a process first trains on the CPU (`guard_cpu_training`), a child process takes
SELF_TEST_STEPS steps of the zoo's resnet with oneDNN on. When the child does not finish them (it
crashed, or did not end within SELF_TEST_TIMEOUT_S), oneDNN is turned off in this process, with a
warning that says why: slower convolutions, against none at all. The child costs a few seconds
(mostly importing torch), once per machine: its verdict is kept in the user's cache directory
($XDG_CACHE_HOME/crowdtrain, by default ~/.cache/crowdtrain), keyed by PyTorch's version and the
CPU's name and features, for every later process (every client, every slot).
Where oneDNN is off or missing there is nothing to check.
"""

import contextlib
import functools
import hashlib
import json
import logging
import platform
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from crowdtrain.client.files import replace_file
from crowdtrain.core.settings import user_cache_dir

log = logging.getLogger(__name__)

SELF_TEST_STEPS = 6
SELF_TEST_TIMEOUT_S = 60.0

# The child: a small resnet from the zoo, the configuration that stopped, trained with oneDNN on.
_SELF_TEST = f"""
import torch
from crowdtrain.core.zoo import build_model
torch.manual_seed(0)
model = build_model("resnet", [3, 32, 32], 5, seed=0, width=4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(8, 3, 32, 32), torch.arange(8) % 5
for _ in range({SELF_TEST_STEPS}):
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
"""

_guard = threading.Lock()


def machine_key() -> str:
    """What the self-test's verdict holds for: PyTorch's version (its build carries its oneDNN), the
    CPU's name and features."""
    cpu = platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu += "".join(next((line for line in lines if line.startswith(f)), "") for f in ("model name", "flags"))
    described = f"{torch.__version__}|{cpu}"  # a PyTorch build carries its own oneDNN
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def verdict_file(key: str | None = None) -> Path:
    return user_cache_dir() / f"onednn-self-test-{key or machine_key()}.json"


def kept_verdict(path: Path, test: Callable[[], bool]) -> bool:
    """The verdict kept at `path`, else `test()`'s, kept there (written whole, or not at all: a
    cache that cannot be written only means testing again next time)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        kept = json.loads(path.read_text())["trains"]
        if isinstance(kept, bool):
            return kept
    trains = test()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps({"trains": trains, "torch": torch.__version__}))
    return trains


def onednn_trains(timeout: float = SELF_TEST_TIMEOUT_S, script: str = _SELF_TEST) -> bool:
    """Whether a child process ran `script` (the self-test: training its network with oneDNN) to its
    end within `timeout` seconds."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, timeout=timeout, check=False, text=True
        )
    except subprocess.TimeoutExpired:
        log.warning("oneDNN self-test: no end after %.0f s of %d training steps", timeout, SELF_TEST_STEPS)
        return False
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        log.warning("oneDNN self-test: the child ended with status %d (%s)", done.returncode, last)
    return done.returncode == 0


@functools.cache  # for the process: every workunit's training asks
def _machine_verdict() -> bool:
    return kept_verdict(verdict_file(), onednn_trains)


def guard_cpu_training(device: str | torch.device = "cpu", trains: Callable[[], bool] = _machine_verdict) -> None:
    """Before training on `device`: when it is the CPU, turn oneDNN off in this process if it does not
    train here (`trains`: the self-test's verdict for this machine, kept or taken now). Nothing for
    another device, or when oneDNN is already off, or unavailable, or trains."""
    if torch.device(device).type != "cpu":
        return
    with _guard:  # one check, even when several slots start at once
        if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
            return
        if not trains():
            log.warning(
                "PyTorch's oneDNN kernels crashed or hung training a small convolutional network on this "
                "CPU; training here without them (slower convolutions). Torch %s",
                torch.__version__,
            )
            torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a settable flag, typed as its descriptor
