# The server image: scheduler, parameter servers (assimilator), transitioner and `crowdtrain migrate`.
# docker-compose.yml runs one process per container from this image; only the command differs.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, CPU-only, pinned like the Makefile: with it installed, the project's `torch>=2.3`
# pulls nothing more (the default index would bring the CUDA build, gigabytes the server never uses).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

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
RUN pip install ".[server,tensorflow,data]"

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
