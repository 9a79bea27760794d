"""`trl_grpo_ext.trl.internals` against the installed TRL: the copied functions' sources, the private state, the hooks.

A TRL upgrade fails here and says what to re-check: each copy whose TRL function's source changed (or was never
checked under the installed TRL version), each private attribute or hook that TRL renamed.
"""

import hashlib
import importlib
import inspect
import re
from pathlib import Path

import pytest
import trl

from trl_grpo_ext.trl import internals
from trl_grpo_ext.trl.internals import MIRRORS, OVERRIDDEN_HOOKS, PRIVATE_STATE, VLLM_ONLY_STATE, Mirror

ROOT = Path(__file__).resolve().parents[1]


def resolve(dotted: str):
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def source_hash(obj) -> str:
    """The hash `internals.mirrors` records: SHA-256 of the source with every run of whitespace made one space."""
    return hashlib.sha256(" ".join(inspect.getsource(obj).split()).encode()).hexdigest()[:16]


def mirror_problems(mirrors, version: str) -> list[str]:
    """One line per copy to re-check under TRL `version`, naming the TRL function, our copy and the hash to record."""
    problems = []
    for mirror in mirrors:
        resolve(mirror.ours)  # the copy is where the registry says
        installed = source_hash(resolve(mirror.trl))
        part = f" ({mirror.part})" if mirror.part else ""
        recorded = mirror.source_hashes.get(version)
        if recorded is None:
            checked = ", ".join(sorted(mirror.source_hashes)) or "no version"
            problems.append(
                f"TRL {version} is installed; {mirror.ours} copies {mirror.trl}{part} as of TRL {checked}: re-check "
                f"the copy against TRL {version} and record '{version}': '{installed}'"
            )
        elif recorded != installed:
            problems.append(
                f"{mirror.trl} changed in TRL {version} (source hash {installed}, the copy was checked against "
                f"{recorded}): re-check {mirror.ours}{part} and record '{version}': '{installed}'"
            )
    return problems


def test_every_copy_was_checked_against_the_installed_trl_source():
    problems = mirror_problems(MIRRORS, trl.__version__)
    assert not problems, "\n".join(problems)


def test_the_check_names_the_trl_function_and_the_copy_when_the_source_differs():
    trl_function = "trl.trainer.grpo_trainer.GRPOTrainer._compute_loss"
    ours = "trl_grpo_ext.trl.internals.compute_loss"
    current = source_hash(resolve(trl_function))
    assert mirror_problems([Mirror(trl_function, ours, {"1.16.0": current})], "1.16.0") == []
    changed = mirror_problems([Mirror(trl_function, ours, {"1.16.0": "0" * 16})], "1.16.0")
    assert len(changed) == 1 and trl_function in changed[0] and f"re-check {ours}" in changed[0]
    assert current in changed[0]  # the hash to record after re-checking
    unknown = mirror_problems([Mirror(trl_function, ours, {"1.16.0": current})], "1.17.0")
    assert len(unknown) == 1 and "TRL 1.17.0 is installed" in unknown[0] and ours in unknown[0]
    with pytest.raises(AttributeError):
        mirror_problems([Mirror(trl_function, "trl_grpo_ext.trl.internals.no_such_copy", {})], "1.16.0")


def test_every_trl_version_the_cells_pin_has_a_hash_for_every_copy():
    """The test cells install TRL from pyproject's range or a pin (constraints/*.txt); a pinned version must have been
    checked, so that cell cannot pass without re-checking the copies."""
    pins = {
        match
        for path in (ROOT / "constraints").glob("*.txt")
        for match in re.findall(r"^trl==([\w.]+)\s*$", path.read_text(), flags=re.M)
    }
    pins.add(trl.__version__)
    missing = [f"{m.ours}: TRL {v}" for m in MIRRORS for v in sorted(pins) if v not in m.source_hashes]
    assert not missing, missing


def test_copies_are_marked_where_they_are():
    """Every ``@mirrors`` copy lives in internals; the registry lists the other copies by name."""
    here = {m.ours for m in MIRRORS if m.ours.startswith("trl_grpo_ext.trl.internals.")}
    assert {"compute_loss", "entropy_bonus", "prepare_train_inputs", "generate_single_turn"} <= {
        name.rsplit(".", 1)[1] for name in here
    }
    assert {m.ours for m in internals.MIRRORED_ELSEWHERE}.isdisjoint(here)


def test_trl_private_state_is_touched_only_in_internals():
    """No module of the TRL path but internals names TRL's private members (overridden hooks aside)."""
    names = "|".join(re.escape(name) for name in PRIVATE_STATE)
    pattern = re.compile(rf"(\.|getattr\([^,]+,\s*[\"'])({names})\b")
    offenders = []
    trl_path = ROOT / "trl_grpo_ext" / "trl"
    for path in sorted(trl_path.rglob("*.py")):
        if path.relative_to(trl_path).parts[0] == "internals":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def _our_classes():
    from trl_grpo_ext.trl.trainer import GRPOTrainer

    return [cls for cls in GRPOTrainer.__mro__ if cls.__module__.startswith("trl_grpo_ext.")]


def test_overridden_hooks_exist_in_trl_with_our_parameters():
    overridden = {}
    for cls in _our_classes():
        for name, value in vars(cls).items():
            if (
                callable(value)
                and name.startswith("_")
                and not name.startswith("__")
                and hasattr(trl.GRPOTrainer, name)
            ):
                overridden.setdefault(name, []).append(cls)
    assert sorted(overridden) == sorted(OVERRIDDEN_HOOKS), (
        "internals.OVERRIDDEN_HOOKS must list every hook we override"
    )
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for name, classes in overridden.items():
        theirs = list(inspect.signature(getattr(trl.GRPOTrainer, name)).parameters)
        for cls in classes:
            parameters = inspect.signature(vars(cls)[name]).parameters.values()
            ours = [p.name for p in parameters if p.kind not in variadic]
            forwards_the_rest = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)
            # our named parameters are TRL's first ones, and the rest, if any, reach TRL through **kwargs
            expected = theirs[: len(ours)] if forwards_the_rest else theirs
            assert ours == expected, f"{cls.__name__}.{name}{ours} overrides TRL's {name}{theirs}"


@pytest.mark.slow
def test_a_built_trainer_has_the_private_state_internals_reads(tiny_model_path, tmp_path):
    from datasets import Dataset

    from trl_grpo_ext.trl.config import GRPOConfig
    from trl_grpo_ext.trl.trainer import GRPOTrainer

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=2, num_generations=2
    )
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1 + 1?"}]] * 2})
    trainer = GRPOTrainer(tiny_model_path, [reward], args=args, train_dataset=data)
    missing = [name for name in PRIVATE_STATE if name not in VLLM_ONLY_STATE and not hasattr(trainer, name)]
    # the vLLM-only members TRL sets when it builds its vLLM generation
    missing += [name for name in VLLM_ONLY_STATE if f"self.{name} =" not in inspect.getsource(trl.GRPOTrainer)]
    assert not missing, (
        f"TRL no longer has {missing}: re-check their accessors in trl_grpo_ext/trl/internals/private_state.py"
    )
    assert internals.pad_token_id(trainer) == trainer.processing_class.pad_token_id
    assert internals.buffered_inputs(trainer) == [] and internals.is_vlm(trainer) is False
    assert isinstance(trainer.mixin_state, internals.MixinState)
