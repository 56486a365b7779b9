"""The HTTP shell: the FastAPI app, its dependencies, its boundary and its routes (entry points)."""
