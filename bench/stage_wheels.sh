#!/usr/bin/env bash
# Stage the wheels an offline GPU box lacks for `bench/gpu_check.sh --offline`, on a machine that reaches the
# package index: this project's wheel (installed there with --no-deps), TRL and whatever TRL needs that the box
# does not have (datasets, pyarrow, pandas, ...). Never torch, transformers, accelerate or peft: the box's stay.
#
#   bash bench/stage_wheels.sh                               # -> outputs/gpu_wheels (Python 3.12, manylinux x86_64)
#   bash bench/stage_wheels.sh --box-freeze box-freeze.txt   # what the box has, from `python -m pip freeze` there
#   bash bench/stage_wheels.sh --out /tmp/w --python-version 3.11 --platform manylinux_2_28_x86_64
#
# How: pip resolves (metadata only, --dry-run) the box's own packages, then the box's packages plus what the check
# needs, for the box's Python and platform; the difference is downloaded (binary wheels only) with the project's
# wheel, and requirements.txt lists it, pinned. Fails if the folder would exceed --max-mib (default 60: the box
# takes at most 64 MiB of files at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

out=outputs/gpu_wheels py_version=3.12 platform=manylinux_2_28_x86_64 box_freeze="" max_mib=60
# The offline GPU box this project is lent (docs/gpu.md), when no freeze of it is given.
box_default=("torch==2.11.0+cu130" "transformers==5.17.0" "accelerate==1.15.0" "peft")
# What bench/gpu_offline.py imports beyond the box (datasets comes through trl). pyarrow 21's wheel is 13 MB smaller
# than 24's: the last datasets that takes it (5.0.x) keeps the folder under 60 MiB (both are in the tested range:
# constraints/floor.txt pins pyarrow 21).
needs=("trl==1.16.*" "datasets<5.1" "pyarrow==21.0.0")
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?}; shift ;;
    --python-version) py_version=${2:?}; shift ;;
    --platform) platform=${2:?}; shift ;;
    --box-freeze) box_freeze=${2:?}; shift ;;
    --max-mib) max_mib=${2:?}; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "stage_wheels: error: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$box_freeze" ] && [ ! -f "$box_freeze" ]; then
  echo "stage_wheels: error: --box-freeze $box_freeze is not a file" >&2
  exit 2
fi
if [ -e "$out" ] && [ -n "$(ls -A "$out")" ]; then
  echo "stage_wheels: error: $out exists and is not empty (nothing is overwritten)" >&2
  exit 2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "$box_freeze" ]; then
  # editable installs and local paths of the box are not on any index
  grep -v -E '^(-e |#)|@ file:' "$box_freeze" >"$work/box.txt" || true
else
  printf '%s\n' "${box_default[@]}" >"$work/box.txt"
fi
# The box's torch is a stand-in wheel (its metadata, no files, its CUDA packages left out: the index needn't serve
# them), so the resolution keeps it and never stages a torch.
torch_pin=$(grep -i -E '^torch==' "$work/box.txt" | head -n 1 | cut -d= -f3)
if [ -z "$torch_pin" ]; then
  echo "stage_wheels: error: the box's packages name no torch==VERSION" >&2
  exit 2
fi
mkdir -p "$work/fake"
"$PYTHON" - "$work/fake" "$torch_pin" <<'PY'
import sys, zipfile
folder, version = sys.argv[1:]
info = f"torch-{version}.dist-info"
requires = ["filelock", "typing-extensions>=4.10.0", "setuptools", "sympy>=1.13.3", "networkx>=2.5.1", "jinja2",
            "fsspec>=0.8.5"]  # torch's own requirements, less its CUDA packages
metadata = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
with zipfile.ZipFile(f"{folder}/torch-{version}-py3-none-any.whl", "w") as whl:
    whl.writestr(f"{info}/METADATA", metadata)
    whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: stage_wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    whl.writestr(f"{info}/RECORD", "")
PY
# pip takes an explicit --platform literally: list the older manylinux tags a manylinux_2_28 box also runs
platforms=()
for tag in "$platform" manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 \
  manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
wheel_args=(--python-version "$py_version" "${platforms[@]}" --only-binary=:all:)
target=(--dry-run --ignore-installed --target "$work/target" "${wheel_args[@]}" --find-links "$work/fake" --quiet)

resolve() {  # resolve <report> <requirement files/args...>: name==version per line, lowercase names
  local report=$1; shift
  "$PYTHON" -m pip install "${target[@]}" --report "$report" "$@"
  "$PYTHON" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    m = item["metadata"]
    print(m["name"].lower().replace("_", "-") + "==" + m["version"])' "$report" | sort
}

echo "stage_wheels: resolving the box (Python $py_version, $platform): $(tr '\n' ' ' <"$work/box.txt")"
resolve "$work/box.json" -r "$work/box.txt" >"$work/box.lock"
printf '%s\n' "${needs[@]}" >"$work/needs.txt"
echo "stage_wheels: resolving the box + ${needs[*]}"
# The box's packages stay as they are, except these small pure-Python ones, which datasets caps (a staged fsspec
# replaces the box's).
relax='^(fsspec)=='
grep -v -E "$relax" "$work/box.lock" >"$work/box-kept.lock"
resolve "$work/all.json" -r "$work/box-kept.lock" -r "$work/needs.txt" >"$work/all.lock"
comm -13 "$work/box.lock" "$work/all.lock" >"$work/stage.txt"
if grep -q -E '^(torch|transformers|accelerate|peft)==' "$work/stage.txt"; then
  echo "stage_wheels: error: the box's torch/transformers/accelerate/peft would change:" >&2
  grep -E '^(torch|transformers|accelerate|peft)==' "$work/stage.txt" >&2
  exit 1
fi

mkdir -p "$out"
echo "stage_wheels: downloading $(wc -l <"$work/stage.txt") wheels: $(tr '\n' ' ' <"$work/stage.txt")"
"$PYTHON" -m pip download --quiet --no-deps "${wheel_args[@]}" -d "$out" -r "$work/stage.txt"
"$PYTHON" -m pip wheel --quiet --no-deps -w "$out" .
cp "$work/stage.txt" "$out/requirements.txt"
size_kib=$(du -sk "$out" | cut -f1)
echo "stage_wheels: $out: $(ls "$out"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB ($size_kib KiB)"
if [ "$size_kib" -gt $((max_mib * 1024)) ]; then
  echo "stage_wheels: error: $out is over --max-mib $max_mib" >&2
  exit 1
fi
