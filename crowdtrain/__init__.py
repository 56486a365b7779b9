"""crowdtrain: volunteer computing for deep learning (shared vocabulary)."""

__version__ = "0.1.0"
