#!/usr/bin/env bash
# Install the pinned kustomize that renders deploy/k8s (tests/unit/test_k8s.py renders every overlay with it).
#
#   bash infra/k8s/install-kustomize.sh        -> ${RLBUS_HOME:-$HOME/.cache/rlbus}/bin/kustomize
#
# Built from source with `go install` through the Go module proxy (no prebuilt binary is downloaded).
# v5.8.2 is the newest release whose go.mod accepts this machine's Go 1.26 (v5.8.3 asks for Go 1.27), so no
# GOTOOLCHAIN is needed. Nothing is done when that exact version is already installed. The first build takes
# about two minutes on 2 cores (seconds once Go's caches hold it); it runs niced, on every core unless
# RLBUS_KUSTOMIZE_JOBS says otherwise.
set -euo pipefail

KUSTOMIZE_VERSION="v5.8.2" # tests/unit/test_k8s.py reads the pin from this line
BIN_DIR="${RLBUS_HOME:-$HOME/.cache/rlbus}/bin"
TARGET="$BIN_DIR/kustomize"

installed_version() {
  # `kustomize version` prints e.g. "v5.8.2" for a go-installed build
  [ -x "$TARGET" ] && "$TARGET" version 2>/dev/null | head -n1 | tr -d '[:space:]' || true
}

if [ "$(installed_version)" = "$KUSTOMIZE_VERSION" ]; then
  echo "kustomize $KUSTOMIZE_VERSION already at $TARGET"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "install-kustomize: the go command is needed (Go 1.26+): it builds kustomize from the Go module proxy" >&2
  exit 1
fi

mkdir -p "$BIN_DIR"
jobs="${RLBUS_KUSTOMIZE_JOBS:-$(nproc)}"
echo "install-kustomize: building sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION into $BIN_DIR"
# Built into a fresh directory and then moved over any other version (go install refuses to overwrite a file
# it did not build); GOTOOLCHAIN=local refuses a silent toolchain download.
staging="$(mktemp -d "$BIN_DIR/.kustomize.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
GOBIN="$staging" GOTOOLCHAIN=local GOMAXPROCS="$jobs" GOFLAGS="${GOFLAGS:-} -p=$jobs" \
  nice -n 19 go install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"
mv -f "$staging/kustomize" "$TARGET"

got="$(installed_version)"
if [ "$got" != "$KUSTOMIZE_VERSION" ]; then
  echo "install-kustomize: $TARGET reports '$got', expected $KUSTOMIZE_VERSION" >&2
  exit 1
fi
echo "kustomize $KUSTOMIZE_VERSION installed at $TARGET"
