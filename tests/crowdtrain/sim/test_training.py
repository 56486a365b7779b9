"""The training simulator: its protocol (dispatch, prefetch, epochs, staleness, uploads), real learning and its CLI.

Fast: a tiny synthetic dataset, and the compute-free mode wherever training does not matter.
"""

import json
import statistics

import numpy as np
import pytest
from typer.testing import CliRunner

import crowdtrain.sim.slots as sim_slots
from crowdtrain.assimilator.rules.control import LossControlled
from crowdtrain.cli import app
from crowdtrain.sim.hosts import Fleet
from crowdtrain.sim.records import ShardDeals
from crowdtrain.sim.servers import EVAL_SECONDS, MERGE_SECONDS, PASS_SECONDS
from crowdtrain.sim.training import simulate_training
from crowdtrain.workgen.datasets import Dataset, deal_shards
from tests.crowdtrain.sim.conftest import INSTANT, PAPER, job, timed


def test_a_preempted_workunit_is_dispatched_again_at_its_timeout(blobs: Dataset) -> None:
    t_o = 5.0
    r = simulate_training(
        job(2, 20),
        hosts=4,
        p=0.3,
        timeout=t_o,
        seed=1,
        speed_sigma=0,
        workunit_seconds=1.0,
        restart_seconds=0.0,
        compute=False,
        data=blobs,
        retry_after=0.0,  # idle hosts ask at every event, not only every retry_after seconds
    )
    # The job ends with its last epoch; a workunit of the epoch before may still wait for its deadline.
    preempted = [d for d in r.trace if d.preempted and d.time + t_o <= r.sim_seconds]
    assert len(preempted) >= 5 and r.timeouts == len(preempted)
    for d in preempted:
        again = next(e for e in r.trace if e.workunit == d.workunit and e.time > d.time)
        # Idle slots are always there (2 workunits per epoch, 4 slots): the scheduler re-dispatches it
        # the moment it notices, at the deadline, and not before.
        assert again.time == pytest.approx(d.time + t_o)
    assert r.epochs == 20 and r.outcome == "failed"  # every epoch ran; the target is unreachable


def test_the_next_epoch_is_released_once_the_current_one_has_nothing_left_to_dispatch(blobs: Dataset) -> None:
    r = timed(
        job(4, 3),
        blobs,
        hosts=3,
        slots=2,
        merge_seconds=MERGE_SECONDS,
        eval_seconds=EVAL_SECONDS,
        pass_seconds=PASS_SECONDS,
    )
    first_of_epoch_2 = min(d.time for d in r.trace if d.epoch == 2)
    last_of_epoch_1 = max(d.time for d in r.trace if d.epoch == 1)
    assert first_of_epoch_2 == last_of_epoch_1 == 0.0  # 6 slots, 4 workunits: epoch 2 starts at once
    assert not [d for d in r.trace if d.epoch == 3 and d.time < 1.0]  # not before epoch 1 closes


def test_staleness_grows_with_slots(blobs: Dataset) -> None:
    mean = {}
    for slots in (2, 8, 32):
        r = simulate_training(job(64, 3), hosts=slots, seed=0, compute=False, data=blobs, **INSTANT)
        mean[slots] = r.staleness_summary()["mean"]
    assert mean[2] < mean[8] < mean[32]
    assert mean[32] > 16  # about slots - 1 merges land while one workunit runs


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_host_holds_its_slots_and_one_more_with_prefetch(blobs: Dataset, prefetch: bool) -> None:
    """As the client (client/worker.py): `slots` assignments not yet trained, +1 with prefetch; the
    extra one is used, and it is what lets a new request go out before a slot frees."""
    slots = 2
    r = simulate_training(
        job(16, 3), hosts=3, slots=slots, seed=2, network_seconds=0.05, compute=False, data=blobs, prefetch=prefetch
    )
    held = [r.held(d.host, d.time) for d in r.trace]
    assert max(held) == slots + prefetch


