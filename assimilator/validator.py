"""Validation of a replicated workunit's results by quorum: which replicas are valid, which one is merged.

Training results are never bit-identical across hosts (other seeds, other hardware), so replicas are
compared by what can be compared: their updates' directions (cosine) and norms, and the loss, on a
held-out slice of the validation set, of W_s as the job's merge rule would leave it after merging
the replica alone (crowdtrain.assimilator.policy.merged_alone: α·W_s + (1 − α)·W_c for VC-ASGD).
Two replicas *agree* when all three are close (thresholds: crowdtrain.core.validationspec.ValidationSpec).
A replica is *implausible* on its own when its update is zero (a host that returns the base
unchanged) or not finite, when it shows no evidence of training (`training_z`: W_c must fit the
workunit's own shard better than W_base by more than per-example noise, and Δ must descend the
shard's loss at W_base further than random directions do, crowdtrain.assimilator.evidence; so that
hosts that agree on a direction they did not train, colluding, win no vote), or when its held-out loss exceeds W_s's by
more than the tolerance (a sign-flipped, scaled or poisoned update). A replica whose weights are
exactly those of an earlier result of the job (a replayed result) never reaches the validator: the
merge refuses it as malformed.

The verdict, as BOINC's validator gives it: the largest group of plausible replicas that all agree
pairwise, if it has at least two, is valid and the rest invalid (charged to their hosts); the
group's replica with the lowest held-out loss is the canonical one, merged into W_s. Without such a
group, another replica is asked for, up to `max_replicas`, while the plausible ones and those still
to come could make two; else (at the bound, or when implausible ones leave too few) the workunit is
inconclusive: every replica is refused uncharged (only the implausible ones are charged) and it is
trained again.

What it can catch: updates that disagree with an honest replica in direction or size (sign-flipped,
scaled, random noise, training on permuted labels, a replayed old result) and updates that make the
held-out loss worse, and replicas that agree on a direction they did not train (colluding hosts).
What it cannot: hostile hosts that are a majority of a workunit's replicas, agree with each other
and do train on the shard (colluders that add a shared direction to real training), and a subtle
poisoning that moves an update by less than the spread between honest replicas. Unreplicated
results are checked by the merge policy's bounds only.

No I/O: the merge (crowdtrain.assimilator.merge) measures the replicas and applies the verdict.
"""

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from crowdtrain.core.validationspec import ValidationSpec


@dataclass(frozen=True)
class Replica:
    """One uploaded result of the workunit, measured: ||Δ|| and the held-out loss of W_s merged with it."""

    assignment_id: int
    norm: float
    holdout_loss: float
    training_z: float = math.inf  # evidence of training on the workunit's shard (`training_z`); inf: not measured
    descent_z: float = math.inf  # Δ's descent on the shard against random directions (evidence.py); inf: not measured


@dataclass(frozen=True)
class Verdict:
    valid: tuple[int, ...] = ()  # assignment ids, the canonical one among them
    invalid: dict[int, str] = field(default_factory=dict)  # assignment id -> why
    canonical: int | None = None  # the one to merge
    more: bool = False  # no decision: ask for another replica
    charged: frozenset[int] = frozenset()  # the invalid ones that count against their hosts

    @property
    def decided(self) -> bool:
        return not self.more


def flat_update(delta: Mapping[str, np.ndarray]) -> np.ndarray:
    """Δ's floating-point tensors as one float64 vector, in name order (the same for every replica)."""
    parts = [np.asarray(delta[k], dtype=np.float64).ravel() for k in sorted(delta) if delta[k].dtype.kind == "f"]
    return np.concatenate(parts) if parts else np.zeros(0)


def cosines(updates: dict[int, np.ndarray]) -> dict[tuple[int, int], float]:
    """The cosine of every pair of flat updates, keyed (smaller id, larger id); 0 when one is zero."""
    out = {}
    for i, j in itertools.combinations(sorted(updates), 2):
        a, b = updates[i], updates[j]
        denominator = float(np.linalg.norm(a) * np.linalg.norm(b))
        out[(i, j)] = float(a @ b) / denominator if denominator > 0 else 0.0
    return out


def training_z(before: np.ndarray, after: np.ndarray) -> float:
    """The evidence that a result was trained on its shard, from the per-example losses of W_base
    (`before`) and W_c (`after`) on the shard's examples: z of the mean gain in each example's
    probability of its true label (e^−after − e^−before) over its standard error, a paired test
    against per-example noise. Probabilities, not losses: a gain lies in [−1, 1], while a loss gain is
    heavy-tailed (late in training a few examples' losses rising by 5-10 cancelled the fall of most
    others', z about 0 for results that fitted 75% of their shard better). Training raises the
    probabilities of the examples it fitted by far more than their noise; a direction not fitted to
    them (random) leaves z about 0 (benchmarks/replica_improvement.py)."""
    gain = np.exp(-np.asarray(after, dtype=np.float64)) - np.exp(-np.asarray(before, dtype=np.float64))
    if len(gain) < 2:
        return 0.0
    mean, sd = float(gain.mean()), float(gain.std(ddof=1))
    if sd == 0:
        return math.inf if mean > 0 else 0.0
    return mean / (sd / math.sqrt(len(gain)))


