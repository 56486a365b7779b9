"""A merge's stamps: the spans between the stages stamped, in order; what a merge task may carry."""

import pytest

from crowdtrain.core import merge_stages


def test_spans_run_from_each_stamped_stage_to_the_next_in_stage_order() -> None:
    stamps = {"merged": 10.0, "received": 1.0, "checked": 1.5, "read": 4.0}

    assert merge_stages.spans(stamps) == {"checked": 0.5, "read": 2.5, "merged": 6.0}
    assert list(merge_stages.spans(stamps)) == ["checked", "read", "merged"], "in the stages' order, not the dict's"
    assert merge_stages.spans({"received": 1.0}) == {}


def test_a_stamp_names_a_known_stage_and_an_untimed_result_takes_none() -> None:
    stamps = merge_stages.received(5.0)
    merge_stages.stamp(stamps, "checked", 6.0)
    merge_stages.stamp(None, "checked")  # not timed: nothing to note, no error

    assert stamps == {"received": 5.0, "checked": 6.0}
    with pytest.raises(ValueError, match="unknown merge stage 'chekced'"):
        merge_stages.stamp(stamps, "chekced")


def test_a_task_s_stamps_may_be_a_number_from_an_older_scheduler_and_junk_is_dropped() -> None:
    assert merge_stages.of_task(12.5) == {"received": 12.5}
    assert merge_stages.of_task(None) is None
    assert merge_stages.of_task({"received": 1, "queued": 2.5, "bogus": 3.0, "read": "soon", "stored": True}) == {
        "received": 1.0,
        "queued": 2.5,
    }
    assert merge_stages.of_task("yesterday") is None
