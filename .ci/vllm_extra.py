"""CI check: `pip install '.[vllm]'` resolves, against each torch the README's GPU section names, to versions the
test cells cover.

For each torch build named in README.md's "GPUs, vLLM and clusters" section, pip resolves the extra (``--dry-run
--report``: package metadata only, nothing downloaded but that) into a throwaway environment whose only package is
that torch (its metadata; the README tells users to keep their torch with ``-c``, and so does this). Every package
the project's code calls (pyproject's dependencies, and the libraries under transformers) must resolve to a version
within the versions the cells installed and tested (.venv = newest, .venv-vllm, .venv-floor): at or above the
lowest and at or below the highest. Exit status 1 otherwise, or when a resolution fails.

    python .ci/vllm_extra.py --cell newest=.venv --cell vllm=.venv-vllm --cell floor=.venv-floor
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
GPU_SECTION = "## GPUs, vLLM and clusters"
# Beyond pyproject's own dependencies: the libraries the code reaches through transformers and datasets.
ALSO_TRACKED = ("numpy", "tokenizers", "huggingface-hub", "safetensors", "pyarrow")


def readme_torches(readme: Path) -> list[str]:
    """The torch versions the README's GPU section names (``torch 2.13.0``, ``torch==2.11.0+cu130``)."""
    text = readme.read_text()
    start = text.find(GPU_SECTION)
    if start < 0:
        raise SystemExit(f"vllm_extra: error: README.md has no '{GPU_SECTION}' section")
    end = text.find("\n## ", start + len(GPU_SECTION))
    section = text[start : end if end > 0 else len(text)]
    found = re.findall(r"\btorch(?: |==)(\d+\.\d+\.\d+(?:\+[a-z0-9]+)?)\b", section)
    if not found:
        raise SystemExit(f"vllm_extra: error: README.md's '{GPU_SECTION}' section names no torch version")
    return list(dict.fromkeys(found))


def tracked_names() -> list[str]:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [canonicalize_name(Requirement(d).name) for d in deps]
    return [n for n in dict.fromkeys(names + [canonicalize_name(n) for n in ALSO_TRACKED]) if n != "torch"]


def cell_versions(venv: Path) -> dict[str, str]:
    """name -> version of every distribution installed in a cell's venv."""
    code = "import json; from importlib import metadata; print(json.dumps({d.metadata['Name']: d.version for d in metadata.distributions()}))"  # noqa: E501
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True)
    return {canonicalize_name(k): v for k, v in json.loads(out.stdout).items() if k}


def resolve(torch_version: str, work: Path) -> tuple[dict[str, str] | None, str]:
    """(name -> version pip would install for '.[vllm]' beside `torch_version`, or None; pip's error tail)."""
    venv = work / f"torch-{torch_version}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    info = Path(purelib) / f"torch-{torch_version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    keep = work / f"keep-{torch_version}.txt"
    keep.write_text(f"torch=={torch_version}\n")
    report = work / f"report-{torch_version}.json"
    cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--dry-run", "--quiet",
           "--report", str(report), "-c", str(keep), f"{ROOT}[vllm]"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, "\n".join(line for line in proc.stderr.splitlines() if "is ignored" not in line)[-2000:]
    installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}, ""


def check(resolved: dict[str, str], cells: dict[str, dict[str, str]], names: list[str]) -> list[tuple[str, str, str]]:
    """(name, resolved version, verdict) for each tracked name pip would install; verdict starts 'ok' or 'OUTSIDE'."""
    rows = []
    for name in names:
        if name not in resolved:
            continue
        version = Version(resolved[name])
        tested = {cell: Version(v[name]) for cell, v in cells.items() if name in v}
        if not tested:
            rows.append((name, resolved[name], "OUTSIDE: no cell installs it"))
            continue
        low, high = min(tested.values()), max(tested.values())
        span = ", ".join(f"{cell} {v}" for cell, v in sorted(tested.items(), key=lambda kv: kv[1]))
        if low <= version <= high:
            same = [cell for cell, v in tested.items() if v == version]
            rows.append((name, resolved[name], f"ok ({'= ' + ', '.join(same) if same else 'within ' + span})"))
        else:
            rows.append((name, resolved[name], f"OUTSIDE the tested {span}"))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", action="append", required=True, help="NAME=VENV, a tested cell's environment")
    parser.add_argument("--torch", action="append", help="torch versions (default: those the README names)")
    args = parser.parse_args(argv)
    cells = {}
    for spec in args.cell:
        name, _, venv = spec.partition("=")
        if not (Path(venv) / "bin" / "python").exists():
            parser.error(f"--cell {spec}: {venv} is not a virtual environment")
        cells[name] = cell_versions(Path(venv))
    torches = args.torch or readme_torches(ROOT / "README.md")
    names = tracked_names()
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for torch_version in torches:
            start = time.perf_counter()
            resolved, error = resolve(torch_version, Path(tmp))
            took = time.perf_counter() - start
            if resolved is None:
                print(f"vllm_extra: torch {torch_version}: pip could not resolve '.[vllm]' ({took:.0f} s):\n{error}")
                failed = True
                continue
            vllm = resolved.get("vllm", "none")
            print(f"vllm_extra: torch {torch_version}: vllm {vllm}, {len(resolved)} packages ({took:.0f} s)")
            for name, version, verdict in check(resolved, cells, names):
                print(f"  {name:18s} {version:12s} {verdict}")
                failed |= not verdict.startswith("ok")
    print(f"vllm_extra: {'FAILED: a resolved version lies outside the tested cells' if failed else 'OK'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
