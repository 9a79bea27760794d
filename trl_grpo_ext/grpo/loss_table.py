"""The one table of loss names: which execution path takes each, who computes it, and where its ratio bounds come
from. The TRL config, the trainer, `trl_grpo_ext.grpo.losses`, the PyTRIO config and loop and the local PyTRIO server all
read it; no other module lists loss names. A name TRL gives another loss (`trl_meaning`: our two-sided ``cispo``) gets
a startup notice on both paths (`print_loss_type_notice`).

Imports neither torch nor TRL, so configs validate and the server parses requests without loading either.
"""

from __future__ import annotations

from dataclasses import dataclass

TRL = "trl"  # the TRL trainer subclass (`trl_grpo_ext.trl.trainer`, `GRPOConfig`)
PYTRIO = "pytrio"  # the PyTRIO loop (`trl_grpo_ext.pytrio.loop`, `PyTrioGRPOConfig`)
PATHS = (TRL, PYTRIO)

# Where a loss takes its importance-ratio bounds from (`ratio_bounds`).
EPSILON = "epsilon"  # [1 - epsilon, 1 + epsilon_high] (epsilon_high None: epsilon), TRL's PPO-style clipping
CISPO_CLIP = "cispo_clip"  # [cispo_clip_low, cispo_clip_high], ratio bounds themselves (not epsilons)
EPSILON_HIGH_CAP = "epsilon_high_cap"  # TRL's one-sided cispo: ratio capped at epsilon_high, no lower bound

# Tinker's `loss_fn_config` keys for the ratio bounds, as the PyTRIO service takes them.
WIRE_CLIP_LOW = "clip_low_threshold"
WIRE_CLIP_HIGH = "clip_high_threshold"
WIRE_CLIP_KEYS = (WIRE_CLIP_LOW, WIRE_CLIP_HIGH)


@dataclass(frozen=True)
class LossType:
    """One `loss_type` value.

    ``trl_name``: on the TRL path, the TRL 1.16 loss type it hands to TRL unchanged (``None``: computed per token by
    `trl_grpo_ext.grpo.losses`). ``paths``: the execution paths that accept it. ``service_builtin``: the PyTRIO loop
    sends it to the service's ``forward_backward(datums, name)`` (the hosted service has it built in); the others
    run there through ``forward_backward_custom``. ``server_config``: the ``loss_fn_config`` keys the local PyTRIO
    server takes for it as a built-in loss (``None``: not a server built-in). ``default_clip``: ratio bounds
    `trl_grpo_ext.grpo.losses` uses when none are given.
    """

    name: str
    help: str
    paths: tuple[str, ...]
    trl_name: str | None = None
    bounds: str | None = None
    default_clip: tuple[float, float] | None = None
    service_builtin: bool = False
    server_config: tuple[str, ...] | None = None

    @property
    def local(self) -> bool:
        """Per-token math in `trl_grpo_ext.grpo.losses` (every loss the TRL path does not hand to TRL)."""
        return self.trl_name is None


def _trl(name: str, help: str, bounds: str | None = EPSILON, trl_name: str | None = None) -> LossType:
    return LossType(name, help, (TRL,), trl_name=trl_name or name, bounds=bounds)


LOSS_TYPES: tuple[LossType, ...] = (
    # TRL 1.16's own losses, run unchanged in TRL's code (TRL_LOSS_TYPES keeps TRL's order).
    _trl("grpo", ""),
    _trl("dr_grpo", ""),
    _trl("dapo", "the TRL path's default"),
    _trl("bnpo", ""),
    # `cispo` is the two-sided CISPO below; TRL's own (one-sided, capped at epsilon_high) keeps this name.
    _trl(
        "trl_cispo",
        "its one-sided cispo: the ratio capped at epsilon_high, which must then be set",
        bounds=EPSILON_HIGH_CAP,
        trl_name="cispo",
    ),
    _trl("sapo", "", bounds=None),
    _trl("luspo", ""),
    _trl("vespo", "", bounds=None),
    # Computed by `trl_grpo_ext.grpo.losses` on both paths (normalised like dapo on the TRL path).
    LossType(
        "importance_sampling",
        "-r * A, no clipping; the PyTRIO path's default",
        (TRL, PYTRIO),
        service_builtin=True,
        server_config=(),
    ),
    LossType(
        "ppo",
        "Tinker's name for -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A), per token TRL's dapo",
        (TRL, PYTRIO),
        bounds=EPSILON,
        default_clip=(0.8, 1.2),  # Tinker's ppo: epsilon fixed to 0.2
        service_builtin=True,
        server_config=WIRE_CLIP_KEYS,
    ),
    LossType(
        "cispo",
        "two-sided CISPO, -sg(clip(r, cispo_clip_low, cispo_clip_high)) * A * logp",
        (TRL, PYTRIO),
        bounds=CISPO_CLIP,
        default_clip=(0.0, 4.0),  # Tinker's default; MiniMax-M1's single upper cap
        server_config=WIRE_CLIP_KEYS,
    ),
    LossType("cross_entropy", "-logp * w, the weights passed as advantages", (PYTRIO,), server_config=()),
    LossType("dro", "-(logp * A - beta / 2 * (logp - logp_old)^2), beta 0.05", (PYTRIO,), server_config=("beta",)),
)
LOSSES: dict[str, LossType] = {loss.name: loss for loss in LOSS_TYPES}

