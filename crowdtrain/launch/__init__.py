"""Start crowdtrain's processes on one machine (a private Redis, the scheduler, the transitioner,
parameter servers, clients) and keep them running (entry points)."""
