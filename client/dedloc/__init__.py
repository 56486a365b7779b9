"""The DeDLOC peer: accumulate gradients, rendezvous through the scheduler, all-reduce, step together."""
