#!/usr/bin/env bash
# Builds the compiled gateway (gateway/go) into build/epd-gateway: Go in GOPATH mode, offline,
# against the generated Go SDK and Debian's Go sources, as scripts/gen_sdks.sh builds the Go
# client (it installs the toolchain, and generates the SDK when it is missing).
#
#   scripts/build_gateway.sh           build
#   scripts/build_gateway.sh --check   also refuse code gofmt would change, run go vet and its
#                                      unit tests (pure logic; CI)
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=0
case "${1:-}" in
  "") ;;
  --check) CHECK=1 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
[ -d sdk/.gopath/src/epd/sdk/go/epd/v1 ] || ./scripts/gen_sdks.sh
export GO111MODULE=off GOPROXY=off GOFLAGS= GOPATH="$PWD/sdk/.gopath:/usr/share/gocode"
if [ "$CHECK" = 1 ]; then
  unformatted=$(gofmt -l gateway/go)
  [ -z "$unformatted" ] || { echo "[gateway] gofmt would change: $unformatted (run gofmt -w gateway/go)" >&2; exit 1; }
  (cd gateway/go && go vet . && go test .)
fi
mkdir -p build
(cd gateway/go && go build -o ../../build/epd-gateway .)
echo "[gateway] built build/epd-gateway"
