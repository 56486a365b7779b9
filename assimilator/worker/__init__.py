"""The Celery shell of the parameter servers: the app and the task that wraps the merge (entry points)."""