def test_prefetch_makes_one_slot_results_stale(blobs: Dataset) -> None:
    """One slot: without prefetch and with instant merges, every result starts from the W_s the one
    before it made (staleness 0). With prefetch, the next assignment is fetched while one trains,
    so each result after the first misses at least the one merged meanwhile; with the parameter
    servers' default service times the request even overtakes the upload: 2, as the real system measures."""

    def staleness(prefetch: bool, **servers: float) -> list[int]:
        return simulate_training(
            job(4, 5), hosts=1, workunit_seconds=1.0, compute=False, data=blobs, prefetch=prefetch, **servers
        ).staleness

    assert set(staleness(False, **INSTANT)) == {0}
    assert staleness(True, **INSTANT)[1:] and min(staleness(True, **INSTANT)[1:]) >= 1
    assert staleness(True)[2:] == [2] * 18


def test_in_rounds_every_result_of_a_round_starts_from_the_round_s_snapshot(blobs: Dataset) -> None:
    """Rounds of 4 on 3 hosts of 2 slots with prefetch and the parameter servers' service times: never
    more than 4 in flight, and each round's results were all dispatched with the snapshot the last
    round ended with, so the k-th merge of a round has staleness k - 1. The same rule without rounds
    lets the slots run ahead of the buffer."""
    rule = {"rule": "fedbuff", "buffer_size": 4, "outer_optimizer": "nesterov", "server_lr": 0.7}
    spec = job(16, 3, assimilation=rule, scheduling={"rounds": True})
    r = simulate_training(spec, hosts=3, slots=2, seed=1, network_seconds=0.05, compute=False, data=blobs)
    assert r.merges == 48 and max(d.in_flight for d in r.trace) == 4
    assert r.staleness == [i % 4 for i in range(48)]
    free = simulate_training(
        job(16, 3, assimilation=rule), hosts=3, slots=2, seed=1, network_seconds=0.05, compute=False, data=blobs
    )
    assert max(d.in_flight for d in free.trace) > 4 and max(free.staleness) > 3


def test_the_staleness_bound_of_the_policy_refuses_stale_results(blobs: Dataset) -> None:
    r = simulate_training(job(8, 2, assimilation={"max_staleness": 1}), hosts=8, seed=0, compute=False, data=blobs)
    assert r.refusals.get("stale", 0) > 0
    assert max(r.staleness) <= 1  # only results within the bound were merged


def test_training_a_real_model_improves_its_accuracy(blobs: Dataset) -> None:
    spec = job(4, 6, stop={"target_accuracy": 0.97}, assimilation={"rule": "vc-asgd", "alpha": 0.5})
    r = simulate_training(spec, hosts=2, slots=2, seed=0, data=blobs, **INSTANT)
    assert r.metrics[0].accuracy < 0.9 and r.best_accuracy >= 0.97, [m.accuracy for m in r.metrics]
    assert r.outcome == "succeeded" and r.final_accuracy is not None and r.uploads == r.merges
    assert r.examples == r.merges * 640 // 4  # one local epoch over a 160-example shard per merge
    reached = r.first_reaching(0.97)
    assert reached is not None and 0 < reached.examples <= r.examples and reached.time > 0


@pytest.mark.parametrize("compute", [False, True])
def test_upload_bytes_are_those_of_the_jobs_encoding(blobs: Dataset, compute: bool) -> None:
    """int8 deltas take about 0.27 of float32 weights' bytes (one byte a value, plus scales and the
    header), bfloat16 about half; the compute-free mode counts what a real upload would weigh."""

    def per_upload(upload: dict) -> int:
        spec = job(4, 2, model={"options": {"hidden": [128, 128]}}, assimilation={"upload": upload})
        s = simulate_training(spec, hosts=2, seed=0, compute=compute, data=blobs, **INSTANT).summary()
        assert s["bytes_uploaded_per_merge"] == s["upload_bytes"]  # every upload merged
        return s["upload_bytes"]

    weights = per_upload({"send": "weights"})
    assert weights > 4 * 17_000  # float32 values of a 17,924-parameter MLP
    assert 0.24 <= per_upload({"send": "delta", "dtype": "int8"}) / weights <= 0.30
    assert 0.48 <= per_upload({"send": "delta", "dtype": "bfloat16"}) / weights <= 0.52


