"""TRL-trainer mixins for what a step samples: dynamic sampling (DAPO's group filter) and the adaptive curriculum.

Both sit between `trl_grpo_ext.trl.trainer.GRPOTrainer` and `trl.GRPOTrainer` in the MRO. Dynamic sampling overrides
``_prepare_inputs``, the curriculum ``_get_train_sampler``, ``_calculate_rewards`` (which the trainer overrides too:
its override runs first and calls this one through ``super()``) and the checkpoint hooks. They read what the trainer
resolves and computes through ``mixin_state`` (`trl_grpo_ext.trl.internals.MixinState`), and TRL's private state
through `trl_grpo_ext.trl.internals`. The decisions live in `trl_grpo_ext.grpo.dynamic_sampling` and
`trl_grpo_ext.grpo.curriculum`, which the PyTRIO loop uses too.

Dynamic sampling, TRL path. When TRL would generate (every ``steps_per_generation * num_iterations`` micro-steps)
the mixin generates and scores the dataloader's generation batch, reads the degenerate mask our trainer computed
over the gathered batch, and keeps generating batches from a second prompt stream (the training set in another
seeded order; with the curriculum, drawn by its weights) until `GroupFilter` is satisfied. Each process keeps only
groups it generated, so no tensors cross processes; every process takes the same decision from the gathered
mask, so every process generates the same number of batches. The kept groups are concatenated (prompts re-padded
on the left, completions on the right) into a generation batch of TRL's usual shape, which TRL's own
``_prepare_inputs`` logic (`trl_grpo_ext.trl.internals.prepare_train_inputs`) then shuffles, splits over
``steps_per_generation`` and reuses for ``num_iterations``.
When ``max_generation_batches`` runs out first, the missing groups are filled with degenerate ones whose
completion mask is zeroed: they keep the batch shape but add no loss, no gradient and no token to the ``dapo``
normaliser (``num_items_in_batch`` is recounted). Advantages are the ones TRL computed in each group's own
generation batch (identical for ``scale_rewards`` 'group' / 'none'; with 'batch' the std is that batch's).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from trl.trainer.utils import RepeatSampler

from trl_grpo_ext.grpo.curriculum import Curriculum, TaskPools, curriculum_from_tasks, draw_tasks, passed_values
from trl_grpo_ext.grpo.dynamic_sampling import GroupFilter, GroupRef
from trl_grpo_ext.grpo.reward_aggregation import weighted_rewards
from trl_grpo_ext.runs import CURRICULUM_STATE_FILENAME, atomic_write_json, checkpoint_dir
from trl_grpo_ext.trl import internals
from trl_grpo_ext.trl.config import ExtensionOptions
from trl_grpo_ext.trl.internals import GENERATION_BATCH_LEFT_PADDED as _LEFT_PADDED
from trl_grpo_ext.trl.internals import GENERATION_BATCH_RIGHT_PADDED as _RIGHT_PADDED
from trl_grpo_ext.trl.internals import log_metric

logger = logging.getLogger(__name__)


def _pad_to(tensor: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    if tensor.shape[1] == width:
        return tensor
    fill = tensor.new_full((tensor.shape[0], width - tensor.shape[1], *tensor.shape[2:]), value)
    return torch.cat([fill, tensor] if left else [tensor, fill], dim=1)


def merge_groups(outputs: list[dict], selection: list[GroupRef], group_size: int, pad_token_id: int) -> dict:
    """One generation batch (this process's rows) from the groups ``selection`` names in ``outputs`` (this
    process's part of each generation batch, as `_generate_and_score_completions` returns it). Padding groups get
    a zero completion mask and zero advantage. ``num_items_in_batch`` is left to the caller (it needs a gather)."""
    keys = set(outputs[0])
    unknown = keys - set(_LEFT_PADDED) - set(_RIGHT_PADDED) - {"num_items_in_batch"}
    if unknown:
        raise ValueError(f"dynamic_sampling cannot merge generation batches with {sorted(unknown)} (multimodal?)")
    if any(set(out) != keys for out in outputs):
        raise ValueError("dynamic_sampling: generation batches of one step carry different fields")
    rows = {key: [] for key in keys if key != "num_items_in_batch"}
    padding_rows = []
    for ref in selection:
        out = outputs[ref.batch]
        start = ref.group * group_size
        for key in rows:
            rows[key].append(out[key][start : start + group_size])
        padding_rows.append(torch.full((group_size,), ref.padding, dtype=torch.bool))
    merged = {}
    for key, parts in rows.items():
        if parts[0].dim() >= 2 and (key in _LEFT_PADDED or key in _RIGHT_PADDED):
            left = key in _LEFT_PADDED
            value = (_LEFT_PADDED if left else _RIGHT_PADDED)[key]
            value = pad_token_id if value == "pad" else value
            width = max(part.shape[1] for part in parts)  # a (B, 1) sequence-level ratio stays (B, 1)
            parts = [_pad_to(part, width, value, left) for part in parts]
        merged[key] = torch.cat(parts, dim=0)
    padding = torch.cat(padding_rows).to(merged["completion_mask"].device)
    if bool(padding.any()):
        keep = (~padding).to(merged["completion_mask"].dtype).unsqueeze(1)
        merged["completion_mask"] = merged["completion_mask"] * keep
        if "tool_mask" in merged:
            merged["tool_mask"] = merged["tool_mask"] * keep.to(merged["tool_mask"].dtype)
        advantages = merged["advantages"]
        zero = padding if advantages.dim() == 1 else padding.unsqueeze(1)
        merged["advantages"] = advantages.masked_fill(zero.to(advantages.device), 0.0)
    return merged


class CurriculumSampler(torch.utils.data.Sampler):
    """TRL's `RepeatSampler` layout (``batch_size`` distinct rows, each ``mini_repeat_count`` times, the chunk
    ``repeat_count`` times) with each row's task drawn from the curriculum's current weights.

    The weights are read when a chunk is drawn, so a chunk follows the pass rates observed up to then (the data
    loader draws about one generation batch ahead: the weights lag one batch, deterministically). ``tasks`` is the
    dataset's task column. One iteration yields as many chunks as `RepeatSampler` would (``len(tasks) //
    batch_size``); the random stream continues across iterations (epochs)."""

    def __init__(
        self,
        tasks: Sequence[str],
        curriculum: Curriculum,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        seed: int = 0,
    ):
        unknown = sorted(set(tasks) - set(curriculum.tasks))
        if unknown:
            raise ValueError(f"dataset tasks {unknown} are not in the curriculum ({', '.join(curriculum.tasks)})")
        if len(tasks) < batch_size:
            raise ValueError(f"{len(tasks)} training rows cannot fill a batch of {batch_size} prompts")
        self.curriculum = curriculum
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.num_chunks = len(tasks) // batch_size
        self._rng = random.Random(f"curriculum-sampler-{seed}")
        self._pools = TaskPools(tasks, random.Random(f"curriculum-rows-{seed}"))

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.num_chunks):
            chunk = [
                self._pools.next(task)
                for task in draw_tasks(self.curriculum, self._pools.available(), self.batch_size, self._rng)
            ]
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        return self.num_chunks * self.batch_size * self.mini_repeat_count * self.repeat_count


class DynamicSamplingMixin:
    """``dynamic_sampling``: degenerate groups are dropped and more prompts generated (see the module docstring).

    Needs our trainer's degenerate mask of each generation batch (``mixin_state.degenerate_groups``, set by
    `trl_grpo_ext.trl.trainer.GRPOTrainer._generate_and_score_completions`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        options = ExtensionOptions.of(self.args)
        self.dynamic_sampling = bool(options.dynamic_sampling)
        self.max_generation_batches = int(options.max_generation_batches)
        self._extra_prompts = None
        self._warned_budget = False
        if self.dynamic_sampling and isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            raise ValueError("dynamic_sampling needs a map-style (indexable) train_dataset, not an IterableDataset")

    def _extra_prompt_sampler(self, dataset):
        """The second prompt stream: one pass per chunk (``repeat_count=1``), another seed than the main one."""
        seed = self.args.seed + 1
        batch = self.args.generation_batch_size // self.num_generations
        if getattr(self, "curriculum", None) is not None:
            return CurriculumSampler(self._curriculum_tasks, self.curriculum, self.num_generations, batch, 1, seed)
        return RepeatSampler(dataset, self.num_generations, batch, 1, shuffle=self.shuffle_dataset, seed=seed)

    def _next_extra_prompts(self) -> list[dict]:
        for _ in range(2):  # the stream restarts (next epoch, new order) when the dataset is used up
            if self._extra_prompts is None:
                self._extra_prompts = iter(
                    internals.train_dataloader(self, self._extra_prompt_sampler, "Dynamic sampling")
                )
            try:
                return next(self._extra_prompts)
            except StopIteration:
                self._extra_prompts = None
        raise RuntimeError("dynamic_sampling: the training set yields no generation batch")

    def _generate_filtered(self, generation_batch):
        mode = "train"
        groups = self.args.generation_batch_size // self.num_generations
        filt = GroupFilter(groups, self.max_generation_batches, self.accelerator.num_processes)
        logged = internals.metric_count(self, mode, "frac_degenerate")
        outputs = []
        while True:
            self.mixin_state.degenerate_groups = None
            outputs.append(self._generate_and_score_completions(generation_batch))
            degenerate = self.mixin_state.degenerate_groups
            if degenerate is None:
                raise RuntimeError("dynamic_sampling: the trainer did not report the batch's degenerate groups")
            filt.add(degenerate.tolist())
            if filt.done:
                break
            generation_batch = self._next_extra_prompts()
        selection = filt.selection(self.accelerator.process_index)
        merged = merge_groups(outputs, selection, self.num_generations, internals.pad_token_id(self))
        merged["num_items_in_batch"] = self.accelerator.gather(internals.loss_mask(merged).sum()).sum()
        # each generated batch logged its own frac_degenerate; the step's is the one after the filter
        internals.drop_metric_values(self, mode, "frac_degenerate", logged)
        for name, value in filt.metrics().items():
            log_metric(self, mode, name, value)
        if not filt.full and not self._warned_budget:
            self._warned_budget = True
            logger.warning(
                "dynamic_sampling: %d generation batches gave %d of %d informative groups; training on those (the "
                "rest is masked-out padding, see frac_degenerate). Logged once.",
                filt.generation_batches,
                filt.informative_kept,
                groups,
            )
        return merged

    def _prepare_inputs(self, generation_batch):
        if not (self.dynamic_sampling and self.model.training):
            return super()._prepare_inputs(generation_batch)
        # TRL's own logic with the generation replaced by the filtered one (merge_groups refuses image fields).
        return internals.prepare_train_inputs(self, generation_batch, self._generate_filtered)


