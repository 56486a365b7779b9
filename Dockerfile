# The server image: scheduler, parameter servers (assimilator), transitioner and `crowdtrain migrate`.
# docker-compose.yml runs one process per container from this image; only the command differs.
#
# Build arguments (the defaults are the production build):
#   BASE_IMAGE       any Debian-based image with Python 3.11+ and its venv module as `python3`
#   TORCH_INDEX_URL  where torch and its dependencies come from (PyTorch's CPU-only index)
# Wheels put in wheelhouse/ (empty in the repository) are installed in preference to an index's of the same
# version: `make compose-test` builds on a local Debian image with the CPU torch wheel it finds on its machine.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A virtual environment: Debian's own Python refuses pip installs into the system (PEP 668).
RUN python3 -m venv /opt/venv
COPY wheelhouse /wheelhouse

# torch first, CPU-only, pinned like the Makefile: with it installed, the project's `torch>=2.3`
# pulls nothing more (the default index would bring the CUDA build, gigabytes the server never uses).
RUN pip install --find-links /wheelhouse --index-url "$TORCH_INDEX_URL" torch==2.13.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY crowdtrain ./crowdtrain
COPY server ./server
COPY workgen ./workgen
COPY assimilator ./assimilator
COPY client ./client
COPY migrations ./migrations
# TensorFlow too: parameter servers evaluate TensorFlow jobs and Keras JSON models with it. The data
# extra reads csv, parquet, Hugging Face and image-folder datasets at submission.
RUN pip install --find-links /wheelhouse ".[server,tensorflow,data]"

# The image itself: the base and the virtual environment, not the wheels and sources it was built from.
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv

# An unprivileged user; its working directory holds the example job specs
# (`docker compose exec scheduler crowdtrain job submit examples/mnist1d-cnn.yaml`).
RUN useradd --create-home --uid 10001 crowdtrain \
    && mkdir -p /var/lib/crowdtrain \
    && chown crowdtrain:crowdtrain /var/lib/crowdtrain
WORKDIR /home/crowdtrain
COPY --chown=crowdtrain:crowdtrain examples ./examples
USER crowdtrain
ENV CROWDTRAIN_VAR_DIR=/var/lib/crowdtrain

EXPOSE 8000
CMD ["crowdtrain", "server", "--host", "0.0.0.0", "--port", "8000"]
