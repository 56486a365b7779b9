"""The service layer's one clock.

Time is a parameter of the services: an entry point reads it once (a route through
crowdtrain.server.api.deps.clock) and hands it down, so a test drives it instead of sleeping until
a real window passes. A service called without one reads the wall clock here, and nowhere else.
"""

import time


def now_or_wall(now: float | None) -> float:
    """`now` when the caller passed one, else the current Unix time."""
    return time.time() if now is None else now