class CurriculumMixin:
    """``curriculum``: the training prompts' tasks follow `trl_grpo_ext.grpo.curriculum.Curriculum`, updated from
    every training generation batch's rewards (all processes' completions, so every process holds the same
    weights and draws the same prompts)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.curriculum = None
        if not ExtensionOptions.of(self.args).curriculum:
            return
        dataset = self.train_dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or "task" not in (dataset.column_names or []):
            raise ValueError(
                "curriculum needs a map-style train_dataset with a `task` column (dataset_name: synthetic)"
            )
        self._curriculum_tasks = list(dataset["task"])
        self.curriculum = curriculum_from_tasks(
            self._curriculum_tasks, ema=self.args.curriculum_ema, floor=self.args.curriculum_floor
        )
        # The reward column that decides a pass is checked and resolved by the trainer, with the other options that
        # name rewards, right after this (``mixin_state.curriculum_column``).

    # Checkpoints carry the pass-rate estimates, as TRL 1.16 does its adaptive-entropy state (same two hooks), so a
    # resumed run keeps its adapted weights. The prompt order after a resume still differs from an uninterrupted
    # run's: the sampler's draws are not replayed.
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.curriculum is not None and self.args.should_save:
            folder = checkpoint_dir(internals.checkpoint_root(self, trial), self.state.global_step)
            atomic_write_json(folder / CURRICULUM_STATE_FILENAME, self.curriculum.state_dict())

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.curriculum is not None and checkpoint is not None:
            path = Path(checkpoint) / CURRICULUM_STATE_FILENAME
            if path.exists():
                self.curriculum.load_state_dict(json.loads(path.read_text()))
            else:
                logger.warning("curriculum: %s has no %s; pass rates restart from the prior", checkpoint, path.name)

    def _get_train_sampler(self, dataset=None):
        if self.curriculum is None:
            return super()._get_train_sampler(dataset)
        return CurriculumSampler(
            self._curriculum_tasks,
            self.curriculum,
            mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            seed=self.args.seed,
        )

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.curriculum is None or not self.model.training:
            return rewards_per_func
        from accelerate.utils import gather_object

        column = self.mixin_state.curriculum_column
        if column is None:
            rewards = weighted_rewards(rewards_per_func, self.reward_weights)
        else:
            rewards = rewards_per_func[:, column]
        tasks = gather_object([example["task"] for example in inputs])  # rewards_per_func is all processes'
        self.curriculum.update(tasks, passed_values(rewards.tolist(), self.args.curriculum_pass_threshold))
        for name, value in self.curriculum.metrics().items():
            log_metric(self, "train", name, value)
        return rewards_per_func
