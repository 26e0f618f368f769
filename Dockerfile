# One image for every rlbus role in docker-compose.yml (`rlbus topics create`, workers, the blob store, …).
#
# `make images` (infra/images/build.sh) builds it FROM rlbus/debian:bookworm, a base made from Debian's
# packages, and installs the dependencies from a wheelhouse the host's pip fills (WHEELS, served on the
# host's loopback to this build, which runs with --network host). Where a registry is reachable:
#   docker build --build-arg BASE=python:3.11-slim -t rlbus/rlbus:dev .
# and pip reads PyPI (or PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, e.g. a CPU-only torch index).
#
# Layers go from what changes least to what changes most: system packages, then the dependencies
# (from pyproject.toml alone), then the code, so a code change rebuilds only the last layers.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG WHEELS=
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/rlbus/bin:$PATH

# The sandbox (bubblewrap + prlimit), git for the coding environment's patches (env "swe") and openssl for
# `rlbus secrets issue` (docker-compose.secure.yml); already in the Debian base, so there this layer only checks.
RUN command -v bwrap git prlimit openssl >/dev/null || { apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap util-linux git openssl && rm -rf /var/lib/apt/lists/*; }
# A venv, so the same steps work on Debian's externally managed python3.11 and on python:3.11-slim.
RUN python3.11 -m venv /opt/rlbus
# The worker user; the mount points of the compose volumes (blob store, run logs and checkpoints) owned by it so
# fresh named volumes inherit it; numba's cache of the weight codec's kernels, written below as that user.
ENV NUMBA_CACHE_DIR=/var/cache/rlbus/numba
RUN useradd --create-home --uid 10001 rlbus \
    && mkdir -p /data/blobs /data/runs "$NUMBA_CACHE_DIR" && chown -R rlbus /data /var/cache/rlbus
WORKDIR /app
COPY pyproject.toml ./
# Extras: swe (the coding environment's test runtime), envs (the reasoning-gym and verifiers adapters). The
# package's README is a stub here (pyproject names it), so editing the README does not reinstall torch.
RUN mkdir rlbus && touch rlbus/__init__.py README.md \
    && pip install ${WHEELS:+--no-index --find-links "$WHEELS"} ".[swe,envs]" \
    && pip uninstall -y rlbus && rm -rf rlbus build rlbus.egg-info README.md

COPY README.md ./
COPY rlbus ./rlbus
RUN pip install ${WHEELS:+--no-index --find-links "$WHEELS"} --no-deps . && rm -rf build rlbus.egg-info
USER rlbus
# The codec's numba kernels, compiled once into the image (as the user that loads them), not in every worker.
RUN rlbus codec warm
# 8470: `rlbus blobs serve`; 9400: the workers' metrics (and /healthz); 8000: the gateway.
EXPOSE 8470 9400 8000
CMD ["rlbus", "--help"]
