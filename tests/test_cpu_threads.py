"""CPU thread defaults (trl_grpo_ext/cpu_threads.py): a short OpenMP spin (GOMP_SPINCOUNT) unless the user chose
how OpenMP threads wait, set before torch loads in the recipes and the console script. bench/cpu_threads.py measures
why."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_grpo_ext.cpu_threads import DEFAULTS, USER_SETTINGS, apply_cpu_thread_defaults

ROOT = Path(__file__).resolve().parents[1]

# Records the OpenMP wait settings at the moment torch is first imported, then runs `code`.
_AT_TORCH_IMPORT = """
import os, sys
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "seen" not in globals():
            globals()["seen"] = sorted((k, os.environ[k]) for k in {names!r} if k in os.environ)
        return None
sys.meta_path.insert(0, Hook())
{code}
print("policy at torch import:", globals().get("seen"))
"""


def test_defaults_apply_when_the_user_set_none():
    env = {"OMP_NUM_THREADS": "3"}
    assert DEFAULTS == {"GOMP_SPINCOUNT": "10000"}  # what bench/cpu_threads.py measured (docs/recipes.md#cpu-threads)
    assert apply_cpu_thread_defaults(env) == DEFAULTS
    assert env == {"OMP_NUM_THREADS": "3", **DEFAULTS}  # the thread count is the user's


@pytest.mark.parametrize("name", USER_SETTINGS)
def test_a_user_setting_is_kept(name):
    value = "ACTIVE" if name == "OMP_WAIT_POLICY" else "1000"
    env = {name: value}
    assert apply_cpu_thread_defaults(env) == {}
    assert env == {name: value}


def _run(code):
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    proc = subprocess.run(
        [sys.executable, "-c", _AT_TORCH_IMPORT.format(code=code, names=USER_SETTINGS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


AT_IMPORT = f"policy at torch import: {sorted(DEFAULTS.items())}"


def test_the_trl_recipe_sets_the_defaults_before_torch_loads():
    out = _run("sys.path.insert(0, 'recipes'); import gsm8k_grpo")
    assert AT_IMPORT in out


def test_the_pytrio_recipe_sets_it_for_the_server_it_starts():
    out = _run("sys.path.insert(0, 'recipes'); import gsm8k_pytrio; import torch; print(os.environ['GOMP_SPINCOUNT'])")
    assert DEFAULTS["GOMP_SPINCOUNT"] in out.splitlines()


def test_the_console_script_sets_the_defaults():
    code = "from trl_grpo_ext.cli import main\ntry:\n    main(['eval', '--help'])\nexcept SystemExit:\n    pass\nimport torch"
    assert AT_IMPORT in _run(code)
