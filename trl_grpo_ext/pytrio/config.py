"""Configuration of the PyTRIO GRPO loop (`recipes/gsm8k_pytrio.py`).

Keys shared with the TRL recipes are spelled, and mean, what they mean in `trl.GRPOConfig`. One mapping:
``per_device_train_batch_size`` counts the completions of one optimizer step (TRL's
``per_device_train_batch_size x gradient_accumulation_steps x processes``; there is no accumulation key here, the
service splits big batches itself), so a step trains on ``per_device_train_batch_size // num_generations``
prompts with ``num_generations`` completions each.

Credentials are never part of this config: the client reads them from pytrio's own places (``PYTRIO_API_KEY``,
``PYTRIO_BASE_URL``, the profile written by ``trio login``), so a saved config cannot leak a key.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from trl_grpo_ext.environments.data import environment_name_problems
from trl_grpo_ext.errors import raise_problems
from trl_grpo_ext.grpo.async_sampling import decoupled
from trl_grpo_ext.grpo.loss_table import LOSSES, PYTRIO, ratio_bounds
from trl_grpo_ext.grpo.sampling_distribution import SamplingSettings
from trl_grpo_ext.grpo.spec import GRPOSpec, normalize_values, number_problem, reward_option_problems, spec_problems
from trl_grpo_ext.models import EMBEDDED_NAME
from trl_grpo_ext.runs.tracking import (
    normalize_swanlab_mode,
    swanlab_mode_field,
    swanlab_mode_problems,
    swanlab_project_field,
)
from trl_grpo_ext.task.rewards import reward_index, reward_names
from trl_grpo_ext.task.spec import DataSpec


@dataclass
class PyTrioGRPOConfig(GRPOSpec, DataSpec):
    """The PyTRIO loop's options: the shared GRPO spec (`trl_grpo_ext.grpo.spec.GRPOSpec`, TRL's names) and data
    spec (`trl_grpo_ext.task.spec.DataSpec`: data, prompt and reward options, as the TRL recipe's) plus where the
    model lives, the optimizer and the run."""

    # --- where the model lives ---
    base_model: str = field(
        default=EMBEDDED_NAME,
        metadata={
            "help": "Base model id as the service knows it (e.g. a model from `ServiceClient().get_supported_models()`). "
            "With the local server: 'embedded' (offline SmolLM2-135M-Instruct), a hub id or a local path."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank, 4..64 (pytrio's range; TRL's ModelConfig name)."})
    pytrio_base_url: str | None = field(
        default=None,
        metadata={
            "help": "Service address. None: pytrio's own configuration (PYTRIO_BASE_URL, else the `trio login` "
            "profile, else https://pytrio.com). 'local': start the local pytrio server on 127.0.0.1 for this run."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Tokenizer for the chat template. None: the client's `TrainingClient.get_tokenizer()` (the base "
            "model's), falling back to the locally resolved model ('embedded' or a local path)."
        },
    )
    mode: str = field(
        default="sync",
        metadata={
            "help": "'sync': one sampling request at a time, each call awaited. 'async': all prompts of a step are "
            "submitted at once and forward_backward + optim_step are queued back to back."
        },
    )
    # --- GRPO: the shared fields are `GRPOSpec`'s; these are the PyTRIO path's own ---
    use_builtin_loss: bool = field(
        default=True,
        metadata={"help": "False: compute importance_sampling / ppo locally too (forward_backward_custom)."},
    )
    loss_aggregation: str = field(
        default="token_mean",
        metadata={
            "help": "'token_mean': loss averaged over the step's completion tokens (TRL's 'dapo' normalisation, as "
            "the TRL path); 'sum': Tinker's plain sum over tokens."
        },
    )
    per_device_train_batch_size: int = field(
        default=16,
        metadata={
            "help": "Completions per optimizer step (TRL: per_device_train_batch_size x gradient_accumulation_steps "
            "x processes; the service splits large batches itself). Prompts per step = this / num_generations."
        },
    )
    # --- optimizer (TRL spelling, sent as pytrio AdamParams) ---
    learning_rate: float = field(default=1e-5, metadata={"help": "Peak AdamW learning rate."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "'constant' or 'linear' decay to 0."})
    warmup_ratio: float = field(default=0.0, metadata={"help": "Fraction of max_steps with linear warm-up."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Global gradient clipping norm; 0 disables it."})
    # --- run ---
    seed: int = field(default=42, metadata={"help": "Seed of the data order, the LoRA init and the sampler."})
    max_steps: int = field(default=100, metadata={"help": "Optimizer steps to run (in total, across resumes)."})
    output_dir: str = field(default="outputs/gsm8k-pytrio", metadata={"help": "metrics.jsonl and loop state go here."})
    save_every: int = field(
        default=10, metadata={"help": "save_state every N steps (and at the end); 0 saves only at the end."}
    )
    resume: bool = field(
        default=False,
        metadata={"help": "Continue from the last save_state recorded in `output_dir` (step, data position)."},
    )
    report_to: str = field(default="none", metadata={"help": "'none' or 'swanlab'."})
    run_name: str | None = field(default=None, metadata={"help": "Run name for SwanLab."})
    swanlab_project: str = swanlab_project_field()
    swanlab_mode: str | None = swanlab_mode_field()
    environments: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Environments whose tools the model may call (multi-turn, as the TRL recipe's key): "
            "calculator, retrieval, or both (rows alternate). Empty: single-turn."
        },
    )
    max_tool_calling_iterations: int | None = field(
        default=None, metadata={"help": "Most tool rounds per rollout (TRL's name); None: no cap."}
    )
    request_timeout_s: float = field(
        default=1800.0, metadata={"help": "Longest wait for any one service call before the run stops with an error."}
    )
    server_retry_budget_s: float = field(
        default=600.0,
        metadata={
            "help": "How long the loop keeps retrying a service that stopped answering (refused or dropped "
            "connections, timeouts, 5xx) or restarted and forgot the run: it says so at once and logs each retry; "
            "once the service answers it reconnects and continues from the last saved state (as resume: true "
            "would); after this many seconds it stops with one error line. 0: stop at the first failure."
        },
    )

    def __post_init__(self):  # replaces DataSpec's: `validate` reports its problems with every other one
        self.validate()

    @property
    def prompts_per_step(self) -> int:
        return self.per_device_train_batch_size // self.num_generations

    @property
    def clip_bounds(self) -> tuple[float | None, float | None]:
        """Ratio bounds handed to `trl_grpo_ext.grpo.losses.policy_loss` (`trl_grpo_ext.grpo.loss_table.ratio_bounds`)."""
        return ratio_bounds(self)

    @property
    def rescores_behaviour(self) -> bool:
        """The sampler's own log-probs are of a tempered or truncated distribution, which the service's
        ``forward_backward`` does not score (it scores the model's softmax: the protocol). The behaviour log-probs
        are then the sampler's weights' log-probs of the completions at temperature 1 (``compute_logprobs``), so the
        loss's ratio compares like with like: the trained policy is the untempered one, the temperature and the
        truncation only shape which completions are drawn (`trl_grpo_ext.pytrio.sampling`)."""
        return not SamplingSettings.of(self).plain

    @property
    def uses_builtin_loss(self) -> bool:
        """The service's built-in loss runs (not under the decoupled objective: its behaviour weight needs the
        proximal log-probs the loss's own forward gives, `trl_grpo_ext.pytrio.loss`)."""
        return self.use_builtin_loss and LOSSES[self.loss_type].service_builtin and not decoupled(self)

    def reward_column(self, name: str) -> int:
        """Position in ``reward_funcs`` of the reward `name` names (its entry or function name; validated)."""
        return reward_index(name, reward_names(self.reward_funcs))

    def validate(self) -> None:
        """Raise one ValueError listing every bad value (the shared GRPO spec's and this path's own)."""
        normalize_values(self)
        normalize_swanlab_mode(self)
        problems = spec_problems(self, PYTRIO) + self.data_problems()  # data_problems: reward_funcs made a list
        problems += reward_option_problems(self, reward_names(self.reward_funcs))
        problems += self._run_problems()
        entries = [self.environments] if isinstance(self.environments, str) else list(self.environments or [])
        self.environments = [name.strip() for entry in entries for name in str(entry).split(",") if name.strip()]
        problems += environment_name_problems(self.environments)
        if self.environments and self.prompt_format == "text":
            problems.append("environments need chat prompts; prompt_format: text has none")
        if self.environments and self.async_sampling and self.max_staleness:
            problems.append("async_sampling does not sample multi-turn tool calls yet; unset environments or it")
        cap = self.max_tool_calling_iterations
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            problems.append(f"max_tool_calling_iterations must be an int >= 1 or null, got {cap!r}")
        raise_problems("PyTRIO GRPO config", problems)

    def _run_problems(self) -> list[str]:
        """This path's own rules: the service, the batch, the optimizer and logging options."""
        problems = []
        if self.beta != 0.0:
            problems.append(f"beta={self.beta!r}: a KL penalty is not supported on the PyTRIO path; set beta: 0.0")
        if self.loss_aggregation not in ("token_mean", "sum"):
            problems.append(f"loss_aggregation must be 'token_mean' or 'sum', got {self.loss_aggregation!r}")
        if self.mode not in ("sync", "async"):
            problems.append(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if not 4 <= self.lora_r <= 64:
            problems.append(f"lora_r must be in [4, 64] (pytrio's range), got {self.lora_r}")
        if (
            isinstance(self.num_generations, int)
            and self.num_generations >= 2
            and (
                self.per_device_train_batch_size < self.num_generations
                or self.per_device_train_batch_size % self.num_generations
            )
        ):
            problems.append(
                f"per_device_train_batch_size ({self.per_device_train_batch_size}, completions per step) must be a "
                f"positive multiple of num_generations ({self.num_generations})"
            )
        if self.curriculum and self.dataset_name != "synthetic":
            problems.append(f"curriculum needs rows with a task (dataset_name: synthetic), not {self.dataset_name!r}")
        problems += number_problem("learning_rate", self.learning_rate, lambda v: v >= 0, "a finite number >= 0")
        if self.lr_scheduler_type not in ("constant", "linear"):
            problems.append(f"lr_scheduler_type must be 'constant' or 'linear', got {self.lr_scheduler_type!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            problems.append("warmup_ratio must be in [0, 1)")
        if self.max_steps < 1:
            problems.append("max_steps must be >= 1")
        if self.save_every < 0:
            problems.append("save_every must be >= 0")
        if self.report_to not in ("none", "swanlab"):
            problems.append(f"report_to must be 'none' or 'swanlab', got {self.report_to!r}")
        problems += swanlab_mode_problems(self.swanlab_mode)
        if self.request_timeout_s <= 0:
            problems.append("request_timeout_s must be > 0")
        problems += number_problem(
            "server_retry_budget_s", self.server_retry_budget_s, lambda v: v >= 0, "a finite number >= 0 (seconds)"
        )
        return problems

    def learning_rate_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): transformers' constant / linear schedules."""
        warmup = math.ceil(self.warmup_ratio * self.max_steps)
        if step < warmup:
            return self.learning_rate * step / warmup
        if self.lr_scheduler_type == "constant":
            return self.learning_rate
        remaining = max(self.max_steps - warmup, 1)
        return self.learning_rate * max(0.0, (self.max_steps - step) / remaining)

    def to_dict(self) -> dict:
        return asdict(self)