def test_an_int8_upload_is_decoded_as_the_server_decodes_it(blobs: Dataset) -> None:
    """The merged W_c is W_base + the int8-rounded Δ: the run differs from a float32 one, and still learns."""

    def run(upload: dict):
        spec = job(
            4, 4, stop={"target_accuracy": 0.97}, assimilation={"rule": "vc-asgd", "alpha": 0.5, "upload": upload}
        )
        return simulate_training(spec, hosts=2, seed=0, data=blobs)

    exact, int8 = run({"send": "weights"}), run({"send": "delta", "dtype": "int8"})
    assert [m.loss for m in int8.metrics] != [m.loss for m in exact.metrics]
    assert int8.best_accuracy >= 0.97 and int8.upload == "delta/int8"


def test_dynamic_local_work_gives_slow_hosts_less_work_and_less_staleness(blobs: Dataset) -> None:
    """16 hosts of widely spread speeds: with dynamic local work the hosts below the reference speed
    train a fraction < 1 of the local epochs once measured, so their results are less stale. Without
    the in-flight budget, which would cap everyone's staleness and blur the difference."""

    def run(dynamic: bool):
        spec = job(64, 6, training={"dynamic_local_work": dynamic})
        return simulate_training(spec, hosts=16, seed=0, speed_sigma=0.8, compute=False, data=blobs, backpressure=False)

    fixed, dynamic = run(False), run(True)
    speeds = np.asarray(dynamic.host_speeds)
    slow = set(np.flatnonzero(speeds < np.median(speeds)).tolist())
    assert all(d.local_fraction == 1.0 for d in fixed.trace)
    measured = [d for d in dynamic.trace if d.host in slow and d.time > 0]
    assert measured and all(d.local_fraction < 1.0 for d in measured)
    assert max(d.local_fraction for d in dynamic.trace if d.host == int(speeds.argmax())) == 1.0

    def slow_mean(r) -> float:
        return statistics.fmean(s for h, s in r.staleness_by_host().items() if h in slow)

    assert slow_mean(dynamic) < slow_mean(fixed)
    assert statistics.pstdev(dynamic.staleness_by_host().values()) < statistics.pstdev(
        fixed.staleness_by_host().values()
    )


def test_dynamic_local_work_trains_fewer_examples_on_slow_hosts(blobs: Dataset) -> None:
    spec = job(4, 3, training={"dynamic_local_work": True})
    r = simulate_training(spec, hosts=4, seed=0, speed_sigma=0.8, data=blobs)
    assert any(d.local_fraction < 1.0 for d in r.trace)
    assert 0 < r.examples < r.merges * 640 // 4  # some results trained part of the shard's local epoch


def test_shards_are_dealt_stratified_as_the_work_generator_deals_them(blobs: Dataset) -> None:
    deals = ShardDeals(blobs.y, {"subsets": 4, "shuffle": "stratified"}, seed=7)
    first = deals.of(0)
    assert all(np.array_equal(a, b) for a, b in zip(first, deal_shards(blobs.y, 4, "stratified", 7), strict=True))
    counts = np.bincount(blobs.y)
    for shard in first:
        assert np.all(np.abs(np.bincount(blobs.y[shard], minlength=4) - counts / 4) < 1)
    again = deals.of(2)
    assert sorted(np.concatenate(again).tolist()) == list(range(len(blobs.y)))
    assert not np.array_equal(again[0], first[0])


@pytest.mark.parametrize("reshuffle", [False, True])
def test_a_reshuffled_epoch_has_new_shards_to_download(blobs: Dataset, reshuffle: bool) -> None:
    """One slot: each shard is fetched once, or once per epoch when every epoch deals anew."""
    spec = job(4, 3, dataset={"reshuffle_each_epoch": reshuffle})
    r = timed(spec, blobs, hosts=1, network_seconds=0.25, **PAPER)
    fetches = 12 if reshuffle else 4
    assert r.sim_seconds == pytest.approx(12 * (1.0 + 0.25) + fetches * 0.25 + 0.25)


