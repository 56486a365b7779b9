"""A result's credit: the work asked for, in cobblestones."""

import pytest

from crowdtrain.core.credit import COBBLESTONE_FLOPS, result_credit


def test_a_cobblestone_is_a_two_hundredth_of_a_gflops_day() -> None:
    assert pytest.approx(1e9 * 86400 / 200) == COBBLESTONE_FLOPS


def test_credit_grows_with_examples_local_epochs_share_and_flops() -> None:
    base = result_credit(1000, 1, 1.0, 1_000_000)
    assert base == pytest.approx(1000 * 1_000_000 / COBBLESTONE_FLOPS)
    assert result_credit(2000, 1, 1.0, 1_000_000) == pytest.approx(2 * base)
    assert result_credit(1000, 3, 1.0, 1_000_000) == pytest.approx(3 * base)
    assert result_credit(1000, 1, 0.5, 1_000_000) == pytest.approx(base / 2)
    assert result_credit(1000, 1, 1.0, 0) == 0.0  # a job recorded before FLOPs were counted
