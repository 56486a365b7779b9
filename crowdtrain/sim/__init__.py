"""Simulators that drive the real scheduler, parameter-server and trainer code without a cluster:
load (many hosts over HTTP) and training (many slots in one process) (entry points)."""
