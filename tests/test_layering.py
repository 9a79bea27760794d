"""The package's layering (`[tool.importlinter]` in pyproject.toml), checked by `lint-imports` as `make lint` does:
no import cycles anywhere in trl_grpo_ext, and no module imports a layer above its own. Imports inside functions
count too. Here so that `make test` (and CI) enforce it, and so that a new module cannot sit outside the layers."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from importlinter.api import read_configuration

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "trl_grpo_ext"


def _lint_imports_executable() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.is_file() else shutil.which("lint-imports")
    assert found, "lint-imports is missing: install the dev extra (pip install -e '.[dev]')"
    return found


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package and pyproject.toml under `root` (no cache folder left behind)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run(
        [_lint_imports_executable(), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def contracts() -> dict[str, dict]:
    """pyproject.toml's contracts by id, as import-linter reads them."""
    options = read_configuration(str(REPO / "pyproject.toml"))["contracts_options"]
    return {contract["id"]: contract for contract in options}


def layer_names(contract: dict) -> set[str]:
    return {name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")}


def children(package_dir: Path) -> set[str]:
    """The modules and sub-packages directly inside `package_dir`."""
    names = {p.stem for p in package_dir.glob("*.py") if p.stem != "__init__"}
    return names | {p.parent.name for p in package_dir.glob("*/__init__.py")}


def test_lint_imports_keeps_every_contract():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(contracts())} kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "contract_id, container",
    [("layers", PACKAGE), ("pytrio-layers", f"{PACKAGE}.pytrio"), ("trl-layers", f"{PACKAGE}.trl")],
)
def test_every_module_has_a_layer(contract_id, container):
    contract = contracts()[contract_id]
    assert contract["containers"] == [container]
    modules = children(REPO / container.replace(".", "/"))
    named = layer_names(contract)
    assert not modules - named, f"give these modules a layer in pyproject.toml's contract {contract_id!r}"
    assert not named - modules, "layers naming modules that do not exist"


@pytest.mark.parametrize(
    "module, added_import, broken, kept",
    [
        # answers.equality imports answers.text: a cycle inside one layer (the layers contract cannot see it).
        ("task/answers/text.py", "from trl_grpo_ext.task.answers import equality", "acyclic", "layers"),
        # report does not import progress: no cycle, but progress is below report.
        ("progress.py", "from trl_grpo_ext.report import tables", "layers", "acyclic"),
        # the environments sit below the paths and evaluation, above the task they may grade with
        ("environments/tools.py", "from trl_grpo_ext.evaluation import options", "layers", "acyclic"),
        # the GRPO core may import torch but not TRL, which sits in no layer of ours
        ("grpo/losses.py", "from trl.trainer.utils import nanstd", "grpo-without-trl", "layers"),
    ],
    ids=["cycle", "upward-import", "environments-upward-import", "grpo-imports-trl"],
)
def test_a_new_cycle_or_upward_import_breaks_lint_imports(tmp_path, module, added_import, broken, kept):
    shutil.copytree(REPO / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / PACKAGE / module
    # Inside a function, where it hides from a reader but not from import-linter.
    target.write_text(target.read_text() + f"\n\ndef _added():\n    {added_import}\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    names = {contract_id: contract["name"] for contract_id, contract in contracts().items()}
    assert f"{names[broken]} BROKEN" in result.stdout, result.stdout
    assert f"{names[kept]} KEPT" in result.stdout, result.stdout
