"""What trainers report of their calls to a mixture's experts, and what the operator sees of them: each
report credits the experts' hosts for the rows answered and charges them for the answers refused or
blamed (crowdtrain.server.ledger.reputation), and `mixture_experts` lists each expert's lease,
checkpoint and counts. The leases themselves are crowdtrain.server.ledger.experts'."""

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.credit import flops_credit
from crowdtrain.core.experts import ExpertLayout, answer_flops
from crowdtrain.core.refusals import NotFound
from crowdtrain.server.ledger import reputation
from crowdtrain.server.ledger.experts import free_hosts_experts, locked_mixture
from crowdtrain.server.ledger.models import Expert, Host, Mixture


@dataclass(frozen=True)
class CallCounts:
    """A trainer's report of its calls to one expert at one host (crowdtrain.core.schemas_experts.ExpertCalls)."""

    uid: str
    url: str
    answered: int
    rows: int
    failed: int
    late: int
    refused: int
    compared: int = 0
    disagreed: int = 0


def record_calls(
    db: sessionmaker[Session],
    reporter_id: int,
    mixture_id: int,
    counts: list[CallCounts],
    seconds: float,
    now: datetime,
    quarantine_after: int | None,
) -> tuple[int, int]:
    """Count a trainer's report of its calls over the last `seconds`: each entry about a replica's current
    host (by its URL), and not the reporter's own, adds to the replica's counts; its host is credited
    for the rows answered (crowdtrain.core.credit) and charged for the answers refused, which quarantine
    it at `quarantine_after` refusals in a row, and a quarantined host's experts are freed at once.
    (counted, ignored). One transaction; the mixture is locked before the hosts, in id order.

    Replicas' answers compared (the layout's `compare_every`): the trainer blames each disagreement on
    the one of its two hosts whose answers agreed less often over everything it compared
    (crowdtrain.client.experts.mixture.ExpertClient), so `disagreed` is charged like refused answers.

    A report is taken on the trainer's word (it is a registered host): it cannot credit the reporter,
    but a lying trainer could charge a host it names."""
    with db.begin() as s:
        mixture = locked_mixture(s, mixture_id)
        layout = ExpertLayout.model_validate(mixture.layout)
        experts = {
            (e.uid, e.url): e
            for e in s.scalars(
                select(Expert).where(
                    Expert.mixture_id == mixture_id,
                    Expert.uid.in_({c.uid for c in counts}),
                    Expert.host_id.is_not(None),
                    Expert.host_id != reporter_id,
                )
            )
        }
        mine = [(c, experts[(c.uid, c.url)]) for c in counts if (c.uid, c.url) in experts]
        hosts = {
            h.id: h
            for h in s.scalars(
                select(Host).where(Host.id.in_({e.host_id for _, e in mine})).order_by(Host.id).with_for_update()
            )
        }
        for c, expert in mine:
            expert.calls_answered += c.answered
            expert.calls_failed += c.failed
            expert.calls_late += c.late
            expert.calls_refused += c.refused
            expert.rows_answered += c.rows
            expert.calls_compared += c.compared
            expert.calls_disagreed += c.disagreed
            start = now - timedelta(seconds=seconds)
            expert.reported_from = start if expert.reported_from is None else min(expert.reported_from, start)
            expert.reported_to = now
            host = hosts[expert.host_id]  # type: ignore[index]
            host.credit += flops_credit(answer_flops(layout, c.rows))
            if c.refused:
                message = f"expert {c.uid}: {c.refused} answers refused by a trainer (NaN, wrong shapes or size)"
                reputation.count_refused_answers(host, c.refused, message, quarantine_after)
            elif c.disagreed:
                message = f"expert {c.uid}: {c.disagreed} answers disagreed with another replica's (blamed)"
                reputation.count_refused_answers(host, c.disagreed, message, quarantine_after)
            elif c.answered:
                host.consecutive_refused = 0
        for host in hosts.values():
            if host.quarantined_until is not None and host.quarantined_until > now:
                free_hosts_experts(s, mixture, host.id)
        return len(mine), len(counts) - len(mine)


@dataclass(frozen=True)
class ExpertRow:
    uid: str
    replica: int
    host_id: int | None
    url: str | None
    lease_expires_at: datetime | None
    leases: int
    checkpoint_step: int
    checkpoint_at: datetime | None
    answered: int
    failed: int
    late: int
    refused: int
    compared: int
    disagreed: int
    reported_seconds: float  # the span of the trainers' reports that gave those counts; 0 before any


def mixture_experts(db: sessionmaker[Session], mixture_id: int) -> tuple[Mixture, list[ExpertRow]]:
    """The mixture and each of its experts' lease and checkpoint, for the operator."""
    with db.begin() as s:
        mixture = s.get(Mixture, mixture_id)
        if mixture is None:
            raise NotFound(f"mixture {mixture_id} does not exist")
        rows = s.scalars(
            select(Expert).where(Expert.mixture_id == mixture_id).order_by(Expert.uid, Expert.replica)
        ).all()
        s.expunge(mixture)
        return mixture, [
            ExpertRow(
                e.uid,
                e.replica,
                e.host_id,
                e.url,
                e.lease_expires_at,
                e.leases,
                e.checkpoint_step,
                e.checkpoint_at,
                e.calls_answered,
                e.calls_failed,
                e.calls_late,
                e.calls_refused,
                e.calls_compared,
                e.calls_disagreed,
                0.0
                if e.reported_from is None or e.reported_to is None
                else (e.reported_to - e.reported_from).total_seconds(),
            )
            for e in rows
        ]
