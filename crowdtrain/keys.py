"""Every Redis key and Celery queue name crowdtrain uses."""

PREFIX = "ct"
ASSIMILATE_QUEUE = "crowdtrain.assimilate"


def params(job_id: int) -> str:
    """safetensors bytes of the server model W_s."""
    return f"{PREFIX}:job:{job_id}:params"


def version(job_id: int) -> str:
    """Integer version of W_s: the number of merges applied."""
    return f"{PREFIX}:job:{job_id}:version"


def merged(job_id: int) -> str:
    """Set of assignment ids already merged into W_s (the exactly-once ledger)."""
    return f"{PREFIX}:job:{job_id}:merged"


def merge_log(job_id: int) -> str:
    """Hash assignment id -> JSON {version, merged_at, received_at}: when each merge landed."""
    return f"{PREFIX}:job:{job_id}:merge-log"