def test_bad_settings_are_refused_naming_the_field(blobs: Dataset) -> None:
    with pytest.raises(ValueError, match="p \\(preemption probability\\)"):
        Fleet(p=1.0)
    with pytest.raises(ValueError, match="slots"):
        simulate_training(job(4, 1), slots=0, compute=False, data=blobs)
    with pytest.raises(ValueError, match="max_epochs"):
        simulate_training(job(4, 0), compute=False, data=blobs)


def test_cli_simulates_training_and_prints_one_json_line(tmp_path, blobs: Dataset) -> None:
    np.savez(tmp_path / "blobs.npz", x=blobs.x, y=blobs.y, x_val=blobs.x_val, y_val=blobs.y_val)
    spec = job(4, 2)
    spec["dataset"]["source"] = f"npz:{tmp_path / 'blobs.npz'}"
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = CliRunner().invoke(
        app,
        [
            "simulate",
            "training",
            str(tmp_path / "spec.json"),
            "--hosts",
            "2",
            "--no-compute",
            "--workunit-seconds",
            "1",
            "--speed-sigma",
            "0",
            "--merge-seconds",
            "0",
            "--eval-seconds",
            "0",
            "--pass-seconds",
            "0",
        ],
    )
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output.strip().splitlines()[-1])
    assert summary["merges"] == 8 and summary["sim_seconds"] == 4.0 and summary["compute"] is False


def test_cli_refuses_a_bad_spec_naming_the_field(tmp_path) -> None:
    spec = job(0, 2)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = CliRunner().invoke(app, ["simulate", "training", str(tmp_path / "spec.json"), "--no-compute"])
    assert out.exit_code == 2 and "dataset.subsets" in out.output


def test_cli_simulate_without_subcommand_is_still_the_load_generator() -> None:
    out = CliRunner().invoke(app, ["simulate", "--hosts", "3"])
    assert out.exit_code == 2 and "--server" in out.output


def test_max_in_flight_caps_the_unmerged_assignments_at_every_dispatch(blobs: Dataset) -> None:
    """`scheduling.max_in_flight: 3` on 8 slots: one request at a time, so no slack over the budget."""
    spec = job(16, 3, scheduling={"max_in_flight": 3})
    r = simulate_training(spec, hosts=4, slots=2, seed=0, compute=False, data=blobs, merge_seconds=0.5)
    assert max(d.in_flight for d in r.trace) == 3
    assert r.epochs == 3 and r.merges == 48 and "max_epochs=3 reached" in r.message