# Derived views, for the modules that ask one question of the table.
TRL_LOSS_TYPES = tuple(loss.trl_name for loss in LOSS_TYPES if loss.trl_name is not None)  # TRL 1.16's names
LOCAL_LOSS_TYPES = tuple(loss.name for loss in LOSS_TYPES if loss.local)  # `trl_grpo_ext.grpo.losses` computes these
DEFAULT_CLIP: dict[str, tuple[float, float]] = {x.name: x.default_clip for x in LOSS_TYPES if x.default_clip}
SERVER_LOSS_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    loss.name: loss.server_config for loss in LOSS_TYPES if loss.server_config is not None
}
# Tinker's `loss_fn_config={"beta": 0.05}` for `dro`.
DEFAULT_DRO_BETA = 0.05


def valid_loss_types(path: str) -> tuple[str, ...]:
    """The `loss_type` values execution path `path` (`TRL` or `PYTRIO`) accepts, in table order."""
    return tuple(loss.name for loss in LOSS_TYPES if path in loss.paths)


def trl_loss_type(loss_type: str) -> str | None:
    """The TRL loss type `loss_type` delegates to on the TRL path, or ``None`` when `trl_grpo_ext.grpo.losses` computes it."""
    return LOSSES[loss_type].trl_name if loss_type in LOSSES else loss_type


def loss_type_of_trl_name(trl_name: str) -> str:
    """Our name of TRL 1.16's loss type `trl_name` (TRL's ``cispo`` is our ``trl_cispo``)."""
    for loss in LOSS_TYPES:
        if loss.trl_name == trl_name:
            return loss.name
    return trl_name


def ratio_bounds(config, loss_type: str | None = None) -> tuple[float | None, float | None]:
    """(low, high) bounds of the importance ratio ``r`` that `loss_type` (default: ``config.loss_type``) clips to.

    The one translation of the options (``epsilon`` / ``epsilon_high``, ``cispo_clip_low`` / ``cispo_clip_high``)
    into ratio bounds, for `trl_grpo_ext.grpo.losses` (``clip_low`` / ``clip_high``), the trainer's ratio metrics and
    the PyTRIO service's ``loss_fn_config`` (`wire_loss_config`). `config` is either path's config (a plain
    `trl.GRPOConfig` too). ``None`` is an open side.
    """
    loss_type = config.loss_type if loss_type is None else loss_type
    kind = LOSSES[loss_type].bounds if loss_type in LOSSES else None
    epsilon = config.epsilon
    high_epsilon = epsilon if config.epsilon_high is None else config.epsilon_high
    if kind == EPSILON:
        return 1.0 - epsilon, 1.0 + high_epsilon
    if kind == CISPO_CLIP:
        return getattr(config, "cispo_clip_low", None), getattr(config, "cispo_clip_high", None)
    if kind == EPSILON_HIGH_CAP:
        return None, high_epsilon
    return None, None


def trl_meaning(loss_type: str) -> LossType | None:
    """The loss TRL 1.16 means by the name `loss_type` under `trl.GRPOConfig` when this package's `loss_type` is another
    one (our ``cispo`` is two-sided; TRL's one-sided ``cispo`` is our ``trl_cispo``), else ``None``."""
    loss = LOSSES.get(loss_type)
    if loss is None or loss.trl_name == loss_type:
        return None
    return next((other for other in LOSS_TYPES if other.trl_name == loss_type), None)


def loss_type_notice(config) -> str | None:
    """The startup line of a ``loss_type`` whose name TRL gives another loss (`trl_meaning`): which loss this package
    runs, with its ratio bounds, and the name TRL's loss goes by here. ``None`` for every other loss type."""
    theirs = trl_meaning(config.loss_type)
    if theirs is None:
        return None
    ours = LOSSES[config.loss_type]
    low, high = ratio_bounds(config)
    return (
        f"loss_type {ours.name}: this package's {ours.help} (ratio bounds [{low}, {high}]). Under trl.GRPOConfig, "
        f"'{ours.name}' is TRL's {theirs.help.removeprefix('its ')}; here that one is loss_type {theirs.name} "
        f"(TRL path only)."
    )


def print_loss_type_notice(config) -> None:
    """Print `loss_type_notice` at a run's start (the TRL recipe, the PyTRIO loop), when there is one."""
    notice = loss_type_notice(config)
    if notice is not None:
        print(notice, flush=True)


def wire_loss_config(loss_type: str, clip_low: float | None, clip_high: float | None) -> dict | None:
    """The service's ``loss_fn_config`` for built-in `loss_type` with these ratio bounds (Tinker's key names), or
    ``None`` for a loss that takes no bounds."""
    if not set(WIRE_CLIP_KEYS) <= set(LOSSES[loss_type].server_config or ()):
        return None
    return {WIRE_CLIP_LOW: clip_low, WIRE_CLIP_HIGH: clip_high}


def loss_type_help() -> str:
    """Help text of the `loss_type` option, for both paths, from the table."""

    def listed(losses) -> str:
        return ", ".join(f"'{loss.name}'" + (f" ({loss.help})" if loss.help else "") for loss in losses)

    both = [loss for loss in LOSS_TYPES if set(loss.paths) == set(PATHS)]
    trl_only = [loss for loss in LOSS_TYPES if loss.paths == (TRL,)]
    pytrio_only = [loss for loss in LOSS_TYPES if loss.paths == (PYTRIO,)]
    builtin = " and ".join(f"'{loss.name}'" for loss in LOSS_TYPES if loss.service_builtin)
    return (
        f"Loss formulation (docs/losses.md; r is the importance ratio). Both paths: {listed(both)}. "
        f"TRL path also: TRL's {listed(trl_only)}, run unchanged in TRL's code; the losses computed here are normalised "
        f"like 'dapo'. PyTRIO path also: {listed(pytrio_only)}; {builtin} run as the service's built-in losses "
        "(use_builtin_loss), the others through forward_backward_custom."
    )
