"""Where a merge's time goes: when each of its stages ended, from the upload's body in hand at the
scheduler to W_s written in Redis.

A result's `Stamps` start at the scheduler (`received`), ride with its merge task to the parameter
server, and are kept in the job's merge log (crowdtrain.core.keys.merge_log) with the merge. The
stages, in order, each stamped when it ends:

    received   the upload's body in hand at the scheduler (where a merge's latency starts)
    checked    its values checked and its W_c digest taken (the body is written to storage meanwhile)
    stored     its bytes in storage
    recorded   the upload committed in the ledger
    queued     its merge task about to be sent (the stamps ride in it: the send counts in `started`)
    started    a parameter server took it up (its task, or the pass that took it from the job's queue)
    found      its ledger record read (with its job's queue, and W_s in Redis checked)
    read       its bytes read, Δ and ||Δ|| formed
    judged     replays, replicas' vote and the job's merge terms settled
    applied    W_s and the rule's state changed in memory
    merged     W_s written: the MULTI/EXEC that holds it committed

A result merged by a pass that another task started has no scheduler stages past `received` (its own
task, when it runs, finds it merged). Stamps are wall-clock seconds: the scheduler's and the parameter
server's clocks are one machine's in a trial and NTP-close in a deployment; `spans` says how long
each stage took after the one before it that was stamped.
"""

import time
from typing import Final

STAGES: Final = (
    "received",
    "checked",
    "stored",
    "recorded",
    "queued",
    "started",
    "found",
    "read",
    "judged",
    "applied",
    "merged",
)

Stamps = dict[str, float]  # stage -> when it ended (seconds since the epoch)


def received(at: float | None = None) -> Stamps:
    """A result's first stamps: its body in hand at `at` (default: now)."""
    return {"received": time.time() if at is None else at}


def stamp(stamps: Stamps | None, stage: str, at: float | None = None) -> None:
    """Note that `stage` ended at `at` (default: now); nothing when the result is not timed (`stamps` None)."""
    if stage not in STAGES:
        raise ValueError(f"unknown merge stage {stage!r}; the stages are {', '.join(STAGES)}")
    if stamps is not None:
        stamps[stage] = time.time() if at is None else at


def spans(stamps: Stamps) -> dict[str, float]:
    """Seconds each stamped stage took after the stamped stage before it, in STAGES' order; the first
    stamped stage has none. A clock step between two stamps shows as a negative span, kept as it is."""
    present = [s for s in STAGES if s in stamps]
    return {later: stamps[later] - stamps[earlier] for earlier, later in zip(present, present[1:], strict=False)}


def of_task(argument: "Stamps | float | None") -> Stamps | None:
    """The stamps a merge task was given: a task queued by an older scheduler carries only the time
    its body was in hand (a number), or nothing; malformed stamps are dropped (they only time)."""
    if argument is None:
        return None
    if isinstance(argument, int | float) and not isinstance(argument, bool):
        return received(float(argument))
    if isinstance(argument, dict):
        return {
            k: float(v)
            for k, v in argument.items()
            if k in STAGES and isinstance(v, int | float) and not isinstance(v, bool)
        }
    return None
