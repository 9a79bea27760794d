"""The PyTRIO loop's vocabulary: what each phase of a step hands the next.

sample -> `Rollout` (one per completion) -> score -> `ScoredBatch` -> build batch -> `TrainBatch` (datums and the
local loss's `TokenRows`) -> step -> log (`StepTimes` with the metrics). Plain data, no service and no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rollout:
    """One sampled completion of one prompt, as the sampler returned it."""

    prompt_tokens: tuple[int, ...]
    completion_tokens: tuple[int, ...]
    completion_logprobs: tuple[float, ...]
    stop_reason: str = ""
    # multi-turn (tools): 0 on the tokens tools wrote (their log-probs are 0.0), and the turns as TRL's messages
    tool_mask: tuple[int, ...] | None = None
    messages: tuple | None = None

    @property
    def model_tokens(self) -> int:
        """The completion tokens the model sampled (a multi-turn completion's tool tokens left out, TRL's count)."""
        return len(self.completion_tokens) if self.tool_mask is None else sum(self.tool_mask)


@dataclass
class ScoredBatch:
    """One step's sampled and scored completions, prompt-major: ``num_generations`` consecutive rollouts per row."""

    rows: list[dict]
    rollouts: list[Rollout]
    rewards_per_func: object  # torch (N, K), None -> NaN
    rewards: object  # torch (N,), `trl_grpo_ext.grpo.reward_aggregation.weighted_rewards`
    advantages: list[float]
    degenerate: list[bool]  # per prompt group
    logged: dict = field(default_factory=dict)  # what the reward functions sent to ``log_metric``
    # on-policy distillation: one advantage per completion token of each rollout (`teacher.Teacher.distill`)
    token_advantages: list[list[float]] | None = None
    # asynchronous sampling: per rollout, how many optimizer steps older than the trained weights those that drew it
    staleness: list[int] | None = None


@dataclass
class TokenRows:
    """Per-datum, per-position inputs of the local loss: sampler logprobs, advantages, completion mask."""

    old_logprobs: list[list[float]] = field(default_factory=list)
    advantages: list[list[float]] = field(default_factory=list)
    masks: list[list[float]] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # per datum (0 on-policy)

    def add(self, seq: dict, staleness: int = 0) -> None:
        self.old_logprobs.append(seq["logprobs"])
        self.advantages.append(seq["advantages"])
        self.masks.append(seq["mask"])
        self.staleness.append(staleness)

    @property
    def completion_tokens(self) -> int:
        return int(sum(sum(m) for m in self.masks))


@dataclass
class TrainBatch:
    """What one step trains on: a datum per non-empty completion, the local loss's token rows."""

    datums: list
    token_rows: TokenRows
    train_tokens: int  # completion tokens with non-zero advantage (the TRL path's `train_tokens`)


@dataclass
class StepTimes:
    """Wall-clock seconds of one step's phases (the bench prints these)."""

    save_weights: float = 0.0
    sampling: float = 0.0
    rewards: float = 0.0
    forward_backward: float = 0.0
    optim_step: float = 0.0

    def as_metrics(self) -> dict:
        return {f"time/{k}": v for k, v in vars(self).items()}
