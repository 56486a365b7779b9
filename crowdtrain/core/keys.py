"""Every Redis key, object-storage key and Celery queue name crowdtrain uses."""

PREFIX = "ct"
ASSIMILATE_QUEUE = "crowdtrain.assimilate"


def params_chunk(job_id: int, index: int) -> str:
    """One fixed-size chunk of W_s's safetensors bytes (see crowdtrain.server.paramstore.store)."""
    return f"{PREFIX}:job:{job_id}:params:{index}"


def params_size(job_id: int) -> str:
    """Byte length of W_s's safetensors blob (fixed for the life of a job)."""
    return f"{PREFIX}:job:{job_id}:params-size"


def rule_state_chunk(job_id: int, index: int) -> str:
    """One fixed-size chunk of the merge rule's state (momentum, buffers, ...) as safetensors bytes,
    written together with W_s (see crowdtrain.server.paramstore.store)."""
    return f"{PREFIX}:job:{job_id}:rule-state:{index}"


def rule_state_size(job_id: int) -> str:
    """Byte length of the rule state's safetensors blob; absent until the first merge creates it."""
    return f"{PREFIX}:job:{job_id}:rule-state-size"


def version(job_id: int) -> str:
    """Integer version of W_s: the number of merges applied."""
    return f"{PREFIX}:job:{job_id}:version"


def params_tag(job_id: int) -> str:
    """A random token written with every new W_s (initialised, restored or merged): a parameter server
    that holds the W_s of the token it wrote last needs not read it back (paramstore.merging.merge_batch)."""
    return f"{PREFIX}:job:{job_id}:params-tag"


def merge_lease(job_id: int) -> str:
    """Lease of the one parameter server that merges the job's results at a time
    (crowdtrain.server.paramstore.lease)."""
    return f"{PREFIX}:job:{job_id}:merge-lease"


def merges_wanted(job_id: int) -> str:
    """Set when a parameter server has a result of the job to merge; the lease's holder clears it
    before each pass and looks for it again before it lets the lease go (crowdtrain.server.paramstore.lease)."""
    return f"{PREFIX}:job:{job_id}:merges-wanted"


def merged(job_id: int) -> str:
    """Set of assignment ids already merged into W_s (the exactly-once ledger)."""
    return f"{PREFIX}:job:{job_id}:merged"


def merged_workunits(job_id: int) -> str:
    """Hash workunit id -> the assignment id W_s took it from: one result per workunit, however many
    assignments (a straggler and its duplicate) upload one (paramstore.merging.merge_batch)."""
    return f"{PREFIX}:job:{job_id}:merged-workunits"


def closed(job_id: int) -> str:
    """Set once the job stops running: no merge commits after it (paramstore.close_merges)."""
    return f"{PREFIX}:job:{job_id}:closed"


def result_digests(job_id: int) -> str:
    """Hash digest of a result's W_c (crowdtrain.core.digests) -> the assignment that first brought it:
    the same W_c under another assignment is a replayed result (crowdtrain.assimilator.inputs.replay_of)."""
    return f"{PREFIX}:job:{job_id}:result-digests"


def checked_upload(job_id: int, upload_key: str) -> str:
    """The digest of the weights W_c that the stored upload `upload_key` carries, set by the scheduler
    that checked it (crowdtrain.server.services.results.store_result): the parameter server neither
    checks nor hashes those bytes again. Expires on its own (result_records.CHECKED_UPLOAD_SECONDS)."""
    return f"{PREFIX}:job:{job_id}:checked-upload:{upload_key}"


def merge_log(job_id: int) -> str:
    """Hash assignment id -> JSON {version, received_at, merged_at, stamps}: when each merge landed, and when
    each of its stages ended (crowdtrain.core.merge_stages)."""
    return f"{PREFIX}:job:{job_id}:merge-log"


def update_norms(job_id: int) -> str:
    """List of the norms ||W_c - W_base|| of recently merged updates, newest first (crowdtrain.assimilator.policy)."""
    return f"{PREFIX}:job:{job_id}:update-norms"


def merge_failures(job_id: int) -> str:
    """Count of merges in a row that failed for a reason that will not go away (reset by a merge)."""
    return f"{PREFIX}:job:{job_id}:merge-failures"


def snapshots(job_id: int) -> str:
    """List of published snapshot versions, newest first (for retention)."""
    return f"{PREFIX}:job:{job_id}:snapshots"


