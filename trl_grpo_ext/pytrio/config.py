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

# loss_type values the service computes itself (`forward_backward(datums, loss_type)`); the others run locally.
SERVICE_BUILTIN_LOSS_TYPES = ("importance_sampling", "ppo")


@dataclass
class PyTrioGRPOConfig:
    # --- where the model lives ---
    base_model: str = field(
        default="embedded",
        metadata={
            "help": "Base model id as the service knows it (e.g. a model from `ServiceClient().get_supported_models()`). "
            "With the local server: 'embedded' (offline SmolLM2-135M-Instruct), a hub id or a local path."
        },
    )
    lora_rank: int = field(default=32, metadata={"help": "LoRA rank, 4..64 (pytrio's range)."})
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
    # --- data ---
    dataset_name: str = field(
        default="synthetic",
        metadata={
            "help": "'gsm8k' (`dataset_path` JSONL, else the hub's openai/gsm8k) or 'synthetic' (GSM8K-style "
            "reasoning-gym problems generated offline, tasks from `synthetic_tasks`)."
        },
    )
    dataset_path: str | None = field(
        default=None, metadata={"help": "Local GSM8K JSONL (question / answer rows) for dataset_name 'gsm8k'."}
    )
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_size: int | None = field(
        default=512,
        metadata={
            "help": "Problems to generate ('synthetic'; None: 1024), or the first N rows to keep ('gsm8k'; None: all)."
        },
    )
    synthetic_tasks: str = field(
        default="chain_sum,basic_arithmetic",
        metadata={"help": "Task mix for 'synthetic', e.g. 'chain_sum:2,gsm_symbolic:1'."},
    )
    one_shot: bool = field(default=True, metadata={"help": "Prepend the one-shot worked example to each prompt."})
    on_malformed: str = field(
        default="error",
        metadata={"help": "GSM8K rows without a question or a parseable answer: 'error' (name the row) or 'drop'."},
    )
    # --- GRPO (TRL spelling) ---
    loss_type: str = field(
        default="importance_sampling",
        metadata={
            "help": "'importance_sampling' and 'ppo' run as the service's built-in losses; 'cispo' and every other "
            "loss of `trl_grpo_ext.losses.LOSS_FUNCTIONS` run through `forward_backward_custom`."
        },
    )
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
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (the GRPO group size)."})
    per_device_train_batch_size: int = field(
        default=16,
        metadata={
            "help": "Completions per optimizer step (TRL: per_device_train_batch_size x gradient_accumulation_steps "
            "x processes; the service splits large batches itself). Prompts per step = this / num_generations."
        },
    )
    max_completion_length: int = field(default=256, metadata={"help": "Maximum generated tokens per completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 disables it (TRL's convention)."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; only 0.0 is supported on this path."})
    scale_rewards: str = field(
        default="group",
        metadata={"help": "'group' (std of the group, paper), 'batch' (std of the step) or 'none' (mean only)."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["boxed"],
        metadata={"help": "Reward function names from `trl_grpo_ext.rewards.REWARD_REGISTRY`."},
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per reward function; None weighs them all 1.0."}
    )
    degenerate_tol: float = field(
        default=1e-6, metadata={"help": "A group whose rewards span <= this is degenerate (no learning signal)."}
    )
    zero_degenerate_advantages: bool = field(
        default=True, metadata={"help": "Set the advantages of degenerate groups to exactly 0."}
    )
    degenerate_reward: str | None = field(
        default=None,
        metadata={"help": "Name of one reward function whose flatness within a group also marks it degenerate."},
    )
    # --- dynamic sampling and the curriculum (the TRL path's GRPOConfig fields; docs/recipes.md) ---
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's group filter: drop degenerate groups and sample more prompts until the step has "
            "prompts_per_step informative groups, or max_generation_batches is reached (then train on those)."
        },
    )
    max_generation_batches: int = field(
        default=4, metadata={"help": "With dynamic_sampling: sampling rounds one step may use, the first included."}
    )
    curriculum: bool = field(
        default=False,
        metadata={"help": "Synthetic task weights follow each task's running pass rate: share * (p (1 - p) + floor)."},
    )
    curriculum_ema: float = field(default=0.3, metadata={"help": "Weight of the newest batch in the pass rates."})
    curriculum_floor: float = field(default=0.05, metadata={"help": "Added to p (1 - p): no task's weight is 0."})
    curriculum_reward: str | None = field(
        default=None,
        metadata={"help": "The reward_funcs entry that decides a pass; None: degenerate_reward, else the total."},
    )
    curriculum_pass_threshold: float = field(
        default=1.0, metadata={"help": "A completion passes when that reward is >= this."}
    )
    epsilon: float = field(
        default=0.2, metadata={"help": "ppo: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]."}
    )
    epsilon_high: float | None = field(default=None, metadata={"help": "ppo: upper epsilon; None: `epsilon`."})
    cispo_clip_low: float | None = field(
        default=None, metadata={"help": "cispo: lower ratio bound; None: `trl_grpo_ext.losses.DEFAULT_CLIP`."}
    )
    cispo_clip_high: float | None = field(
        default=None, metadata={"help": "cispo: upper ratio bound; None: `trl_grpo_ext.losses.DEFAULT_CLIP`."}
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
    swanlab_project: str = field(default="trl-grpo-ext", metadata={"help": "SwanLab project."})
    swanlab_mode: str | None = field(
        default=None,
        metadata={
            "help": "SwanLab mode: 'cloud', 'local', 'offline' or 'disabled'; None: $SWANLAB_MODE or 'offline'."
        },
    )
    request_timeout_s: float = field(
        default=1800.0, metadata={"help": "Longest wait for any one service call before the run stops with an error."}
    )

    def __post_init__(self):
        self.validate()

    @property
    def prompts_per_step(self) -> int:
        return self.per_device_train_batch_size // self.num_generations

    @property
    def clip_bounds(self) -> tuple[float | None, float | None]:
        """Ratio bounds handed to `trl_grpo_ext.losses.policy_loss` (None: its defaults)."""
        if self.loss_type == "ppo":
            high = self.epsilon if self.epsilon_high is None else self.epsilon_high
            return 1.0 - self.epsilon, 1.0 + high
        if self.loss_type == "cispo":
            return self.cispo_clip_low, self.cispo_clip_high
        return None, None

    @property
    def uses_builtin_loss(self) -> bool:
        return self.use_builtin_loss and self.loss_type in SERVICE_BUILTIN_LOSS_TYPES

    def validate(self) -> None:
        from trl_grpo_ext.losses import LOSS_FUNCTIONS

        problems = []
        if self.loss_type not in LOSS_FUNCTIONS:
            problems.append(f"loss_type {self.loss_type!r} is not one of {sorted(LOSS_FUNCTIONS)}")
        if self.loss_aggregation not in ("token_mean", "sum"):
            problems.append(f"loss_aggregation must be 'token_mean' or 'sum', got {self.loss_aggregation!r}")
        if self.mode not in ("sync", "async"):
            problems.append(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if not 4 <= self.lora_rank <= 64:
            problems.append(f"lora_rank must be in [4, 64] (pytrio's range), got {self.lora_rank}")
        if self.num_generations < 2:
            problems.append(f"num_generations must be >= 2 for group advantages, got {self.num_generations}")
        elif self.per_device_train_batch_size < self.num_generations or (
            self.per_device_train_batch_size % self.num_generations
        ):
            problems.append(
                f"per_device_train_batch_size ({self.per_device_train_batch_size}, completions per step) must be a "
                f"positive multiple of num_generations ({self.num_generations})"
            )
        if self.max_completion_length < 1:
            problems.append("max_completion_length must be >= 1")
        if self.temperature <= 0:
            problems.append("temperature must be > 0")
        if self.beta != 0.0:
            problems.append("beta (KL penalty) is not supported on the PyTRIO path; set beta: 0.0")
        if str(self.scale_rewards) not in ("group", "batch", "none"):
            problems.append(f"scale_rewards must be 'group', 'batch' or 'none', got {self.scale_rewards!r}")
        if isinstance(self.reward_funcs, str):
            self.reward_funcs = [self.reward_funcs]
        if not self.reward_funcs:
            problems.append("reward_funcs is empty")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            problems.append(
                f"reward_weights has {len(self.reward_weights)} entries for {len(self.reward_funcs)} reward_funcs"
            )
        if self.degenerate_reward is not None and self.degenerate_reward not in self.reward_funcs:
            problems.append(f"degenerate_reward {self.degenerate_reward!r} is not in reward_funcs")
        if self.degenerate_tol < 0:
            problems.append("degenerate_tol must be >= 0")
        problems += self._sampling_problems()
        if self.learning_rate < 0:
            problems.append("learning_rate must be >= 0")
        if self.lr_scheduler_type not in ("constant", "linear"):
            problems.append(f"lr_scheduler_type must be 'constant' or 'linear', got {self.lr_scheduler_type!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            problems.append("warmup_ratio must be in [0, 1)")
        if self.max_steps < 1:
            problems.append("max_steps must be >= 1")
        if self.save_every < 0:
            problems.append("save_every must be >= 0")
        if self.dataset_name not in ("gsm8k", "synthetic"):
            problems.append(f"dataset_name must be 'gsm8k' or 'synthetic', got {self.dataset_name!r}")
        if self.dataset_size is not None and self.dataset_size < 1:
            problems.append(f"dataset_size must be >= 1 or None, got {self.dataset_size}")
        if self.on_malformed not in ("error", "drop"):
            problems.append(f"on_malformed must be 'error' or 'drop', got {self.on_malformed!r}")
        if self.report_to not in ("none", "swanlab"):
            problems.append(f"report_to must be 'none' or 'swanlab', got {self.report_to!r}")
        if self.request_timeout_s <= 0:
            problems.append("request_timeout_s must be > 0")
        if problems:
            raise ValueError("invalid PyTRIO GRPO config: " + "; ".join(problems))

    def _sampling_problems(self) -> list[str]:
        from trl_grpo_ext.data.curriculum import check_curriculum_settings

        problems = []
        batches = self.max_generation_batches
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            problems.append(f"max_generation_batches must be an integer >= 1, got {batches!r}")
        try:
            check_curriculum_settings(self.curriculum_ema, self.curriculum_floor, 0.5)
        except ValueError as error:
            problems.append(str(error))
        if not math.isfinite(self.curriculum_pass_threshold):
            problems.append("curriculum_pass_threshold must be finite")
        if self.curriculum_reward is not None and self.curriculum_reward not in self.reward_funcs:
            problems.append(f"curriculum_reward {self.curriculum_reward!r} is not in reward_funcs")
        if self.curriculum and self.dataset_name != "synthetic":
            problems.append(f"curriculum needs rows with a task (dataset_name: synthetic), not {self.dataset_name!r}")
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
