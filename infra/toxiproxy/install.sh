#!/usr/bin/env bash
# Install the pinned Toxiproxy, the WAN emulator between regions (tools/rlbus_tools/services/toxiproxy.py drives it):
#
#   bash infra/toxiproxy/install.sh   -> ${RLBUS_HOME:-$HOME/.cache/rlbus}/bin/toxiproxy-server, toxiproxy-cli
#
# Built from source with `go install` through the Go module proxy (no prebuilt binary is downloaded), like
# infra/k8s/install-kustomize.sh. v2.12.0's go.mod asks for Go 1.23, so this machine's Go 1.26 builds it without
# a toolchain download (GOTOOLCHAIN=local refuses one). Nothing is done when that exact version is installed.
# The first build takes a minute or two on 2 cores; it runs niced, on every core unless RLBUS_TOXIPROXY_JOBS
# says otherwise.
set -euo pipefail

TOXIPROXY_VERSION="v2.12.0" # tests/unit/services/test_toxiproxy.py reads the pin from this line
BIN_DIR="${RLBUS_HOME:-$HOME/.cache/rlbus}/bin"
SERVER="$BIN_DIR/toxiproxy-server"
CLI="$BIN_DIR/toxiproxy-cli"

installed_version() {
  # `toxiproxy-server --version` prints e.g. "toxiproxy-server version 2.12.0"
  [ -x "$SERVER" ] && [ -x "$CLI" ] && "$SERVER" --version 2>/dev/null | awk '{print "v" $NF}' || true
}

if [ "$(installed_version)" = "$TOXIPROXY_VERSION" ]; then
  echo "toxiproxy $TOXIPROXY_VERSION already at $SERVER"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "toxiproxy/install.sh: the go command is needed (Go 1.23+): it builds Toxiproxy from the Go module proxy" >&2
  exit 1
fi

mkdir -p "$BIN_DIR"
jobs="${RLBUS_TOXIPROXY_JOBS:-$(nproc)}"
echo "toxiproxy/install.sh: building github.com/Shopify/toxiproxy/v2@$TOXIPROXY_VERSION into $BIN_DIR"
staging="$(mktemp -d "$BIN_DIR/.toxiproxy.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
# The version is stamped the way Toxiproxy's own release build does, so --version names the pin.
GOBIN="$staging" GOTOOLCHAIN=local GOMAXPROCS="$jobs" GOFLAGS="${GOFLAGS:-} -p=$jobs" \
  nice -n 19 go install -ldflags "-X github.com/Shopify/toxiproxy/v2.Version=${TOXIPROXY_VERSION#v}" \
  "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION" \
  "github.com/Shopify/toxiproxy/v2/cmd/cli@$TOXIPROXY_VERSION"
mv -f "$staging/server" "$SERVER"
mv -f "$staging/cli" "$CLI"

got="$(installed_version)"
if [ "$got" != "$TOXIPROXY_VERSION" ]; then
  echo "toxiproxy/install.sh: $SERVER reports '$got', expected $TOXIPROXY_VERSION" >&2
  exit 1
fi
echo "toxiproxy $TOXIPROXY_VERSION installed at $SERVER (and toxiproxy-cli)"
