import numpy as np
import pytest
from pydantic import ValidationError

from crowdtrain.core import dedloc
from crowdtrain.core.jobspec import JobSpec, load_job_spec
from tests.conftest import EXAMPLE_SPEC


def test_step_closes_when_the_reports_reach_the_target() -> None:
    assert not dedloc.step_is_full({"a": 30, "b": 33}, 64)
    assert dedloc.step_is_full({"a": 30, "b": 34}, 64)
    assert dedloc.round_members({"b": 5, "a": 3, "c": 0}) == ["a", "b"]


def test_member_weights_are_shares_of_the_round() -> None:
    w = dedloc.member_weights({"a": 10, "b": 30})
    assert w == {"a": 0.25, "b": 0.75}
    with pytest.raises(ValueError):
        dedloc.member_weights({"a": 0})


@pytest.mark.parametrize(
    ("n", "g", "sizes"), [(3, 16, [3]), (5, 2, [2, 2, 1]), (7, 3, [3, 2, 2]), (4, 1, [1] * 4), (0, 4, [])]
)
def test_groups_are_balanced_and_bounded(n: int, g: int, sizes: list[int]) -> None:
    peers = [f"p{i}" for i in range(n)]
    groups = dedloc.form_groups(peers, g)
    assert [len(x) for x in groups] == sizes
    assert sorted(p for x in groups for p in x) == sorted(peers)


def test_plan_splits_relayed_members_from_groups() -> None:
    plan = dedloc.plan_round(["a", "b", "c", "d"], {"c"}, 2)
    assert plan.groups == [["a", "b"], ["d"]] and plan.relayed == ["c"]
    assert plan.parts == ["group-0", "group-1", "relay-c"] and plan.needs_combining
    assert not dedloc.plan_round(["a", "b"], set(), 4).needs_combining


def test_group_sums_combined_equal_the_global_weighted_average() -> None:
    rng = np.random.default_rng(0)
    examples = {f"p{i}": int(rng.integers(1, 50)) for i in range(7)}
    grads = {p: {"w": rng.normal(size=(4, 3)).astype(np.float32)} for p in examples}
    total = sum(examples.values())
    plan = dedloc.plan_round(sorted(examples), {"p2", "p5"}, 2)
    parts = [{"w": sum(grads[p]["w"] * np.float32(1 / total) for p in g)} for g in plan.groups]
    parts += [{"w": grads[p]["w"] * np.float32(1 / total)} for p in plan.relayed]
    combined = dedloc.combine_parts(parts)
    w = dedloc.member_weights(examples)
    # g_p is a summed-loss gradient: its mean-loss gradient is g_p / n_p, weighted by n_p / N.
    expected = sum(w[p] * grads[p]["w"].astype(np.float64) / examples[p] for p in examples)
    np.testing.assert_allclose(combined["w"], expected, rtol=1e-5, atol=1e-7)


def test_a_group_keeps_its_session_only_when_it_meets_again_unchanged() -> None:
    kept = {dedloc.group_key(["a", "b"]): "3.0.0", dedloc.group_key(["c", "d"]): "3.0.1"}
    sessions = dedloc.group_sessions([["a", "b"], ["c", "e"], ["d", "c"]], kept, "4.1.7")
    assert sessions == ["3.0.0", "4.1.7.1", "4.1.7.2"]  # same members in other ranks is another group
    assert [dedloc.new_session(s, "4.1.7") for s in sessions] == [False, True, True]
    assert not dedloc.new_session("4.1.7.2", "4.1.77") and not dedloc.new_session("14.1.7.2", "4.1.7")


def test_the_relay_sums_chunk_by_chunk_to_the_bits_of_whole_parts() -> None:
    rng = np.random.default_rng(1)
    size = 2 * dedloc.RELAY_CHUNK_FLOATS + 5
    parts = [{"g": rng.normal(size=size).astype(np.float32)} for _ in range(3)]
    whole = dedloc.combine_parts(parts)["g"].tobytes()
    chunks = [
        dedloc.combine_chunks([p["g"][i : i + dedloc.RELAY_CHUNK_FLOATS].tobytes() for p in parts])
        for i in range(0, size, dedloc.RELAY_CHUNK_FLOATS)
    ]
    assert dedloc.chunk_count(size) == len(chunks) == 3 and b"".join(chunks) == whole
    with pytest.raises(ValueError):
        dedloc.combine_chunks([b"\0" * 8, b"\0" * 4])


def test_combine_refuses_mismatched_parts() -> None:
    with pytest.raises(ValueError):
        dedloc.combine_parts([{"w": np.zeros(2)}, {"v": np.zeros(2)}])
    with pytest.raises(ValueError):
        dedloc.combine_parts([{"w": np.zeros(2)}, {"w": np.zeros(3)}])


