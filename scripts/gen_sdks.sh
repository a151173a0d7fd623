#!/usr/bin/env bash
# Generates the epd.v1 client SDKs under sdk/ (never committed; see protos/README.md):
#   sdk/python  the `epd-client` package (messages, gRPC stubs, .pyi), no vLLM or torch
#   sdk/ts      TypeScript for Node (ts-proto + @grpc/grpc-js), built to sdk/ts/dist
#   sdk/go      the Go module github.com/epd-project/epd/sdk/go (protoc-gen-go + protoc-gen-go-grpc;
#               its go.mod is committed), built offline against Debian's Go sources
# with protos/buf.gen.yaml and local plugins only: nothing is fetched at generation time.
#
#   scripts/gen_sdks.sh           install what is missing, generate, build the TypeScript SDK
#   scripts/gen_sdks.sh --check   also compile and type-check each SDK and the example
#                                 clients (what CI runs, from scripts/test.sh)
#
# Idempotent: apt-get runs only for a missing tool, the tool venv and node_modules are
# rebuilt only when sdk/requirements.txt or a package-lock.json changes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CHECK=0
case "${1:-}" in
  "") ;;
  --check) CHECK=1 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
step() { echo "[sdk] $*"; }
SECONDS=0

# --- toolchain ----------------------------------------------------------------------------
# Debian 12 packages: Go 1.19, protoc-gen-go 1.28.1, protoc-gen-go-grpc (grpc-go 1.33.3) and
# the Go sources of grpc, protobuf and genproto in /usr/share/gocode (the Go module proxy is
# not reachable from CI, so Go builds in module mode with those sources vendored). Node and npm for the
# TypeScript SDK.
missing=()
command -v go >/dev/null || missing+=(golang-go)
command -v protoc-gen-go >/dev/null || missing+=(protoc-gen-go)
command -v protoc-gen-go-grpc >/dev/null || missing+=(protoc-gen-go-grpc)
[ -d /usr/share/gocode/src/google.golang.org/grpc ] || missing+=(golang-google-grpc-dev)
[ -d /usr/share/gocode/src/google.golang.org/protobuf ] || missing+=(golang-google-protobuf-dev)
[ -d /usr/share/gocode/src/google.golang.org/genproto/googleapis/rpc ] || missing+=(golang-google-genproto-dev)
# grpc-go 1.33 (un)marshals through github.com/golang/protobuf. Its 1.3 series, which Debian
# installs with grpc by default, cannot read the APIv2 messages protoc-gen-go 1.28 generates:
# every call panics ("protobuf tag not enough fields"). 1.5 is the APIv2 shim (it replaces 1.3).
dpkg-query -W -f='${Status}' golang-github-golang-protobuf-1-5-dev 2>/dev/null | grep -q "ok installed" || missing+=(golang-github-golang-protobuf-1-5-dev)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  step "apt-get install ${missing[*]}"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The versions buf.gen.yaml and protos/README.md name; a different Debian release would
# generate other code, so say so instead of drifting.
[[ "$(protoc-gen-go --version)" == "protoc-gen-go v1.28.1" ]] || { echo "[sdk] expected protoc-gen-go v1.28.1, got: $(protoc-gen-go --version)" >&2; exit 1; }
grpc_go=$(dpkg-query -W -f='${Version}' golang-google-grpc-dev 2>/dev/null || echo none)
[[ "$grpc_go" == 1.33.3-* ]] || { echo "[sdk] expected golang-google-grpc-dev 1.33.3, got $grpc_go" >&2; exit 1; }

# Python tools (buf, grpcio-tools, mypy-protobuf, mypy): exact pins in their own venv, kept in
# the user's cache under the requirements' hash, so that fresh clones (CI's) reuse it;
# sdk/.tools links to it.
TOOLS=sdk/.tools
stamp=$(sha256sum sdk/requirements.txt | cut -d' ' -f1)
venv="${XDG_CACHE_HOME:-$HOME/.cache}/epd/sdk-tools-${stamp:0:16}"
if [ "$(cat "$venv/.stamp" 2>/dev/null)" != "$stamp" ]; then
  step "python tools venv ($venv) from sdk/requirements.txt"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -qq -r sdk/requirements.txt
  echo "$stamp" >"$venv/.stamp"
fi
[ -L "$TOOLS" ] || rm -rf "$TOOLS"
ln -sfn "$venv" "$TOOLS"

# npm packages exactly as the lock files say (npm ci), only when a lock file changed.
npm_ci() {
  local dir=$1 lock
  lock=$(sha256sum "$dir/package-lock.json" | cut -d' ' -f1)
  if [ "$(cat "$dir/node_modules/.epd-lock-sha" 2>/dev/null)" != "$lock" ]; then
    step "npm ci in $dir"
    (cd "$dir" && npm ci --prefer-offline --no-audit --no-fund --loglevel=error)
    echo "$lock" >"$dir/node_modules/.epd-lock-sha"
  fi
}
npm_ci sdk/ts

# --- generation ---------------------------------------------------------------------------
# The protos the TypeScript SDK needs besides epd.v1, from the pinned packages that ship them.
deps=sdk/ts/.proto-deps
rm -rf "$deps"
mkdir -p "$deps/google/rpc" "$deps/grpc/health/v1" "$deps/grpc/reflection/v1"
rpc_dir=$("$TOOLS/bin/python" -c 'import google.rpc, os; print(google.rpc.__path__[0])')
cp "$rpc_dir/status.proto" "$rpc_dir/error_details.proto" "$deps/google/rpc/"
cp sdk/ts/node_modules/grpc-health-check/proto/health/v1/health.proto "$deps/grpc/health/v1/"
cp sdk/ts/node_modules/@grpc/reflection/build/proto/grpc/reflection/v1/reflection.proto "$deps/grpc/reflection/v1/"

