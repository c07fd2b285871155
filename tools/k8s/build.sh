#!/usr/bin/env bash
# Build the real Kubernetes control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler), etcd and KWOK from their Go modules, for the integration tests, and
# Prometheus' promtool, which checks and unit-tests the chart's alerts, and the Prometheus
# server the planner's Prometheus source is tested against.
#
# Idempotent: each component lands in its own folder of the cache, keyed by version
# (versions.env), and is skipped when its folder is already complete. A fresh machine
# needs only Go (>= the version k8s.io/kubernetes' go.mod asks for) and the Go module
# proxy. Cold build: about 20 minutes on 2 cores (see docs/operator.md), 7-9 more for
# promtool (docs/observability.md) and about 7 more for the prometheus server (after
# promtool, whose module download and compiled packages it reuses; 8.4 + 6.7 minutes on 2
# cores that other jobs kept at a load average of 15).
#
#   tools/k8s/build.sh            build what is missing, print the cache folder
#   tools/k8s/build.sh promtool prometheus   build only the named components
#   KVFLOW_K8S_CACHE=/x build.sh  use another cache folder
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache="${KVFLOW_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvflow/k8s}"
mkdir -p "$cache"
export GOTOOLCHAIN=local   # never download another Go toolchain behind our back
export CGO_ENABLED=0       # static binaries; no C toolchain needed
export GOFLAGS="-mod=mod -buildvcs=false"
# Go's build and module caches for these builds are private to the cache folder and deleted
# once every component is built: left in ~/.cache/go-build and ~/go they held 4.6 GB that
# no later run reads (the binaries are what is cached), and a CI machine ran out of disk.
export GOCACHE="$cache/src/go-build" GOMODCACHE="$cache/src/go-mod"

log() { echo "[k8s-build $(date +%H:%M:%S)] $*" >&2; }

# A tools module that requires MODULE@VERSION and pins every `replace X => ./local/path`
# of that module's own go.mod to X@PINNED: Go ignores a dependency's replace directives,
# and k8s.io/kubernetes and etcd's server both point their sibling modules at local paths.
make_tools_module() {
  local dir="$1" module="$2" version="$3" pinned="$4" gomod
  mkdir -p "$dir"
  gomod="$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
  {
    echo "module kvflow.local/k8s-tools"
    echo
    echo "go $(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod")"
    echo
    echo "require $module $version"
    echo
    sed -n 's/^[[:space:]]*\([^[:space:]]*\) => \.\{1,2\}\/[^[:space:]]*$/\1/p' "$gomod" \
      | while read -r dep; do echo "replace $dep => $dep $pinned"; done
  } > "$dir/go.mod"
  log "tools module for $module@$version: $(grep -c '^replace' "$dir/go.mod") replaces"
}