def test_learning_rate_schedule_is_keyed_to_the_global_step() -> None:
    assert dedloc.learning_rate(0, 0.1, "constant", 4, 100) == pytest.approx(0.025)
    assert dedloc.learning_rate(3, 0.1, "constant", 4, 100) == pytest.approx(0.1)
    assert dedloc.learning_rate(50, 0.1, "constant", 0, 100) == 0.1
    assert dedloc.learning_rate(0, 0.1, "cosine", 0, 100) == pytest.approx(0.1)
    assert dedloc.learning_rate(50, 0.1, "cosine", 0, 100) == pytest.approx(0.05)
    assert dedloc.learning_rate(100, 0.1, "cosine", 0, 100) == pytest.approx(0.0)


def test_digest_changes_with_any_bit() -> None:
    a = {"w": np.ones(3, np.float32), "b": np.zeros(1, np.float32)}
    b = {"w": np.ones(3, np.float32), "b": np.zeros(1, np.float32)}
    assert dedloc.digest(a) == dedloc.digest(b)
    b["w"][1] = np.nextafter(np.float32(1), np.float32(2))
    assert dedloc.digest(a) != dedloc.digest(b)


def _dedloc_spec(**dedloc_fields) -> dict:
    data = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json", exclude_none=True)
    data.pop("assimilation")
    return data | {
        "mode": "dedloc",
        "stop": {"target_accuracy": 0.9, "max_steps": 100},
        "dedloc": {"target_batch_size": 256} | dedloc_fields,
    }


def test_a_dedloc_spec_is_valid() -> None:
    spec = JobSpec.model_validate(_dedloc_spec(max_group_size=2))
    assert spec.mode == "dedloc" and spec.dedloc.target_batch_size == 256 and spec.dedloc.max_group_size == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("dedloc"), "needs a 'dedloc' section"),
        (lambda d: d["stop"].pop("max_steps"), "needs stop.max_steps"),
        (lambda d: d["dedloc"].update(micro_batch_size=512), "micro_batch_size"),
        (lambda d: d["dedloc"].update(target_batch_size=0), "target_batch_size"),
        (lambda d: d["dedloc"].update(averaging_timeout=-1), "averaging_timeout"),
        (lambda d: d.update(model={"name": "resnet"}), "BatchNorm"),
        (lambda d: d.update(framework="tensorflow"), "peers train with PyTorch"),
        (lambda d: d.update(mode="vc-asgd"), "only allowed with mode 'dedloc'"),
    ],
)
def test_bad_dedloc_specs_say_what_is_wrong(change, message: str) -> None:
    data = _dedloc_spec()
    change(data)
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(data)
    assert message in str(err.value)


def test_job_submit_refuses_a_bad_dedloc_spec_with_exit_code_2(tmp_path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: x\nmode: dedloc\nmodel: {name: cnn1d}\ndataset: {source: builtin:mnist1d}\n"
        "stop: {target_accuracy: 0.9}\ndedloc: {target_batch_size: 64}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "job", "submit", str(bad), "--server", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "needs stop.max_steps" in result.stderr


def test_a_claim_is_bounded_by_the_fastest_rate_shown_and_one_batch() -> None:
    elapsed = {"a": 1.0, "new": 1.0}
    assert dedloc.claim_bounds({}, elapsed, 1000, 10) == {"a": 1010, "new": 1010}
    assert dedloc.claim_bounds({"a": 100.0}, elapsed, 1000, 10) == {"a": 410, "new": 410}
    assert dedloc.claim_bounds({"a": 1000.0}, elapsed, 1000, 10) == {"a": 1010, "new": 1010}
    # A peer that contributed little (the others filled the batches) may still fill one alone.
    assert dedloc.claim_bounds({"slow": 10.0, "b": 1000.0}, {"slow": 0.1}, 1000, 10) == {"slow": 410}
    claims = {"a": 10**9, "b": 410, "c": -3, "d": 5}
    assert dedloc.bounded_claims(claims, {"a": 410, "b": 410, "c": 410}) == {"a": 0, "b": 410, "c": 0, "d": 0}
    assert dedloc.measured_rate(300, 2.0) == 150.0


def test_matchmaking_waits_on_the_awaited_peers_and_on_the_others_only_while_the_batch_is_short() -> None:
    assert not dedloc.matchmaking_over(["a", "b", "n"], {"a": 900}, {"a", "b"}, 1000)
    assert dedloc.matchmaking_over(["a", "b", "n"], {"a": 500, "b": 500}, {"a", "b"}, 1000)
    assert not dedloc.matchmaking_over(["a", "b", "n"], {"a": 500, "b": 500}, {"a", "b", "n"}, 1000)
    assert not dedloc.matchmaking_over(["a", "b", "n"], {"a": 400, "b": 400}, {"a", "b"}, 1000)
    assert dedloc.matchmaking_over(["a", "n"], {"a": 400, "n": 300}, {"a"}, 1000)
    assert dedloc.choose_members({"a": 500, "b": 500, "n": 300}) == ["a", "b", "n"]
