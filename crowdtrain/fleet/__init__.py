"""Spot fleets of preemptible instances that each run the volunteer client (entry points)."""
