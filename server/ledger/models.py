"""SQLAlchemy models shared by the scheduler, the transitioner and the parameter servers."""

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    """Naive UTC: stored identically by SQLite and PostgreSQL."""
    return datetime.now(UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime()}


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    mode: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), index=True)
    status_message: Mapped[str] = mapped_column(String(1000), default="")
    spec: Mapped[dict[str, Any]]
    model_config_: Mapped[dict[str, Any]] = mapped_column("model_config")
    param_manifest: Mapped[dict[str, Any]]
    param_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # FLOPs to train the model on one example: a result's credit is its examples times this.
    training_flops: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    validation_key: Mapped[str] = mapped_column(String(500), default="")
    current_epoch: Mapped[int] = mapped_column(Integer, default=0)
    param_version: Mapped[int] = mapped_column(Integer, default=0)
    snapshot_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    snapshot_key: Mapped[str | None] = mapped_column(String(500), nullable=True)
    snapshot_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    snapshot_at: Mapped[datetime | None] = mapped_column(nullable=True)
    final_key: Mapped[str | None] = mapped_column(String(500), nullable=True)
    final_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The pace of the job's latest merges, measured when each is recorded (crowdtrain.server.ledger.pace):
    # merges per second, and the median seconds from an assignment's dispatch to its upload. None until
    # two merges are recorded. Dispatch derives the job's in-flight budget from them.
    merge_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    turnaround_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The recipe the operator signs (crowdtrain.core.signing.recipe_document, canonical JSON), and the
    # signature with the public key that made it; None for jobs from before signing, or not signed.
    recipe: Mapped[str | None] = mapped_column(Text, nullable=True)
    recipe_public_key: Mapped[str | None] = mapped_column(String(44), nullable=True)
    recipe_signature: Mapped[str | None] = mapped_column(String(88), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)


