#!/usr/bin/env bash
# Wheels for a GPU machine that installs nothing from a registry: py-spy (bench_served.py --profile)
# and Ray with the packages it needs that such a machine lacks (jsonschema and its own needs), into
# .whl/ (ignored by git). Ray's wheel is 79 MB, over what a call may carry; its Java jars (ray/jars,
# 32 MB compressed, for Ray's Java workers, which the project never starts) are left out of the copy.
# On the machine, before the command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site
# Usage (repository root, where pip can reach a registry): bash scripts/device_wheels.sh [RAY_VERSION]
set -euo pipefail
ray_version=${1:-$(python3 -c "import ray; print(ray.__version__)" 2>/dev/null || echo 2.60.0)}
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d .whl "$@"
}
get py-spy jsonschema jsonschema-specifications referencing rpds-py
tmp=$(mktemp -d)
get -d "$tmp" "ray==$ray_version"
python3 - "$tmp"/ray-*.whl .whl <<'EOF'
import pathlib, sys, zipfile

src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]) / pathlib.Path(sys.argv[1]).name
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if info.filename.startswith("ray/jars/"):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(keepends=True) if not l.startswith(b"ray/jars/"))
        zout.writestr(info, data)
print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB (from {src.stat().st_size / 2**20:.1f} MiB, without ray/jars)")
EOF
rm -rf "$tmp"
du -ch .whl/*.whl | tail -1
