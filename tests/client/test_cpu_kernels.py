"""The oneDNN self-test: a child that crashes or hangs turns oneDNN off in the process that asked, one
that trains leaves it on; and the real self-test runs its network to the end where oneDNN works."""

import pytest
import torch

from crowdtrain.client import cpu_kernels

CRASHES = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
HANGS = "import threading; threading.Event().wait()"  # never set: the child waits until it is killed
ENDS = "pass"


@pytest.fixture
def onednn_on():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this build of PyTorch has no oneDNN")
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True
    yield
    torch.backends.mkldnn.enabled = was


def test_a_child_that_crashes_or_hangs_fails_the_self_test_and_one_that_ends_passes() -> None:
    assert cpu_kernels.onednn_trains(30.0, CRASHES) is False
    assert cpu_kernels.onednn_trains(0.5, HANGS) is False
    assert cpu_kernels.onednn_trains(30.0, ENDS) is True


def test_a_failed_self_test_turns_onednn_off_and_a_passed_one_leaves_it_on(onednn_on: None) -> None:
    asked: list[bool] = []
    cpu_kernels.guard_cpu_training("cuda:0", trains=lambda: asked.append(True) or False)
    assert asked == [] and torch.backends.mkldnn.enabled, "training on another device: nothing to check"

    cpu_kernels.guard_cpu_training(trains=lambda: True)
    assert torch.backends.mkldnn.enabled

    cpu_kernels.guard_cpu_training("cpu", trains=lambda: cpu_kernels.onednn_trains(30.0, CRASHES))
    assert not torch.backends.mkldnn.enabled

    cpu_kernels.guard_cpu_training(trains=lambda: asked.append(True) or False)
    assert asked == [], "with oneDNN off already there is nothing to check"


def test_the_self_test_s_own_network_trains_here_without_onednn() -> None:
    """The child's script itself is sound: with oneDNN off (PyTorch's own kernels) it runs to its end,
    so a failure with oneDNN on is oneDNN's."""
    script = "import torch; torch.backends.mkldnn.enabled = False\n" + cpu_kernels._SELF_TEST
    assert cpu_kernels.onednn_trains(cpu_kernels.SELF_TEST_TIMEOUT_S, script) is True


def test_the_verdict_is_kept_per_machine_and_taken_once(tmp_path) -> None:
    path = tmp_path / "onednn-self-test-k.json"
    tested: list[bool] = []

    def test() -> bool:
        tested.append(True)
        return False

    assert cpu_kernels.kept_verdict(path, test) is False
    assert cpu_kernels.kept_verdict(path, test) is False
    assert tested == [True], "the second process reads the kept verdict"

    path.write_text("{not json")  # a broken file: tested again, and written whole
    assert cpu_kernels.kept_verdict(path, lambda: True) is True
    assert cpu_kernels.kept_verdict(path, test) is True and tested == [True]

    assert len(cpu_kernels.machine_key()) == 16
    assert cpu_kernels.verdict_file("abc").name == "onednn-self-test-abc.json"
