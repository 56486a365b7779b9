"""Every Redis key and Celery queue name crowdtrain uses."""

PREFIX = "ct"
ASSIMILATE_QUEUE = "crowdtrain.assimilate"


def params_chunk(job_id: int, index: int) -> str:
    """One fixed-size chunk of W_s's safetensors bytes (see assimilator.paramstore)."""
    return f"{PREFIX}:job:{job_id}:params:{index}"


def params_size(job_id: int) -> str:
    """Byte length of W_s's safetensors blob (fixed for the life of a job)."""
    return f"{PREFIX}:job:{job_id}:params-size"


def version(job_id: int) -> str:
    """Integer version of W_s: the number of merges applied."""
    return f"{PREFIX}:job:{job_id}:version"


def merged(job_id: int) -> str:
    """Set of assignment ids already merged into W_s (the exactly-once ledger)."""
    return f"{PREFIX}:job:{job_id}:merged"


def merge_log(job_id: int) -> str:
    """Hash assignment id -> JSON {version, merged_at, received_at}: when each merge landed."""
    return f"{PREFIX}:job:{job_id}:merge-log"



def snapshots(job_id: int) -> str:
    """List of published snapshot versions, newest first (for retention)."""
    return f"{PREFIX}:job:{job_id}:snapshots"


METRIC_COUNTERS = f"{PREFIX}:metrics:counters"  # hash: event name -> count, shared by every process
MERGE_LATENCY = f"{PREFIX}:metrics:merge-latency"  # hash: histogram buckets, sum and count
