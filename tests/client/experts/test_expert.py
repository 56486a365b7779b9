"""An expert on its host: the same initial weights everywhere, checkpoints that carry it to another host,
and the snapshots that keep what a dying host loses within one checkpoint interval."""

import threading

import numpy as np
import pytest
import torch

from crowdtrain.client.experts.expert import Expert, ExpertFailed
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.tensors import decode, encode
from crowdtrain.core.zoo_experts import build_expert

LAYOUT = ExpertLayout(layers=2, grid=[4, 4], dim=8, hidden=16, k=4, k_min=2, lr=0.01, max_rows=32)


def test_every_host_builds_an_expert_with_the_same_initial_weights_and_leaves_the_global_seed_alone() -> None:
    torch.manual_seed(7)
    before = torch.rand(1)
    torch.manual_seed(7)
    a, b, other = build_expert(LAYOUT, "0.1.2"), build_expert(LAYOUT, "0.1.2"), build_expert(LAYOUT, "0.2.1")
    assert torch.rand(1) == before
    for pa, pb, po in zip(a.parameters(), b.parameters(), other.parameters(), strict=True):
        assert torch.equal(pa, pb) and not torch.equal(pa, po)


def trained(uid: str, steps: int) -> Expert:
    expert = Expert(LAYOUT, uid)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x, g = rng.normal(size=(2, 4, LAYOUT.dim)).astype(np.float32)
        expert.backward(x, g)
    return expert


def test_a_checkpoint_restored_on_another_host_goes_on_exactly_as_the_original() -> None:
    original = trained("1.2.3", 3)
    steps, checkpoint = original.state()
    assert steps == 3
    moved = Expert(LAYOUT, "1.2.3")
    moved.restore(checkpoint)
    assert moved.steps == 3
    x, g = np.random.default_rng(5).normal(size=(2, 6, LAYOUT.dim)).astype(np.float32)
    np.testing.assert_array_equal(original.forward(x), moved.forward(x))
    original.backward(x, g)  # the optimizer's moments came along: the same next step
    moved.backward(x, g)
    np.testing.assert_array_equal(original.forward(x), moved.forward(x))


def test_a_checkpoint_of_a_fresh_expert_has_no_moments_and_restores() -> None:
    fresh = Expert(LAYOUT, "0.0.0")
    steps, checkpoint = fresh.state()
    assert steps == 0 and not any(k.startswith("adam/") for k in decode(checkpoint))
    Expert(LAYOUT, "0.0.0").restore(checkpoint)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: {k: v for k, v in t.items() if k != "steps"}, "without its weights or step count"),
        (lambda t: {k: v for k, v in t.items() if not k.startswith("param/net.0")}, "without its weights"),
        (lambda t: {**t, "param/net.0.weight": np.zeros((3, 3), np.float32)}, "has shape"),
        (lambda t: {**t, "param/net.0.bias": np.full(16, np.nan, np.float32)}, "NaN"),
        (lambda t: {**t, "param/extra": np.zeros(1, np.float32)}, "names differ|more than"),
    ],
)
def test_a_checkpoint_that_is_not_this_experts_is_refused_and_changes_nothing(change, message) -> None:
    expert = trained("0.1.1", 2)
    _, checkpoint = expert.state()
    x = np.ones((2, LAYOUT.dim), np.float32)
    before = expert.forward(x)
    with pytest.raises(ValueError, match=message):
        expert.restore(encode(change(dict(decode(checkpoint)))))
    np.testing.assert_array_equal(expert.forward(x), before)
    assert expert.steps == 2


def test_a_checkpoint_of_another_expert_shape_is_refused() -> None:
    other = ExpertLayout(layers=2, grid=[4, 4], dim=8, hidden=24, k=4)
    _, checkpoint = Expert(other, "0.1.1").state()
    with pytest.raises(ValueError, match="has shape"):
        Expert(LAYOUT, "0.1.1").restore(checkpoint)


def test_replicas_averaged_at_a_checkpoint_meet_halfway_and_keep_their_own_step_count() -> None:
    a, b = trained("0.1.2", 3), Expert(LAYOUT, "0.1.2")
    before = {n: p.detach().clone() for n, p in b.module.named_parameters()}
    x = np.random.default_rng(1).normal(size=(4, LAYOUT.dim)).astype(np.float32)
    b.backward(x, x)  # b has one step and Adam moments of its own
    moments = {n: b.optimizer.state[p]["exp_avg"].clone() for n, p in b.module.named_parameters()}
    own = {n: p.detach().clone() for n, p in b.module.named_parameters()}
    peer = decode(a.state()[1])
    b.average_with(a.state()[1])
    assert b.steps == 1
    for n, p in b.module.named_parameters():
        assert torch.allclose(p, (own[n] + torch.from_numpy(peer[f"param/{n}"])) / 2, atol=1e-6)
        assert not torch.equal(p, before[n])
        expected = (moments[n] + torch.from_numpy(peer[f"adam/exp_avg/{n}"])) / 2
        assert torch.allclose(b.optimizer.state[p]["exp_avg"], expected, atol=1e-6)