def test_without_backpressure_a_run_is_what_it_was_before_the_budget(blobs: Dataset) -> None:
    """The figures the simulator gave before it held dispatch at the in-flight budget (same seeds), and
    before merges went in passes (one result a pass, a merge's whole cost per pass)."""
    for merge, speed_sigma, mean, seconds, backlog in (
        (0.035, 0.5, 12.04, 13.055916493442467, 3),
        (1.0, 0.0, 34.02, 97.0, 55),
    ):
        r = simulate_training(
            job(32, 3),
            hosts=4,
            slots=2,
            seed=0,
            speed_sigma=speed_sigma,
            workunit_seconds=1.0,
            compute=False,
            data=blobs,
            merge_seconds=merge,
            eval_seconds=0.0,
            pass_seconds=0.0,
            max_pass=1,
            backpressure=False,
            retry_after=0.0,
        )
        assert (r.staleness_summary()["mean"], r.sim_seconds, r.merges, r.longest_backlog) == (
            mean,
            pytest.approx(seconds),
            96,
            backlog,
        )


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("asked", ["no", "by the simulator's option", "by the job spec"])
def test_a_hosts_slots_keep_their_optimizer_state_across_workunits_only_when_asked(
    blobs: Dataset, monkeypatch: pytest.MonkeyPatch, slots: int, asked: str
) -> None:
    """One host, 5 Adam steps a workunit (160-example shards, batch 32). By default every workunit's
    optimizer starts from zero, as the client's does. Kept (the simulator's option, or the spec's
    training.keep_optimizer_state as the client reads it), each slot's first workunit starts from
    zero and every later one from the very state a workunit of that host ended with, each such state
    taken once: a chain per slot, whose Adam step count grows by 5 a workunit."""
    calls: list[tuple[dict | None, dict]] = []  # (the state training started from, the one it ended with)
    real_train = sim_slots.train

    def spy(*args, optimizer_state=None, **kwargs):
        result = real_train(*args, optimizer_state=optimizer_state, **kwargs)
        calls.append((optimizer_state, result.optimizer_state))
        return result

    monkeypatch.setattr(sim_slots, "train", spy)
    spec, keep = job(4, 3), asked != "no"
    spec["training"]["keep_optimizer_state"] = asked == "by the job spec"
    simulate_training(
        spec,
        hosts=1,
        slots=slots,
        seed=0,
        data=blobs,
        keep_optimizer_state=asked == "by the simulator's option",
        **INSTANT,
    )
    assert len(calls) == 12  # 3 epochs of 4 workunits
    starts = [start for start, _ in calls]
    if not keep:
        assert starts == [None] * 12
        return
    assert [s is None for s in starts] == [True] * slots + [False] * (12 - slots)
    ends = [end for _, end in calls]
    sources = [
        next(j for j, end in enumerate(ends[:i]) if end is start) for i, start in enumerate(starts) if start is not None
    ]
    assert len(set(sources)) == len(sources)  # no state continues in two slots
    for i, start in enumerate(starts):
        started_at = float(start["__opt__/0/step"]) if start is not None else 0.0
        assert float(ends[i]["__opt__/0/step"]) == started_at + 5


def test_a_host_given_nothing_asks_again_after_retry_after_or_when_its_own_slot_frees(blobs: Dataset) -> None:
    """As the client does (client/worker.py): an in-flight budget of 1 and two one-slot hosts of
    1-second workunits. Host 1, refused at t = 0, sleeps for retry_after; host 0's slot frees every
    second and it asks at once, so host 1's polls at t = 2, 4, ... find the budget taken: host 0 does
    all the work. With retry_after 0 host 1 asks at every event and, the older request, is served at t = 1."""

    def served(retry_after: float) -> list[tuple[float, int]]:
        spec = job(8, 1, scheduling={"max_in_flight": 1})
        r = timed(spec, blobs, hosts=2, prefetch=False, retry_after=retry_after)
        return [(d.time, d.host) for d in r.trace]

    assert served(2.0) == [(float(t), 0) for t in range(8)]
    assert served(0.0)[:3] == [(0.0, 0), (1.0, 1), (2.0, 0)]


def test_a_rule_that_follows_the_validation_loss_sees_the_latest_evaluation(blobs: Dataset, monkeypatch) -> None:
    """`step_control: loss` in the simulator as on the parameter servers: each merge's update carries
    the newest evaluation recorded before it (W_s version, loss), None before the first."""
    seen: list[tuple[int, float] | None] = []
    apply = LossControlled.apply
    monkeypatch.setattr(
        LossControlled, "apply", lambda self, w, st, u: (seen.append(u.validation), apply(self, w, st, u))
    )
    spec = job(4, 2, assimilation={"rule": "delta", "staleness_weight": "polynomial", "step_control": "loss"})
    r = simulate_training(spec, hosts=2, seed=0, data=blobs, **PAPER)

    assert seen[0] is None and len(seen) == r.merges
    evaluated = {(m.version, m.loss) for m in r.metrics}
    assert all(v in evaluated for v in seen[1:]) and len(set(seen[1:])) > 1
    assert [v for v, _ in seen[1:]] == sorted(v for v, _ in seen[1:])  # never an older one after a newer
