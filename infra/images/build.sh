#!/usr/bin/env bash
# Build every image docker-compose.yml runs, from what this machine reaches without a container
# registry: Debian's packages, PyPI and Maven Central.
#
#   infra/images/build.sh [--base IMAGE] [--context DIR] [--tag NAME] [IMAGE...]      (make images)
#
#   rlbus/debian:bookworm  the base: `mmdebstrap --variant=minbase bookworm` with Python 3.11, git,
#                          bubblewrap and CA certificates, through this machine's own apt sources,
#                          then `docker import`. Rebuilt only when its package list changes.
#   rlbus/rlbus:dev        ./Dockerfile FROM the base: a venv with the package and its extras. Its
#                          dependencies come from a wheelhouse this script fills with the host's pip
#                          (so the host's pip cache and index settings apply) and serves to the build
#                          on 127.0.0.1 (`docker build --network host`); a code change rebuilds only the
#                          last layer, a pyproject.toml change the dependency layer.
#   rlbus/kafka:<version>  infra/kafka/Dockerfile: Debian's JRE and the broker's jars, resolved by Maven
#                          from infra/kafka/pom.xml (the release `rlbus kafka start` runs).
#   rlbus/redis:bookworm   infra/redis/Dockerfile: Debian's redis-server.
#
# Name images to build only those (base, rlbus, kafka, redis). With a registry, skip this script:
#   docker build --build-arg BASE=python:3.11-slim -t rlbus/rlbus:dev .
#   and for Kafka and Redis --build-arg BASE=debian:bookworm-slim (the Kafka context needs the jars:
#   `infra/images/build.sh --base debian:bookworm-slim kafka` stages them and builds it).
#
# Needs a running Docker engine (infra/images/dockerd.sh start) and, for the base, mmdebstrap
# (infra/install-deps.sh infra/images/system-packages.txt installs it). Caches live under
# $RLBUS_HOME/images (default ~/.cache/rlbus/images). Prints the seconds each image took.
set -euo pipefail
cd "$(dirname "$0")/../.."

