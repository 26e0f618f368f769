#!/usr/bin/env bash
# Start or stop a Docker engine for `make images` / `make compose-test` where none runs (as root).
#
#   infra/images/dockerd.sh start    start dockerd unless one answers; wait until it does
#   infra/images/dockerd.sh stop     stop the dockerd this script started (not one it found running)
#
# dockerd runs with --iptables=false: containers on a compose network reach each other by name and the
# host reaches their published ports (docker-proxy), but nothing here rewrites the host's firewall or
# gives containers a route out. Builds reach the package registries through the host's network instead
# (`docker build --network host`). Log: $RLBUS_HOME/docker/dockerd.log (default ~/.cache/rlbus).
set -euo pipefail
dir="${RLBUS_HOME:-$HOME/.cache/rlbus}/docker"
pidfile="$dir/dockerd.pid"

case "${1:-}" in
  start)
    if docker info >/dev/null 2>&1; then
      echo "a Docker engine answers already ($(docker info -f '{{.ServerVersion}}'))"
      exit 0
    fi
    [[ "$(id -u)" == 0 ]] || { echo "dockerd needs root: sudo $0 start" >&2; exit 1; }
    command -v dockerd >/dev/null || { echo "dockerd not found: infra/install-deps.sh infra/images/system-packages.txt" >&2; exit 1; }
    mkdir -p "$dir"
    nohup dockerd --iptables=false --pidfile "$dir/docker.pid" >"$dir/dockerd.log" 2>&1 &
    echo $! >"$pidfile"
    for _ in $(seq 120); do
      docker info >/dev/null 2>&1 && { echo "dockerd started (log $dir/dockerd.log)"; exit 0; }
      kill -0 "$(cat "$pidfile")" 2>/dev/null || break
      sleep 0.5
    done
    echo "dockerd did not come up; its log:" >&2
    tail -20 "$dir/dockerd.log" >&2
    exit 1
    ;;
  stop)
    [[ -f "$pidfile" ]] || { echo "no dockerd started by this script"; exit 0; }
    pid="$(cat "$pidfile")"
    if kill "$pid" 2>/dev/null; then
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      echo "dockerd stopped"
    fi
    rm -f "$pidfile"
    ;;
  *)
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
