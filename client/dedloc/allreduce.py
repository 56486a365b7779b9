"""One round's reduction as a member performs it: weight, all-reduce within the group over
torch.distributed (Gloo), and combine with the other parts through the scheduler when needed."""

import hashlib
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from crowdtrain.client.dedloc.api import PeerAPI
from crowdtrain.client.dedloc.store import RoundStore
from crowdtrain.core.schemas_dedloc import RoundPlanOut
from crowdtrain.core.tensors import decode, encode


def result_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()


def group_process_group(api: PeerAPI, plan: RoundPlanOut) -> dist.ProcessGroupGloo:
    """This peer's member of its group's process group for this round only; joining it connects to the others."""
    if plan.rank is None:  # the scheduler gives a rank to every member of a group, and none to a relayed peer
        raise ValueError(f"step {plan.step} attempt {plan.attempt}: this peer has no rank in a group to reduce with")
    store = RoundStore(api, plan.step, plan.attempt, plan.averaging_timeout)
    return dist.ProcessGroupGloo(store, plan.rank, len(plan.group_members), timedelta(seconds=plan.averaging_timeout))


def group_allreduce(api: PeerAPI, plan: RoundPlanOut, flat: torch.Tensor) -> None:
    """Sum `flat` in place over the group's members with a process group made for this round only."""
    pg = group_process_group(api, plan)
    try:
        # torch's stubs leave out Backend.allreduce, which ProcessGroupGloo has at run time.
        pg.allreduce([flat]).wait()  # type: ignore[attr-defined]
    finally:
        del pg


def reduce_round(api: PeerAPI, plan: RoundPlanOut, summed_grads: torch.Tensor) -> torch.Tensor:
    """The round's average gradient Σ_i g_i / N, identical on every member.

    `summed_grads` (the gradient of this peer's summed loss) is never modified: the reduction works
    on a copy, so a failed round leaves the peer's accumulated gradients intact.
    """
    contribution = summed_grads.detach().clone()
    contribution.mul_(1.0 / plan.total)
    deadline = time.monotonic() + plan.averaging_timeout
    if not plan.relayed and len(plan.group_members) > 1:
        group_allreduce(api, plan, contribution)
    if not plan.needs_combining:
        return contribution
    part = f"relay-{api.peer_id}" if plan.relayed else f"group-{plan.group}"
    if plan.relayed or plan.rank == 0:
        api.put_part(plan.step, plan.attempt, part, encode({"g": contribution.numpy()}))
    total = decode(api.total(plan.step, plan.attempt, deadline))["g"]
    return torch.from_numpy(np.array(total, dtype=np.float32, copy=True))
