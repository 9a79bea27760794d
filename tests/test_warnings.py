"""Deprecations show: the package's own code raises none, and only the named dependency warnings it cannot avoid
(`trl_grpo_ext.compat.DEPENDENCY_WARNINGS`) are ignored, by the entry points and by pytest alike."""

import tomllib
import warnings
from pathlib import Path

import pytest

from trl_grpo_ext.compat import (
    DEPENDENCY_WARNINGS,
    checkpointing_disabled,
    ignore_dependency_warnings,
    resolve_checkpointing_fields,
)

REPO = Path(__file__).resolve().parents[1]


def test_pytest_ignores_exactly_the_named_dependency_warnings():
    pytest_options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert sorted(pytest_options["filterwarnings"]) == sorted(
        f"ignore:{message}:{category.__name__}" for category, message in DEPENDENCY_WARNINGS
    )


def test_ignore_dependency_warnings_ignores_only_those():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ignore_dependency_warnings()
        for category, message in (
            (FutureWarning, "`is_gradient_checkpointing` is deprecated and will be removed in v6."),
            (FutureWarning, "`gradient_checkpointing_disable` is deprecated and will be removed in v6."),
            (FutureWarning, "`something_else` is deprecated"),
            (DeprecationWarning, "`is_gradient_checkpointing` is deprecated"),  # another category
        ):
            warnings.warn(message, category, stacklevel=1)
    assert [(w.category, str(w.message)) for w in caught] == [
        (FutureWarning, "`something_else` is deprecated"),
        (DeprecationWarning, "`is_gradient_checkpointing` is deprecated"),
    ]


def test_our_config_sets_checkpointing_without_a_deprecation(tmp_path):
    from trl_grpo_ext.trl.config import GRPOConfig

    for value in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any FutureWarning / DeprecationWarning fails here
            config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=value)
        assert config.gradient_checkpointing is value
        if hasattr(config, "activation_checkpointing"):
            assert config.activation_checkpointing is value
    # TRL's default (on) is kept
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).gradient_checkpointing is True


def test_resolve_checkpointing_fields_keeps_a_value_set_under_the_newer_name():
    class Args:
        gradient_checkpointing = True
        gradient_checkpointing_kwargs = {"use_reentrant": False}
        activation_checkpointing = False
        activation_checkpointing_kwargs = None

    args = Args()
    resolve_checkpointing_fields(args)
    assert args.activation_checkpointing is False  # set: kept
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}  # unset: the older name's value


@pytest.mark.parametrize("enabled", [True, False])
def test_checkpointing_disabled_restores_the_state_without_a_deprecation(tiny_model_path, enabled):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    if enabled:
        model.train()
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    state = model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing") else enabled
    assert state is enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with checkpointing_disabled(model, {"use_reentrant": False}):
            layers_on = [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]
            assert layers_on and not any(layers_on)
        layers_on = [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    assert all(layers_on) if enabled else not any(layers_on)
