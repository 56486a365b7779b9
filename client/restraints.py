"""The volunteer's preferences in force while the client runs: when it may take work, how much it
may cache, and how many bytes it may move today.

The work loop asks `reason_to_wait()` before each work request and `reserve()` before each
assignment's downloads; the idle monitor calls back when the machine becomes busy or idle.
"""

import os
from collections.abc import Callable
from pathlib import Path

from crowdtrain.client.cache import CacheBudget, FileCache
from crowdtrain.client.idle import IdleMonitor, IdlePolicy, InputActivity, linux_input_activity
from crowdtrain.client.preferences import Preferences
from crowdtrain.client.quota import DailyTransfer, Reservation
from crowdtrain.client.status import ClientState
from crowdtrain.core.schemas import AssignmentOut


class Restraints:
    def __init__(
        self,
        prefs: Preferences,
        cache_dir: Path,
        in_use: Callable[[], set[str]],
        input_activity: InputActivity = linux_input_activity,
    ):
        self.prefs = prefs
        self.budget = CacheBudget(prefs.cache_max_bytes, in_use)
        self.shards = FileCache(cache_dir / "shards", self.budget)
        self.snapshots = FileCache(cache_dir / "snapshots", self.budget)
        self.transfer = DailyTransfer(cache_dir / "transfer.json", prefs.daily_download_bytes, prefs.daily_upload_bytes)
        self.input_activity = input_activity
        self.monitor: IdleMonitor | None = None

    def start(self, on_idle_change: Callable[[bool], None]) -> None:
        """Start watching the machine (only with idle_only: otherwise it always counts as idle)."""
        if self.prefs.idle_only:
            policy = IdlePolicy(self.prefs.idle_minutes, self.prefs.idle_cpu_percent)
            self.monitor = IdleMonitor(policy, on_idle_change, os.getpid(), self.input_activity)
            self.monitor.start()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    @property
    def machine_idle(self) -> bool:
        return self.monitor is None or self.monitor.idle

    def reason_to_wait(self) -> tuple[ClientState, str] | None:
        """Why the client must not ask for work now, or None."""
        if self.monitor is not None and not self.monitor.idle:
            return ClientState.not_idle, self.monitor.explain()
        over = self.transfer.over_cap()
        if over:
            return ClientState.over_cap, over
        return None

    def reserve(self, a: AssignmentOut) -> Reservation:
        """Reserve today's bytes for `a`: the files it lacks, and a result the size of its snapshot.

        Raises OverDailyCap; the client then hands the assignment back and waits for the next day.
        """
        download = sum(
            f.size for f, cache in ((a.shard, self.shards), (a.snapshot, self.snapshots)) if not cache.has(f.sha256)
        )
        return self.transfer.reserve(download, a.snapshot.size)

    def figures(self) -> dict:
        """Cache and transfer figures and the preferences in force, as ClientStatus fields."""
        t = self.transfer.figures()
        return {
            "cache_bytes": self.budget.used_bytes(),
            "cache_max_bytes": self.prefs.cache_max_bytes,
            "transfer_day": t["day"],
            "downloaded_bytes": t["used"]["download"],
            "uploaded_bytes": t["used"]["upload"],
            "daily_download_bytes": t["caps"]["download"],
            "daily_upload_bytes": t["caps"]["upload"],
            "preferences": self.prefs.model_dump(),
        }
