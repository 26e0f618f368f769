#!/usr/bin/env bash
# Make `docker compose …` work where the docker client has no compose plugin but Debian's docker-compose
# (Compose v1, the Python one) is installed: Debian bookworm packages the engine and docker-compose, not the
# compose plugin, so the docs' `docker compose` commands would otherwise fail there.
#
#   infra/images/compose-plugin.sh      (as root; make images-deps runs it)
#
# It installs a Docker CLI plugin (the CLI's documented plugin protocol: an executable named docker-<name> in
# a cli-plugins directory that answers `docker-cli-plugin-metadata`) that hands every other call to
# /usr/bin/docker-compose. Nothing is done where `docker compose version` already answers.
set -euo pipefail
if docker compose version >/dev/null 2>&1; then
  echo "docker compose: $(docker compose version 2>/dev/null | head -1)"
  exit 0
fi
v1=/usr/bin/docker-compose
[[ -x "$v1" ]] || { echo "no docker compose and no $v1: infra/install-deps.sh infra/images/system-packages.txt" >&2; exit 1; }
[[ "$(id -u)" == 0 ]] || { echo "installing the compose plugin needs root: sudo $0" >&2; exit 1; }
dir=/usr/local/lib/docker/cli-plugins
mkdir -p "$dir"
version="$("$v1" version --short 2>/dev/null || echo unknown)"
cat >"$dir/docker-compose" <<PLUGIN
#!/bin/sh
# Written by rlbus's infra/images/compose-plugin.sh: \`docker compose ARGS\` runs Debian's docker-compose ARGS.
if [ "\$1" = docker-cli-plugin-metadata ]; then
  echo '{"SchemaVersion": "0.1.0", "Vendor": "Debian docker-compose (via rlbus)", "Version": "$version", "ShortDescription": "Docker Compose v1"}'
  exit 0
fi
shift  # the CLI passes the plugin's name first
exec $v1 "\$@"
PLUGIN
chmod 755 "$dir/docker-compose"
docker compose version >/dev/null 2>&1 || { echo "the plugin at $dir/docker-compose does not answer" >&2; exit 1; }
echo "docker compose → $v1 ($version), through $dir/docker-compose"