def test_a_checkpoint_of_another_expert_is_not_averaged_with() -> None:
    a, b = trained("0.1.2", 1), Expert(LAYOUT, "0.1.2")
    wrong = decode(a.state()[1])
    wrong[next(k for k in wrong if k.startswith("param/"))] = np.ones((3, 3), np.float32)  # not its shape
    before = [p.detach().clone() for p in b.module.parameters()]
    with pytest.raises(ValueError):
        b.average_with(encode(wrong))
    assert all(torch.equal(p, q) for p, q in zip(b.module.parameters(), before, strict=True))


def call(seed: int) -> tuple[np.ndarray, np.ndarray]:
    x, g = np.random.default_rng(seed).normal(size=(2, 4, LAYOUT.dim)).astype(np.float32)
    return x, g


def test_a_kept_expert_snapshots_exactly_the_step_that_ends_each_half_interval() -> None:
    kept, twin, notified = Expert(LAYOUT, "0.1.2"), Expert(LAYOUT, "0.1.2"), []
    kept.keep_checkpoints(6, wait=5.0, notify=lambda: notified.append(kept.steps))
    for i in range(3):
        kept.backward(*call(i))
        twin.backward(*call(i))
    assert notified == [3]
    step, checkpoint = kept.take_snapshot() or (0, b"")
    assert step == 3 and kept.take_snapshot() is None  # handed over once
    kept.stored(step)
    kept.backward(*call(3))  # a step after the snapshot does not change it
    restored = Expert(LAYOUT, "0.1.2")
    restored.restore(checkpoint)
    assert restored.steps == 3
    x = call(9)[0]
    np.testing.assert_array_equal(restored.forward(x), twin.forward(x))
    assert restored.state()[1] == twin.state()[1]


def test_a_step_beyond_the_interval_past_the_stored_checkpoint_is_refused_until_one_is_stored() -> None:
    expert = Expert(LAYOUT, "0.1.2")
    expert.keep_checkpoints(4, wait=0.05, notify=lambda: None)
    for i in range(4):
        expert.backward(*call(i))
    snapshot = expert.take_snapshot()
    assert snapshot is not None and snapshot[0] == 4 and expert.stored_step == 0
    weights = [p.detach().clone() for p in expert.module.parameters()]
    with pytest.raises(ExpertFailed, match="waits for the checkpoint of step 4"):
        expert.backward(*call(4))
    assert expert.steps == 4 and all(
        torch.equal(p, w) for p, w in zip(expert.module.parameters(), weights, strict=True)
    )
    expert.stored(2)  # the checkpoint of step 2 stored: up to step 6 may go on, no further
    expert.backward(*call(4))
    expert.backward(*call(5))
    with pytest.raises(ExpertFailed, match="step 7 waits"):
        expert.backward(*call(6))
    expert.stored(6)
    expert.backward(*call(6))
    assert expert.steps == 7


def test_a_waiting_step_goes_on_as_soon_as_its_checkpoint_is_stored_and_forwards_are_not_held() -> None:
    expert = Expert(LAYOUT, "0.1.2")
    expert.keep_checkpoints(2, wait=60.0, notify=lambda: None)
    expert.backward(*call(0))
    expert.backward(*call(1))
    done = threading.Event()
    waiting = threading.Thread(target=lambda: (expert.backward(*call(2)), done.set()))
    waiting.start()
    assert not done.wait(0.2) and expert.steps == 2
    expert.forward(call(3)[0])  # the waiting step does not hold the lock
    expert.stored(2)
    waiting.join(30)
    assert done.is_set() and expert.steps == 3


def test_a_restored_expert_counts_its_checkpoint_as_stored() -> None:
    _, checkpoint = trained("0.1.2", 5).state()
    expert = Expert(LAYOUT, "0.1.2")
    expert.restore(checkpoint)
    expert.keep_checkpoints(2, wait=0.05, notify=lambda: None)
    expert.backward(*call(0))
    expert.backward(*call(1))
    assert expert.steps == 7 and expert.take_snapshot() is not None
    with pytest.raises(ExpertFailed):
        expert.backward(*call(2))