base_image="rlbus/debian:bookworm"
base_packages=(python3 python3.11-venv ca-certificates git bubblewrap util-linux procps openssl)
home="${RLBUS_HOME:-$HOME/.cache/rlbus}/images"
wheel_port="${RLBUS_WHEELHOUSE_PORT:-3141}"  # fixed: the dependency layer's cache key includes the address
python="${RLBUS_PYTHON:-.venv/bin/python}"  # the checkout's venv: rlbus resolves the Kafka jars
base=""
context="."
tag="rlbus/rlbus:dev"
targets=()
while (($#)); do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --context) context="$2"; shift 2 ;;  # the rlbus image's build context (default: this checkout)
    --tag) tag="$2"; shift 2 ;;          # the rlbus image's tag (default rlbus/rlbus:dev)
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    base|rlbus|kafka|redis) targets+=("$1"); shift ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
((${#targets[@]})) || targets=(base rlbus kafka redis)
wants() { [[ " ${targets[*]} " == *" $1 "* ]]; }
mkdir -p "$home"
docker info >/dev/null 2>&1 || { echo "no Docker engine answers; start one: infra/images/dockerd.sh start" >&2; exit 1; }

# docker build, showing its steps as it goes (the whole output goes to $home/build.log, and its end is
# printed when the build fails).
dbuild() {
  local status
  set +e
  docker build --network host "$@" 2>&1 | tee "$home/build.log" | grep --line-buffered -E '^Step [0-9]+/' \
    | sed -u 's/^\(.\{0,110\}\).*/  \1/'
  status=${PIPESTATUS[0]}
  set -e
  if ((status != 0)); then
    echo "docker build $* failed; the end of $home/build.log:" >&2
    tail -25 "$home/build.log" >&2
    return 1
  fi
}

timed() {  # timed NAME COMMAND...: run it, print how long it took
  local started=$SECONDS
  "${@:2}"
  printf 'image %-24s built in %4d s\n' "$1" $((SECONDS - started))
}

# --- the Debian base --------------------------------------------------------------------------------
# The host's apt sources (deb822 or one-line files), so the base fetches from wherever this machine's
# apt does; the image keeps them, so later `apt-get install` layers use the same mirror.
host_sources() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
    [[ -s "$f" ]] && grep -qv '^\s*\(#\|$\)' "$f" && echo "$f"
  done
  return 0
}

build_base() {
  local stamp
  stamp="$(printf '%s\n' "${base_packages[@]}" | sha256sum | cut -c1-16)"
  if [[ "$(docker image inspect -f '{{index .Config.Labels "org.rlbus.packages"}}' "$base_image" 2>/dev/null)" == "$stamp" ]]; then
    echo "image $base_image is current (packages $stamp)"
    return
  fi
  command -v mmdebstrap >/dev/null || { echo "mmdebstrap not found: infra/install-deps.sh infra/images/system-packages.txt" >&2; exit 1; }
  local -a sources
  mapfile -t sources < <(host_sources)
  ((${#sources[@]})) || { echo "no apt sources on this host to build the base from" >&2; exit 1; }
  local tarball="$home/debian-bookworm.tar"
  mmdebstrap --quiet --variant=minbase --mode=root --format=tar \
    --include="$(IFS=,; echo "${base_packages[*]}")" \
    --aptopt='APT::Install-Recommends "false"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$tarball" "${sources[@]}"
  docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "LABEL org.rlbus.packages=$stamp" \
    --change 'CMD ["/bin/bash"]' \
    "$tarball" "$base_image" >/dev/null
  rm -f "$tarball"
}

# --- rlbus ------------------------------------------------------------------------------------------
# The wheelhouse holds a wheel of every dependency of '.[swe,envs]' (built from sdists where PyPI has no
# wheel) and is refilled only when pyproject.toml changes.
fill_wheelhouse() {
  local wheels="$home/wheelhouse" stamp
  stamp="$(sha256sum pyproject.toml | cut -c1-16)"
  if [[ "$(cat "$wheels/.pyproject" 2>/dev/null)" != "$stamp" ]]; then
    echo "wheelhouse: resolving '.[swe,envs]' with the host's pip into $wheels"
    rm -rf "$wheels" && mkdir -p "$wheels"
    "$python" -m pip wheel --quiet --wheel-dir "$wheels" '.[swe,envs]' 'setuptools>=68' wheel  # + the build backend
    rm -f "$wheels"/rlbus-*.whl
    echo "$stamp" >"$wheels/.pyproject"
  fi
  echo "$wheels"
}

build_rlbus() {
  local -a args=(--build-arg "BASE=${base:-$base_image}")
  local server=""
  if [[ -z "$base" ]]; then
    local wheels
    wheels="$(fill_wheelhouse | tail -1)"
    "$python" -m http.server "$wheel_port" --bind 127.0.0.1 --directory "$wheels" >"$home/wheelhouse.log" 2>&1 &
    server=$!
    trap 'kill '"$server"' 2>/dev/null || true' RETURN
    for _ in $(seq 50); do curl -fs "http://127.0.0.1:$wheel_port/" >/dev/null && break; sleep 0.1; done
    args+=(--build-arg "WHEELS=http://127.0.0.1:$wheel_port/")
  fi
  dbuild "${args[@]}" -t "$tag" "$context"
}

# --- Kafka and Redis --------------------------------------------------------------------------------
build_kafka() {
  local jars version context="$home/kafka-context"
  jars="$("$python" -m rlbus_tools.services.kafka resolve | tail -1)"
  version="$("$python" -c 'from rlbus_tools.services.kafka_jars import kafka_version, pom_path; print(kafka_version(pom_path()))')"
  rm -rf "$context" && mkdir -p "$context"
  cp -l "$jars"/*.jar "$context/" 2>/dev/null || cp "$jars"/*.jar "$context/"
  cp infra/kafka/Dockerfile infra/kafka/entrypoint.sh infra/kafka/healthcheck.py infra/kafka/log4j2-container.properties "$context/"
  # Kafka's Admin client driven by rlbus (SCRAM users and ACLs: docker-compose.secure.yml's `acls`), compiled
  # here with the host's JDK against the same jars, so the image needs only the JRE
  mkdir "$context/tools"
  cp "$("$python" -c 'import sys; from pathlib import Path; from rlbus_tools.services.kafka_admin import compiled; print(compiled(Path(sys.argv[1])))' "$jars")"/*.class "$context/tools/"
  dbuild --build-arg "BASE=${base:-$base_image}" -t "rlbus/kafka:$version" "$context"
}

build_redis() {
  dbuild --build-arg "BASE=${base:-$base_image}" -t rlbus/redis:bookworm infra/redis
}

if wants base && [[ -z "$base" ]]; then timed "$base_image" build_base; fi
if wants rlbus; then timed "$tag" build_rlbus; fi
if wants kafka; then timed rlbus/kafka build_kafka; fi
if wants redis; then timed rlbus/redis:bookworm build_redis; fi
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep '^rlbus/' | sort
