"""Alembic revisions, applied in order by `crowdtrain migrate`."""
