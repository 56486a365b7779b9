"""The FastAPI scheduler and the server-side services shared with the parameter servers."""
