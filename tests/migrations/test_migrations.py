"""The Alembic migrations create exactly the schema the models describe, on SQLite and PostgreSQL."""

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect, text

from crowdtrain.migrations import alembic_config, upgrade
from crowdtrain.server.ledger.models import Base


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
def test_upgrade_head_matches_the_models(database_url: str) -> None:
    upgrade(database_url)
    command.check(alembic_config(database_url))  # raises if models and migrations drift apart
    from crowdtrain.server.ledger.db import normalize_url

    tables = set(inspect(create_engine(normalize_url(database_url))).get_table_names())
    assert set(Base.metadata.tables) <= tables


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_upgrade_is_idempotent_and_reversible(database_url: str) -> None:
    upgrade(database_url)
    upgrade(database_url)
    command.downgrade(alembic_config(database_url), "base")
    assert set(inspect(create_engine(database_url)).get_table_names()) <= {"alembic_version"}


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
def test_0005_downgrade_moves_re_dealt_epochs_onto_the_submission_shards(database_url: str) -> None:
    """Shards gained an epoch in 0005; going back, workunits on an epoch's own shards keep their
    history on the submission's shard of the same index."""
    from sqlalchemy import text

    from crowdtrain.server.ledger.db import session_factory
    from crowdtrain.server.ledger.models import Job, Shard, Workunit

    upgrade(database_url)
    db = session_factory(database_url)
    with db.begin() as s:
        job = Job(name="j", mode="vc-asgd", status="running", spec={}, model_config_={}, param_manifest={})
        s.add(job)
        s.flush()
        shards = {
            (e, i): Shard(
                job_id=job.id, epoch=e, index=i, key=f"k{e}{i}", sha256=None if e else "0" * 64, size=0, examples=0
            )
            for e in (0, 2)
            for i in range(2)
        }
        s.add_all(shards.values())
        s.flush()
        s.add_all(Workunit(job_id=job.id, epoch=e or 1, shard_id=sh.id, status="done") for (e, i), sh in shards.items())
        submitted = {i: shards[0, i].id for i in range(2)}
    db.kw["bind"].dispose()
    command.downgrade(alembic_config(database_url), "0004")
    from crowdtrain.server.ledger.db import normalize_url

    engine = create_engine(normalize_url(database_url))
    with engine.begin() as conn:
        assert conn.execute(text('SELECT id, "index" FROM shards ORDER BY "index"')).all() == [
            (submitted[0], 0),
            (submitted[1], 1),
        ]
        moved = conn.execute(text("SELECT epoch, shard_id FROM workunits ORDER BY epoch, shard_id")).all()
    engine.dispose()
    assert moved == [(1, submitted[0]), (1, submitted[1]), (2, submitted[0]), (2, submitted[1])]
    upgrade(database_url)


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_the_claim_tables_are_vacuumed_after_a_hundredth_of_their_rows_change(database_url: str) -> None:
    """Claims leave a dead row version each; PostgreSQL's default waits for a fifth of the table."""
    from crowdtrain.server.ledger.db import normalize_url

    upgrade(database_url)
    engine = create_engine(normalize_url(database_url))

    def options() -> dict[str, set[str]]:
        with engine.connect() as c:
            rows = c.execute(
                text("SELECT relname, reloptions FROM pg_class WHERE relname IN ('workunits', 'assignments')")
            ).all()
        return {name: set(opts or []) for name, opts in rows}

    for table, opts in options().items():
        assert {"autovacuum_vacuum_scale_factor=0.01", "autovacuum_vacuum_threshold=1000"} <= opts, table
    command.downgrade(alembic_config(database_url), "0008")
    assert options() == {"workunits": set(), "assignments": set()}
    engine.dispose()


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
def test_0015_keeps_each_stored_jobs_own_rule_options_and_the_spec_reads_as_it_did(database_url: str) -> None:
    """Jobs stored before 0015 hold every rule's options side by side (the flat section dumped them all):
    after it, each job's section holds its own rule's options, with their values, and validates."""
    from crowdtrain.core.assimilationspec import RULE_SPECS, assimilation_of
    from crowdtrain.core.jobspec import JobSpec, load_job_spec
    from crowdtrain.server.ledger.db import session_factory
    from crowdtrain.server.ledger.models import Job
    from tests.conftest import EXAMPLE_SPEC

    # The old section: every rule's fields with their defaults, as the flat model dumped them.
    flat: dict = {}
    for rule, model in RULE_SPECS.items():
        flat |= model.model_validate({"rule": rule}).model_dump(mode="json")
    set_by_operator = {"vc-asgd": {"alpha": 0.7}, "delta": {"server_lr": 0.3}, "fedbuff": {"buffer_size": 8}}
    example = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    upgrade(database_url)
    command.downgrade(alembic_config(database_url), "0014")
    db = session_factory(database_url)
    with db.begin() as s:
        jobs = {
            rule: Job(
                name=rule,
                mode="vc-asgd",
                status="running",
                spec=example | {"assimilation": flat | {"rule": rule} | own},
                model_config_={},
                param_manifest={},
            )
            for rule, own in set_by_operator.items()
        }
        s.add_all(jobs.values())
        s.flush()
        ids = {rule: job.id for rule, job in jobs.items()}
    with pytest.raises(ValueError, match="is an option of rule"):
        assimilation_of(flat | {"rule": "delta"})  # what 0015 is for
    db.kw["bind"].dispose()
    upgrade(database_url)
    db = session_factory(database_url)
    with db.begin() as s:
        for rule, own in set_by_operator.items():
            spec = s.get_one(Job, ids[rule]).spec
            section = assimilation_of(spec["assimilation"])
            assert section.rule == rule and section.model_dump(include=set(own)) == own
            assert set(spec["assimilation"]) == set(RULE_SPECS[rule].model_fields)
            JobSpec.model_validate(spec)
    db.kw["bind"].dispose()
