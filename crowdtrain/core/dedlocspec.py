"""The dedloc section of a job spec (mode dedloc): how peers accumulate toward a global batch and
average it (crowdtrain.server.services.dedloc)."""

from typing import Literal

from pydantic import Field, model_validator

from crowdtrain.core.specfile import SpecSection


class DedlocSpec(SpecSection):
    """Synchronous DeDLOC training: peers accumulate gradients until the collaboration has
    `target_batch_size` examples, then all-reduce them and take one optimizer step together."""

    target_batch_size: int = Field(..., ge=1, le=10_000_000, description="Examples per global step")
    micro_batch_size: int = Field(32, ge=1, le=65536, description="Examples per local forward/backward")
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.1, gt=0, le=10, description="Peak learning rate")
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="Keyed to the global step; cosine decays to 0 at stop.max_steps"
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up from 0 over this many global steps")
    matchmaking_timeout: float = Field(5.0, gt=0, le=600, description="Seconds to wait for a round's members")
    averaging_timeout: float = Field(30.0, gt=0, le=3600, description="Seconds one all-reduce may take")
    max_group_size: int = Field(
        16,
        ge=1,
        le=1024,
        description="Peers per all-reduce group; more peers form several groups whose sums are combined exactly",
    )
    report_interval: float = Field(1.0, gt=0, le=60, description="Seconds between a peer's progress reports")
    compression: Literal["none", "float16", "bfloat16"] = Field(
        "none",
        description="The number format of gradients on the wire of a group's all-reduce: 'none' sends float32 "
        "(every step exactly large-batch SGD); 'float16' or 'bfloat16' send half the bytes, and the group sums "
        "in that format (float16: relative error about 2^-11 per addition, each member's values clamped to "
        "+-65504 over the group's size; bfloat16: about 2^-8, float32's range). Sums combined through the "
        "scheduler stay float32",
    )
    exclude_after: int | None = Field(
        3,
        ge=1,
        le=1000,
        description="A peer blamed for this many aborted attempts in a row (it timed out, failed, or reported a "
        "result the other members did not) takes no part in matchmaking for the rest of the job; null: never",
    )

    @model_validator(mode="after")
    def _micro_fits(self) -> "DedlocSpec":
        if self.micro_batch_size > self.target_batch_size:
            raise ValueError(
                f"dedloc.micro_batch_size ({self.micro_batch_size}) exceeds dedloc.target_batch_size "
                f"({self.target_batch_size})"
            )
        return self
