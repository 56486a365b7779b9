"""Parameter servers: Celery tasks that validate returned models and merge them into W_s."""