def auth_failures(address: str) -> str:
    """Counter of failed authentications from one client address in the current window
    (crowdtrain.server.services.throttle)."""
    return f"{PREFIX}:auth-failures:{address}"


def ended_session(session_id: str) -> str:
    """Marks a dashboard session ended by logout until the cookie's own expiry (its TTL)
    (crowdtrain.server.services.sessions)."""
    return f"{PREFIX}:ended-session:{session_id}"


METRIC_COUNTERS = f"{PREFIX}:metrics:counters"  # hash: event name -> count, shared by every process
MERGE_LATENCY = f"{PREFIX}:metrics:merge-latency"  # hash: histogram buckets, sum and count
HELD_HOSTS = f"{PREFIX}:held-hosts"  # sorted set: host id -> when in-flight budgets last held it back


# Synchronous DeDLOC mode (server/dedloc.py): the rendezvous of one job's peers.
def dedloc_lock(job_id: int) -> str:
    """Lock held while a request moves the job's round from one phase to the next."""
    return f"{PREFIX}:job:{job_id}:dedloc:lock"


def dedloc_round(job_id: int) -> str:
    """JSON: the step being accumulated and the phase of its round
    (see crowdtrain.server.services.dedloc_document.Round)."""
    return f"{PREFIX}:job:{job_id}:dedloc:round"


def dedloc_changed(job_id: int) -> str:
    """Pub/sub channel: a message each time the job's round document changes, for the progress
    reports held open until it does (crowdtrain.server.services.dedloc_rounds.progress)."""
    return f"{PREFIX}:job:{job_id}:dedloc:changed"


def dedloc_peers(job_id: int) -> str:
    """Hash peer id -> JSON {host_id, relayed, last_seen, joined}."""
    return f"{PREFIX}:job:{job_id}:dedloc:peers"


def dedloc_progress(job_id: int, step: int) -> str:
    """Hash peer id -> examples the peer has accumulated for `step`."""
    return f"{PREFIX}:job:{job_id}:dedloc:progress:{step}"


def dedloc_commits(job_id: int) -> str:
    """Hash step -> JSON {attempt, members, digest}: how each step was committed."""
    return f"{PREFIX}:job:{job_id}:dedloc:commits"


def dedloc_digests(job_id: int, step: int) -> str:
    """Hash peer id -> sha256 of the parameters the peer holds at the start of `step`."""
    return f"{PREFIX}:job:{job_id}:dedloc:digests:{step}"


def dedloc_store(job_id: int, step: int, attempt: int, group: int) -> str:
    """Prefix of the rendezvous store of one all-reduce group (torch.distributed Store keys follow)."""
    return f"{PREFIX}:job:{job_id}:dedloc:store:{step}:{attempt}:{group}:"


def dedloc_part(job_id: int, step: int, attempt: int, part: str, chunk: int) -> str:
    """One chunk of one part of a round's sum (a group's all-reduce result or a relayed peer's gradient)."""
    return f"{PREFIX}:job:{job_id}:dedloc:part:{step}:{attempt}:{part}:{chunk}"


def dedloc_total(job_id: int, step: int, attempt: int, chunk: int) -> str:
    """One chunk of the combined sum of a round's parts, as members read it."""
    return f"{PREFIX}:job:{job_id}:dedloc:total:{step}:{attempt}:{chunk}"


def dedloc_part_size(job_id: int, step: int, attempt: int) -> str:
    """The float32 count of every part of a round: the first upload sets it, the others must match it."""
    return f"{PREFIX}:job:{job_id}:dedloc:part-size:{step}:{attempt}"


def dedloc_state_claim(job_id: int, step: int) -> str:
    """SET NX by the first upload of the state of `step`: later uploads change nothing."""
    return f"{PREFIX}:job:{job_id}:dedloc:state-claim:{step}"


def dedloc_state_refusals(job_id: int, step: int) -> str:
    """Hash peer id -> the digest of its refused upload of the state of `step` (one strike per step)."""
    return f"{PREFIX}:job:{job_id}:dedloc:state-refusals:{step}"


def dedloc_state_strikes(job_id: int) -> str:
    """Hash peer id -> how many states it uploaded that the members' digests refused; unlike the
    strikes of aborted attempts, a commit does not clear them."""
    return f"{PREFIX}:job:{job_id}:dedloc:state-strikes"


def dedloc_strikes(job_id: int) -> str:
    """Hash peer id -> aborted attempts in a row it was blamed for (cleared when it commits a step)."""
    return f"{PREFIX}:job:{job_id}:dedloc:strikes"


