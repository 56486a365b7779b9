"""The volunteer client. It imports nothing of ours but the `crowdtrain` package."""
