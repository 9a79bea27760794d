"""Verifiable math rewards for TRL's `GRPOTrainer` (`f(completions, **kwargs) -> list[float | None]`).

Registry names: `boxed`, `format`, `format_think`, `format_partial`, `hybrid` (see `docs/rewards.md`).
"""

from .accuracy import boxed_reward
from .format import format_checks, format_reward, make_format_reward
from .hybrid import DEFAULT_HYBRID_COMPONENTS, hybrid_reward, make_hybrid_reward
from .registry import REWARD_REGISTRY, get_reward, get_reward_funcs, register_reward, reward_functions, reward_names
from .vetoes import DEFAULT_VETOES, VETOES, has_repetition_loop

__all__ = [
    "DEFAULT_HYBRID_COMPONENTS",
    "DEFAULT_VETOES",
    "REWARD_REGISTRY",
    "VETOES",
    "boxed_reward",
    "format_checks",
    "format_reward",
    "get_reward",
    "get_reward_funcs",
    "has_repetition_loop",
    "hybrid_reward",
    "make_format_reward",
    "make_hybrid_reward",
    "register_reward",
    "reward_functions",
    "reward_names",
]