def dedloc_rates(job_id: int) -> str:
    """Hash peer id -> JSON {examples, seconds}: what the peer contributed to committed rounds and the
    seconds it took to accumulate them; a peer in it is established (crowdtrain.core.dedloc.claim_bounds)."""
    return f"{PREFIX}:job:{job_id}:dedloc:rates"


def dedloc_shut_out(job_id: int) -> str:
    """Set of peer ids excluded for good: new peers that timed out (claimed and did not deliver)."""
    return f"{PREFIX}:job:{job_id}:dedloc:shut-out"


def dedloc_passed_over(job_id: int) -> str:
    """Set of peer ids that matchmaking waited on and that were not ready by its deadline: they take
    part when ready, and are not waited on until they next take part in a round."""
    return f"{PREFIX}:job:{job_id}:dedloc:passed-over"


def dedloc_attended(job_id: int, step: int, attempt: int) -> str:
    """Set of the members of (step, attempt) that made a request of the reduction (store, part, total)."""
    return f"{PREFIX}:job:{job_id}:dedloc:attended:{step}:{attempt}"


def dedloc_aborts(job_id: int) -> str:
    """Hash "step:attempt" -> JSON {members, reason}: every aborted attempt, for the operator."""
    return f"{PREFIX}:job:{job_id}:dedloc:aborts"


def dedloc_refusals(job_id: int) -> str:
    """Hash host id -> JSON {peer_id, message, at}: hosts whose peer refused to join the job (its recipe
    unsigned, or not signed by the key the peer trusts), kept for the operator after the job ends."""
    return f"{PREFIX}:job:{job_id}:dedloc:refusals"


# Object storage: every key a job's bytes are stored under.
def shard_key(job_id: int, epoch: int, index: int) -> str:
    """One shard of training data. Epoch 0 is the deal every epoch shares (it keeps the layout of jobs
    from before re-dealing); epoch e >= 2 is the deal of a job with `dataset.reshuffle_each_epoch`."""
    if epoch == 0:
        return f"jobs/{job_id}/shards/{index:05d}.npz"
    return f"jobs/{job_id}/shards/e{epoch:05d}/{index:05d}.npz"


def dataset_key(sha256: str) -> str:
    """A dataset uploaded by an operator (a file, or a tar archive of a folder), named by the sha256 of
    its bytes: jobs refer to it by that hash, and uploading the same bytes twice stores them once."""
    return f"datasets/{sha256}"


def validation_key(job_id: int) -> str:
    """The job's server-side validation split."""
    return f"jobs/{job_id}/validation.npz"


def snapshot_key(job_id: int, version: int) -> str:
    """A published W_s snapshot of `version`, what hosts start their assignments from."""
    return f"jobs/{job_id}/snapshots/v{version:08d}.safetensors"


def upload_key(job_id: int, assignment_id: int, nonce: str) -> str:
    """An uploaded result, under a key of its own per upload (`nonce`) until it is merged or refused."""
    return f"jobs/{job_id}/uploads/{assignment_id}-{nonce}.safetensors"


def final_key(job_id: int) -> str:
    """The model a finished job exports."""
    return f"jobs/{job_id}/final.safetensors"


def dedloc_state_key(job_id: int, step: int) -> str:
    """A DeDLOC job's parameters and optimizer state at the start of `step`."""
    return f"jobs/{job_id}/dedloc/state-{step:08d}.safetensors"


def text(reply: bytes | str) -> str:
    """A hash field or value read back from Redis, as str. redis-py types replies `bytes | str`;
    ours are bytes, since no client of ours sets `decode_responses`."""
    return reply.decode() if isinstance(reply, bytes) else reply


def health(kind: str, ident: str) -> str:
    """The health record of one long-running process (crowdtrain.server.services.health): it expires
    unless the process renews it."""
    return f"{PREFIX}:health:{kind}:{ident}"


def health_pattern(kind: str) -> str:
    return f"{PREFIX}:health:{kind}:*"


def expert_checkpoint_key(mixture_id: int, uid: str, step: int, nonce: str) -> str:
    """An expert's weights and optimizer state after `step` of its steps, as its host uploaded them,
    under a key of its own per upload (`nonce`): a refused upload is deleted without touching the kept one."""
    return f"mixtures/{mixture_id}/experts/{uid}/step-{step:010d}-{nonce}.safetensors"
