# One image for every rlbus role in docker-compose.yml (`rlbus topics create`, workers, …).
#
# Dependencies (torch above all) are installed in their own layer from pyproject.toml alone, so
# editing the code rebuilds only the last layers. For a package mirror or a CPU-only torch index,
# pass --build-arg PIP_INDEX_URL=… and/or --build-arg PIP_EXTRA_INDEX_URL=…; pip reads both.
FROM python:3.11-slim

ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The sandbox (bubblewrap + prlimit) and git for the coding environment's patches (env "swe").
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap util-linux git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
# Extras: swe (the coding environment's test runtime), envs (the reasoning-gym and verifiers adapters).
RUN mkdir rlbus && touch rlbus/__init__.py && pip install ".[swe,envs]" && pip uninstall -y rlbus && rm -rf rlbus build rlbus.egg-info

COPY rlbus ./rlbus
RUN pip install --no-deps . && rm -rf build rlbus.egg-info

RUN useradd --create-home --uid 10001 rlbus
# Mount points of the compose volumes (blob store, run logs and checkpoints), owned by the worker user so
# fresh named volumes inherit it.
RUN mkdir -p /data/blobs /data/runs && chown -R rlbus /data
USER rlbus
# 8470: `rlbus blobs serve`; 9400: the workers' metrics.
EXPOSE 8470 9400
CMD ["rlbus", "--help"]