step "buf generate (protos/buf.gen.yaml, protos/buf.gen.deps.yaml)"
"$TOOLS/bin/buf" generate --template protos/buf.gen.yaml
"$TOOLS/bin/buf" generate --template protos/buf.gen.deps.yaml
# The SDKs' version is sdk/VERSION, whose major is the proto package's (epd.v1: 1): a breaking
# contract goes to epd.v2 and SDK 2.x together (protos/README.md).
VERSION=$(cat sdk/VERSION)
major=$(find protos/epd -maxdepth 1 -name 'v[0-9]*' -printf '%f\n' | tr -d v | sort -n | tail -1)
[[ "$VERSION" =~ ^${major}\.[0-9]+\.[0-9]+$ ]] || { echo "[sdk] sdk/VERSION is $VERSION: it must be ${major}.MINOR.PATCH (epd.v${major})" >&2; exit 1; }
# epd is a namespace package (shared with the services' own epd package); epd.v1 is typed.
printf '__version__ = "%s"\n' "$VERSION" >sdk/python/src/epd/v1/__init__.py
: >sdk/python/src/epd/v1/py.typed

step "tsc (sdk/ts -> sdk/ts/dist)"
rm -rf sdk/ts/dist
(cd sdk/ts && node_modules/.bin/tsc -p tsconfig.json)

# Installable artifacts in sdk/dist: the Python wheel and sdist, the npm tarball, all at
# sdk/VERSION (npm packs a copy whose package.json carries it; the committed one says 0.0.0).
step "artifacts (sdk/dist): python -m build sdk/python, npm pack sdk/ts, version $VERSION"
rm -rf sdk/dist sdk/python/build sdk/python/src/*.egg-info
built=$("$TOOLS/bin/python" -m build --no-isolation --outdir sdk/dist sdk/python 2>&1) || { echo "$built" >&2; exit 1; }
stage=$(mktemp -d)
cp -r sdk/ts/package.json sdk/ts/dist "$stage/"
(cd "$stage" && npm pkg set version="$VERSION" && npm pack --silent --pack-destination "$ROOT/sdk/dist" >/dev/null)
rm -rf "$stage"

step "generated in ${SECONDS}s"
[ "$CHECK" = 1 ] || exit 0

# --- checks -------------------------------------------------------------------------------
step "python: install the epd-client wheel into $TOOLS, import it without torch or vLLM, mypy --strict clients/python/usage.py"
wheel="sdk/dist/epd_client-$VERSION-py3-none-any.whl"
# This build over any earlier one of the same version, then what it depends on.
"$TOOLS/bin/python" -m pip install --disable-pip-version-check -qq --force-reinstall --no-deps "$wheel"
"$TOOLS/bin/python" -m pip install --disable-pip-version-check -qq "$wheel"
# From /tmp, so that `epd` cannot resolve to this checkout's own package.
(cd /tmp && VERSION=$VERSION "$ROOT/$TOOLS/bin/python" - <<'EOF'
import importlib.metadata
import importlib.util
import os

import epd.v1
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

assert epd.v1.__version__ == importlib.metadata.version("epd-client") == os.environ["VERSION"], epd.v1.__version__

assert "site-packages" in gateway_pb2.__file__, gateway_pb2.__file__
for heavy in ("torch", "vllm", "nixl"):
    assert importlib.util.find_spec(heavy) is None, f"{heavy} is installed in the SDK venv"
request = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4))
assert gateway_pb2.GenerateRequest.FromString(request.SerializeToString()) == request
assert hasattr(gateway_pb2_grpc, "GatewayServiceStub")
print("[sdk] python: epd.v1 imports from", gateway_pb2.__file__.rsplit("/epd/", 1)[0])
EOF
)
(cd clients/python && "$ROOT/$TOOLS/bin/mypy" --config-file mypy.ini --no-incremental --python-executable "$ROOT/$TOOLS/bin/python" usage.py)

step "typescript: npm install the SDK's tarball in an empty project and require it"
project=$(mktemp -d)
(cd "$project" && npm init -y >/dev/null && npm install --silent --prefer-offline --no-audit --no-fund "$ROOT/sdk/dist/epd-client-$VERSION.tgz" \
  && node -e 'const c = require("@epd/client"); if (!c.gateway.GatewayServiceClient) throw new Error("no GatewayServiceClient");
              const v = require("@epd/client/package.json").version; if (v !== process.argv[1]) throw new Error(v);' "$VERSION")
rm -rf "$project"
step "typescript: the SDK built above with tsc --strict; clients/node against it"
npm_ci clients/node
rm -rf clients/node/dist
(cd clients/node && node_modules/.bin/tsc -p tsconfig.json)

step "go: go vet and go build the SDK module and clients/go in module mode, offline (devkit/go_build.py)"
test -z "$(gofmt -l clients/go/*.go)" || { echo "[sdk] gofmt: $(gofmt -l clients/go/*.go)" >&2; exit 1; }
python3 -m devkit.go_build sdk/go clients/go
step "checked in ${SECONDS}s"