class ProjectKey(Base):
    """A public key of the operator's project key, in the order they were used: the newest signs the
    project's work now. Each after the first carries the previous key's signature of the rotation
    statement that hands trust to it (crowdtrain.core.signing.sign_rotation). The private keys are
    never here."""

    __tablename__ = "project_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    public_key: Mapped[str] = mapped_column(String(44), unique=True)
    rotation_signature: Mapped[str | None] = mapped_column(String(88), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Shard(Base):
    """One shard of a job's training data.

    Epoch 0 holds the deal made at submission, which every epoch uses unless the job re-deals its
    examples each epoch (`dataset.reshuffle_each_epoch`): then epochs from 2 on have shards of their
    own, created with the epoch and written to storage when first dispatched; until then `sha256`
    is None and `size` and `examples` are 0 (see crowdtrain.workgen.generator.write_epoch_shards).
    """

    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("job_id", "epoch", "index", name="uq_shards_job_epoch_index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    index: Mapped[int] = mapped_column(Integer)
    key: Mapped[str] = mapped_column(String(500))
    sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    size: Mapped[int] = mapped_column(BigInteger)
    examples: Mapped[int] = mapped_column(Integer)


class Workunit(Base):
    __tablename__ = "workunits"
    __table_args__ = (
        UniqueConstraint("job_id", "epoch", "shard_id"),
        Index("ix_workunits_claim", "job_id", "status", "epoch", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"))
    epoch: Mapped[int] = mapped_column(Integer)
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id"))
    status: Mapped[str] = mapped_column(String(20))
    error_count: Mapped[int] = mapped_column(Integer, default=0)
    # Results compared before one is merged (validation.replicate_untrusted / replication): 1 = not replicated.
    quorum: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # The replica the validator chose to merge, once it has judged them.
    canonical_assignment_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)


class Host(Base):
    __tablename__ = "hosts"
    __table_args__ = (Index("ix_hosts_network_created_at", "network", "created_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    cpus: Mapped[int] = mapped_column(Integer, default=0)
    ram_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    gpu: Mapped[str] = mapped_column(String(200), default="")
    device: Mapped[str] = mapped_column(String(50), default="cpu")
    # Comma-separated frameworks the client trains with; dispatch gives it only jobs one of them runs.
    frameworks: Mapped[str] = mapped_column(String(100), default="pytorch", server_default="pytorch")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)
    revoked: Mapped[bool] = mapped_column(default=False)
    join_token_id: Mapped[int | None] = mapped_column(
        ForeignKey("join_tokens.id", name="fk_hosts_join_token_id"), nullable=True
    )
    results_valid: Mapped[int] = mapped_column(Integer, default=0)
    results_failed: Mapped[int] = mapped_column(Integer, default=0)
    consecutive_valid: Mapped[int] = mapped_column(Integer, default=0)
    mean_turnaround: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Results refused in a row (reset by a valid one): at Settings.quarantine_after_refusals the host is
    # quarantined, given no work until `quarantined_until`, with the reason for the operator.
    consecutive_refused: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    quarantined_until: Mapped[datetime | None] = mapped_column(nullable=True)
    quarantine_reason: Mapped[str] = mapped_column(String(500), default="", server_default="")
    # The volunteer account the host's credit adds up under (named by the client; "" for none).
    account: Mapped[str] = mapped_column(String(64), default="", server_default="")
    credit: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")  # cobblestones (core.credit)
    # The address the host registered from, and its network prefix (core.addresses): registration limits and
    # replica spread count networks, not the names hosts give themselves.
    address: Mapped[str] = mapped_column(String(45), default="", server_default="")
    network: Mapped[str] = mapped_column(String(50), default="", server_default="")


class JoinToken(Base):
    """An operator-issued token that lets a client register; only its sha256 is stored."""

    __tablename__ = "join_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(String(200))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked: Mapped[bool] = mapped_column(default=False)
    hosts_registered: Mapped[int] = mapped_column(Integer, default=0)
    # A token issued to one volunteer account: hosts registered with it are under that account, whatever they
    # name ("" for a project-wide token, whose hosts name their own account). None: the default limit.
    account: Mapped[str] = mapped_column(String(64), default="", server_default="")
    registrations_per_hour: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Assignment(Base):
    """One workunit sent to one host (BOINC's 'result')."""

    __tablename__ = "assignments"
    __table_args__ = (
        Index("ix_assignments_status_deadline", "status", "deadline"),
        # A job's unmerged assignments (counted in every work request) and its latest merges.
        Index("ix_assignments_job_status_finished", "job_id", "status", "finished_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    workunit_id: Mapped[int] = mapped_column(ForeignKey("workunits.id"), index=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id"), index=True)
    base_version: Mapped[int] = mapped_column(Integer)
    # The share of the recipe's local epochs this host trains (training.dynamic_local_work); 1 = all.
    local_fraction: Mapped[float] = mapped_column(Float, default=1.0, server_default="1.0")
    status: Mapped[str] = mapped_column(String(20))
    sent_at: Mapped[datetime] = mapped_column(default=utcnow)
    deadline: Mapped[datetime]
    last_heartbeat: Mapped[datetime | None] = mapped_column(nullable=True)
    uploaded_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)
    upload_key: Mapped[str | None] = mapped_column(String(500), nullable=True)
    merged_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    examples: Mapped[int | None] = mapped_column(Integer, nullable=True)
    train_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    credit: Mapped[float | None] = mapped_column(Float, nullable=True)  # granted when merged; refused results: none
    message: Mapped[str] = mapped_column(String(1000), default="")


class Metric(Base):
    """Validation of W_s after one merge."""

    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    epoch: Mapped[int] = mapped_column(Integer)
    assignment_id: Mapped[int | None] = mapped_column(ForeignKey("assignments.id"), unique=True, nullable=True)
    param_version: Mapped[int] = mapped_column(Integer)
    val_loss: Mapped[float] = mapped_column(Float)
    val_accuracy: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Mixture(Base):
    """The mixture-of-experts layers of a model trained expert-parallel: their layout
    (crowdtrain.core.experts.ExpertLayout) and its experts, leased to expert hosts."""

    __tablename__ = "mixtures"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    layout: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(20), default="open")  # open: its experts are leased; closed
    # Bumped at each change of an expert's host: the routing table's version (crowdtrain.server.ledger.experts).
    route_version: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Expert(Base):
    """One replica of an expert of a mixture (replica 0 when the layout has one): the host that serves
    it under a lease, and its last checkpoint."""

    __tablename__ = "experts"
    __table_args__ = (
        UniqueConstraint("mixture_id", "uid", "replica", name="uq_experts_mixture_uid_replica"),
        Index("ix_experts_mixture_route_version", "mixture_id", "route_version"),
        Index("ix_experts_lease_expires_at", "lease_expires_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    mixture_id: Mapped[int] = mapped_column(ForeignKey("mixtures.id"))
    uid: Mapped[str] = mapped_column(String(40))
    replica: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    host_id: Mapped[int | None] = mapped_column(ForeignKey("hosts.id"), nullable=True, index=True)
    url: Mapped[str | None] = mapped_column(String(300), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(nullable=True)
    route_version: Mapped[int] = mapped_column(Integer, default=0)
    leases: Mapped[int] = mapped_column(Integer, default=0)  # leases granted so far: 1 + the times it moved
    checkpoint_key: Mapped[str | None] = mapped_column(String(500), nullable=True)
    checkpoint_step: Mapped[int] = mapped_column(Integer, default=0)
    checkpoint_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # What trainers reported of their calls to it (crowdtrain.server.ledger.expert_calls.record_calls), and
    # the span of those reports: the operator's request rate and failure rates.
    calls_answered: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    calls_failed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    calls_late: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    calls_refused: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    rows_answered: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # Calls a trainer also sent to another replica, and those whose two answers disagreed.
    calls_compared: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    calls_disagreed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    reported_from: Mapped[datetime | None] = mapped_column(nullable=True)
    reported_to: Mapped[datetime | None] = mapped_column(nullable=True)