build_kubernetes() {
  local out="$cache/kubernetes-$K8S_VERSION"
  [[ -f "$out/.complete" ]] && return 0
  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local staging="v0.$minor.${K8S_VERSION##*.}"   # k8s v1.36.3 <-> staging v0.36.3
  local src="$cache/src/kubernetes-$K8S_VERSION"
  make_tools_module "$src" k8s.io/kubernetes "$K8S_VERSION" "$staging"
  # Without these, /version says v0.0.0 and Helm's kubeVersion checks fail.
  local ldflags="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean"
  done
  log "building kube-apiserver, kube-controller-manager, kube-scheduler $K8S_VERSION"
  rm -rf "$out.tmp" && mkdir -p "$out.tmp/bin"
  (cd "$src" && go build -trimpath -ldflags "$ldflags" -o "$out.tmp/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler)
  touch "$out.tmp/.complete"
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "kubernetes done: $out/bin"
}

build_etcd() {
  local out="$cache/etcd-$ETCD_VERSION"
  [[ -f "$out/.complete" ]] && return 0
  local src="$cache/src/etcd-$ETCD_VERSION"
  make_tools_module "$src" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" "$ETCD_VERSION"
  log "building etcd $ETCD_VERSION"
  rm -rf "$out.tmp" && mkdir -p "$out.tmp/bin"
  (cd "$src" && go build -trimpath -ldflags "-s -w" -o "$out.tmp/bin/etcd" go.etcd.io/etcd/server/v3)
  touch "$out.tmp/.complete"
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "etcd done: $out/bin"
}

build_kwok() {
  local out="$cache/kwok-$KWOK_VERSION"
  [[ -f "$out/.complete" ]] && return 0
  log "building kwok $KWOK_VERSION"
  rm -rf "$out.tmp" && mkdir -p "$out.tmp/bin" "$out.tmp/stages"
  GOBIN="$out.tmp/bin" GOFLAGS=-buildvcs=false go install -trimpath -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # kwok refuses to start without Stage objects: take the upstream "fast" set
  # (kustomize/stage/fast: nodes Ready at once with lease heartbeats, Pods go
  # Running/Ready at once, deletions complete).
  local mod
  mod="$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  local d
  for d in node/fast node/heartbeat-with-lease pod/fast; do
    find "$mod/kustomize/stage/$d" -maxdepth 1 -name '*.yaml' ! -name kustomization.yaml \
      -exec cp {} "$out.tmp/stages/" \;
  done
  chmod -R u+w "$out.tmp/stages"
  touch "$out.tmp/.complete"
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "kwok done: $out/bin"
}

# promtool checks and unit-tests the chart's PrometheusRule (tests/k8s/test_observability.py).
# Prometheus v3 releases are published as module versions v0.3MM.P (v0.316.0 is 3.16.0);
# its go.mod has no local replaces, so `go install module/cmd/promtool@version` builds it.
build_promtool() {
  local out="$cache/promtool-$PROMETHEUS_VERSION"
  [[ -f "$out/.complete" ]] && return 0
  local minor="${PROMETHEUS_VERSION#v0.3}"; minor="${minor%%.*}"
  local release="3.$((10#$minor)).${PROMETHEUS_VERSION##*.}"   # v0.316.0 <-> 3.16.0
  log "building promtool $PROMETHEUS_VERSION (Prometheus $release)"
  rm -rf "$out.tmp" && mkdir -p "$out.tmp/bin"
  # remove_all_sd: Prometheus' own build tag that leaves out the service-discovery plugins
  # (the Azure, AWS, GCE, ... SDKs; about half the cold build): rule checks and rule unit
  # tests discover nothing. Without the -X, `promtool --version` names no release.
  GOBIN="$out.tmp/bin" GOFLAGS=-buildvcs=false go install -trimpath -tags remove_all_sd \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=$release" \
    "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION"
  "$out.tmp/bin/promtool" --version >&2
  touch "$out.tmp/.complete"
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "promtool done: $out/bin"
}

# The Prometheus server itself, from the same module, version and build tag as promtool: the
# planner's Prometheus source is tested against a real one scraping real worker and router
# processes (tests/operator/test_planner_prometheus.py). Built right after promtool in the
# same run, so it reuses promtool's downloaded module and compiled packages (GOCACHE above).
# No web UI assets are embedded (that needs the `builtinassets` tag and a Node build): the
# HTTP API the planner queries is all that is used.
build_prometheus() {
  local out="$cache/prometheus-$PROMETHEUS_VERSION"
  [[ -f "$out/.complete" ]] && return 0
  local minor="${PROMETHEUS_VERSION#v0.3}"; minor="${minor%%.*}"
  local release="3.$((10#$minor)).${PROMETHEUS_VERSION##*.}"   # v0.316.0 <-> 3.16.0
  log "building prometheus $PROMETHEUS_VERSION (Prometheus $release)"
  rm -rf "$out.tmp" && mkdir -p "$out.tmp/bin"
  GOBIN="$out.tmp/bin" GOFLAGS=-buildvcs=false go install -trimpath -tags remove_all_sd \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=$release" \
    "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION"
  "$out.tmp/bin/prometheus" --version >&2
  touch "$out.tmp/.complete"
  rm -rf "$out" && mv "$out.tmp" "$out"
  log "prometheus done: $out/bin"
}

components=("$@")
[[ ${#components[@]} -eq 0 ]] && components=(etcd kwok kubernetes promtool prometheus)
for c in "${components[@]}"; do "build_$c"; done
if [[ -d "$cache/src" ]]; then
  log "removing Go's build and module caches ($(du -sh "$cache/src" | cut -f1))"
  chmod -R u+w "$cache/src" && rm -rf "$cache/src"   # the module cache is read-only
fi
echo "$cache"
