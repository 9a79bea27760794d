"""GRPO experiments on Hugging Face TRL: rewards, losses, recipes and a PyTRIO execution path.

Heavy modules (trl, transformers) are imported lazily, so `from trl_grpo_ext import boxed_reward`
stays cheap in reward workers and in the PyTRIO loop.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "boxed_reward": "trl_grpo_ext.task.rewards",
    "format_reward": "trl_grpo_ext.task.rewards",
    "make_hybrid_reward": "trl_grpo_ext.task.rewards",
    "get_reward_funcs": "trl_grpo_ext.task.rewards",
    "REWARD_REGISTRY": "trl_grpo_ext.task.rewards",
    "make_judge_reward": "trl_grpo_ext.task.rewards",
    "reward_functions": "trl_grpo_ext.task.rewards",
    "GRPOConfig": "trl_grpo_ext.trl.config",
    "GRPOTrainer": "trl_grpo_ext.trl.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trl_grpo_ext' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