def implausible(replica: Replica, base_loss: float, spec: ValidationSpec) -> str | None:
    """Why a replica cannot be valid whatever the others say, or None."""
    if not math.isfinite(replica.norm) or not math.isfinite(replica.holdout_loss):
        return "its update or held-out loss is not finite"
    if replica.norm == 0:
        return "its update is zero: it returned the base model unchanged"
    if replica.holdout_loss > base_loss * (1 + spec.loss_tolerance):
        return (
            f"W_s merged with it has held-out loss {replica.holdout_loss:.4f}, more than "
            f"{spec.loss_tolerance:.0%} above W_s's {base_loss:.4f}"
        )
    return untrained(replica.training_z, replica.descent_z, spec)


def untrained(training_z: float, descent_z: float, spec: ValidationSpec) -> str | None:
    """Why a replica with these measures of training (crowdtrain.assimilator.evidence) shows none, or None."""
    if spec.min_training_z is not None and not training_z >= spec.min_training_z:
        return (
            f"it shows no training on the workunit's shard: W_c fits the shard's examples better than W_base "
            f"with z = {training_z:.1f} < {spec.min_training_z}"
        )
    if (
        spec.min_descent_z is not None
        and not descent_z >= spec.min_descent_z
        and not training_z >= spec.training_z_alone
    ):
        return (
            f"it shows no training on the workunit's shard: its training z {training_z:.1f} is under "
            f"{spec.training_z_alone} and its update descends the shard's loss no further than random directions "
            f"do (descent z {descent_z:.1f} < {spec.min_descent_z})"
        )
    return None


def disagreement(a: Replica, b: Replica, cosine: float, spec: ValidationSpec) -> str | None:
    """Why two replicas do not agree, or None when they do."""
    if cosine < spec.min_cosine:
        return f"update cosine {cosine:.2f} < {spec.min_cosine}"
    ratio = max(a.norm, b.norm) / min(a.norm, b.norm)
    if ratio > spec.max_norm_ratio:
        return f"update norm ratio {ratio:.2f} > {spec.max_norm_ratio}"
    gap = abs(a.holdout_loss - b.holdout_loss)
    if gap > spec.loss_tolerance * min(a.holdout_loss, b.holdout_loss):
        losses = f"{a.holdout_loss:.4f} and {b.holdout_loss:.4f}"
        return f"held-out losses {losses} differ by more than {spec.loss_tolerance:.0%}"
    return None


def judge(
    replicas: Sequence[Replica], pair_cosines: dict[tuple[int, int], float], base_loss: float, spec: ValidationSpec
) -> Verdict:
    """The verdict on a workunit's uploaded replicas (see the module docstring)."""
    by_id = {r.assignment_id: r for r in replicas}
    bad = {r.assignment_id: why for r in replicas if (why := implausible(r, base_loss, spec)) is not None}
    plausible = sorted(i for i in by_id if i not in bad)

    def why_not(i: int, j: int) -> str | None:
        key = (min(i, j), max(i, j))
        return disagreement(by_id[i], by_id[j], pair_cosines.get(key, 0.0), spec)

    group: tuple[int, ...] = ()
    for size in range(len(plausible), 1, -1):
        groups = [
            g
            for g in itertools.combinations(plausible, size)
            if all(why_not(i, j) is None for i, j in itertools.combinations(g, 2))
        ]
        if groups:
            group = min(groups, key=lambda g: (sum(by_id[i].holdout_loss for i in g), g))
            break
    if group:
        canonical = min(group, key=lambda i: (by_id[i].holdout_loss, i))
        invalid = dict(bad)
        for i in plausible:
            if i not in group:
                invalid[i] = (
                    f"disagrees with replica {canonical}: {why_not(i, canonical) or 'not in the agreeing group'}"
                )
        return Verdict(valid=group, invalid=invalid, canonical=canonical, charged=frozenset(invalid))
    to_come = spec.max_replicas - len(replicas)
    if to_come > 0 and len(plausible) + to_come >= 2:
        return Verdict(more=True)
    invalid = dict(bad)
    for i in plausible:
        invalid[i] = f"inconclusive: no two of {len(replicas)} replicas agree"
    return Verdict(invalid=invalid, charged=frozenset(bad))
