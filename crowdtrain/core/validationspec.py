"""A job spec's validation section: replication of results and the checks that decide which replicas
are valid (crowdtrain.assimilator.validator)."""

from typing import Any

from pydantic import Field

from crowdtrain.core.specfile import SpecSection


class ValidationSpec(SpecSection):
    """Replication and validation of results (BOINC's adaptive replication, for updates that are never
    bit-identical): a replicated workunit is trained by `quorum` hosts, and their results are compared
    by crowdtrain.assimilator.validator before one of them is merged."""

    replicate_untrusted: bool = Field(
        False,
        description="Replicate every workunit given to a host with fewer than trusted_after consecutive valid "
        "results (new, or refused lately)",
    )
    replication: float = Field(
        0.0, ge=0, le=1, description="The fraction of trusted hosts' workunits replicated too (spot checks)"
    )
    trusted_after: int = Field(10, ge=0, le=100_000, description="Consecutive valid results that make a host trusted")
    max_replicas: int = Field(
        3, ge=2, le=5, description="Replicas at most: two that disagree get a third to settle the vote"
    )
    min_cosine: float = Field(
        0.1,
        ge=-1,
        le=1,
        description="Two replicas agree only if the cosine of their updates is at least this (honest replicas of "
        "one workunit measured 0.3 from scratch on builtin:mnist1d; random noise 0.0, sign-flipped -1)",
    )
    max_norm_ratio: float = Field(
        3.0, gt=1, le=1000, description="... and the larger update's norm is at most this times the smaller's"
    )
    loss_tolerance: float = Field(
        0.25,
        gt=0,
        le=100,
        description="... and their held-out losses differ by at most this fraction of the smaller; a result "
        "whose held-out loss exceeds W_s's by more than this fraction cannot be valid",
    )
    holdout_examples: int = Field(
        512, ge=16, le=100_000, description="Validation examples each replica's held-out loss is measured on"
    )
    min_training_z: float | None = Field(
        4.0,
        ge=-1000,
        le=1000,
        description="A replica is valid only if it shows training on its workunit's shard: W_c lowers the shard's "
        "per-example loss below W_base's with a z (mean improvement over its standard error) of at least this. "
        "Over 8 whole runs each of builtin:mnist1d and a tabular task, honest results measured 4.5 and more "
        "(median 20-30), random directions of an honest update's norm 4.4 at most, and 92-99% of those of a tenth "
        "of it stayed under 4 (benchmarks/replica_improvement.py); null: no such check",
    )
    min_descent_z: float | None = Field(
        3.0,
        ge=-1000,
        le=1000,
        description="... and, unless its training z is `training_z_alone` or more, only if its update descends the "
        "shard's loss at W_base at least this many times further than random directions do (the slope along Δ "
        "over the spread of the slopes along `descent_directions` random directions: a direction the host did "
        "not fit scores like Student's t). Over 3 whole runs each of builtin:mnist1d and a tabular task, honest "
        "results scored 3.2 and more, random directions 2.6 at most, and none passed both checks "
        "(benchmarks/replica_improvement.py); null: no such check",
    )
    training_z_alone: float = Field(
        8.0,
        ge=-1000,
        le=1000,
        description="A training z this high needs no descent evidence: a random direction's training z spreads "
        "about 2.5 wide, and 40 of them at each of four models of the example job reached 6.6 at most",
    )
    descent_directions: int = Field(
        32, ge=4, le=256, description="Random directions the descent evidence compares a replica's update with"
    )
    training_examples: int = Field(
        512, ge=16, le=100_000, description="Examples of the workunit's shard the training evidence is measured on"
    )
    replica_wait_seconds: float | None = Field(
        None,
        gt=0,
        le=7 * 86_400,
        description="A vote whose results wait this long for another replica, none being sent, closes "
        "inconclusive: its results are refused uncharged and the workunit counts an error (max_errors fails "
        "it); null: the job's scheduling.deadline_seconds",
    )
    quarantine_after: int | None = Field(
        5,
        ge=1,
        le=1000,
        description="A host whose results this job refuses this many times in a row (counting refusals in any "
        "job) is quarantined: no work for 24 h, with the reason shown to the operator; null: never",
    )

    @property
    def enabled(self) -> bool:
        return self.replicate_untrusted or self.replication > 0


def validation_of(spec: dict[str, Any]) -> ValidationSpec:
    """The validation section of a stored job spec (jobs stored before it existed replicate nothing)."""
    return ValidationSpec.model_validate(spec.get("validation", {}))
