"""What a volunteer client is told when it starts: its scheduler, how much work it takes on, where it
keeps its files and how it stops. The CLI (`crowdtrain client`) builds one from its options and the
preferences file; crowdtrain.client.worker.VolunteerClient runs it."""

from dataclasses import dataclass
from pathlib import Path

from crowdtrain.client.optimizer_states import DEFAULT_MAX_BYTES
from crowdtrain.client.preferences import Preferences
from crowdtrain.core.frameworks import Framework

# The default cache folder, as the CLI offers it: one per client on a machine.
DEFAULT_CACHE_DIR = Path("~/.cache/crowdtrain").expanduser()


@dataclass(frozen=True)
class ClientConfig:
    """A client's settings; everything but the scheduler and the join token has a default."""

    server_url: str
    join_token: str
    tasks: int = 1  # compute slots: assignments training at once
    device: str = "cpu"
    cache_dir: Path = DEFAULT_CACHE_DIR
    name: str | None = None  # the host's name at the scheduler (default: machine name and pid)
    max_assignments: int | None = None  # stop after this many (None: run until stopped)
    prefetch: bool = True  # hold one assignment more than the slots, downloaded and ready
    checkpoint_seconds: float = 30.0
    spot_notice_url: str = ""  # a spot-interruption notice endpoint to watch ("": none)
    spot_poll_seconds: float = 5.0
    sigterm_grace: float = 0.0  # seconds a SIGTERM leaves to finish what can finish
    max_download_rate: float | None = None  # bytes per second (None: unlimited)
    max_upload_rate: float | None = None
    preferences: Preferences | None = None  # None: Preferences(tasks=tasks, device=device)
    frameworks: list[Framework] | None = None  # None: those installed
    project_key: str | None = None  # pinned when the client joins (None: the first signed recipe's key)
    optimizer_state_bytes: int = DEFAULT_MAX_BYTES
