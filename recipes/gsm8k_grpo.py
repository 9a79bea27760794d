"""GRPO on GSM8K-style math with verifiable rewards, one YAML recipe per experiment (recipes/gsm8k/*.yaml).

python recipes/gsm8k_grpo.py                       # no --config: the offline embedded default
accelerate launch --config_file accelerate_configs/ddp.yaml recipes/gsm8k_grpo.py --config recipes/gsm8k/dapo.yaml
"""

import sys
from pathlib import Path

from trl_grpo_ext.compat import ignore_dependency_warnings  # noqa: E402
from trl_grpo_ext.cpu.threads import apply_cpu_thread_defaults, configure_cpu_threads  # noqa: E402

apply_cpu_thread_defaults()  # before torch loads: OpenMP reads its settings then
ignore_dependency_warnings()  # the named ones our dependencies print and we cannot avoid

from trl import get_peft_config  # noqa: E402

from trl_grpo_ext.evaluation import recipe_eval_options  # noqa: E402
from trl_grpo_ext.runs.reward_curve import plot_run_reward_curve  # noqa: E402
from trl_grpo_ext.runs.tracking import start_swanlab  # noqa: E402
from trl_grpo_ext.task.rewards import JudgeUnavailableError, trl_reward_inputs  # noqa: E402
from trl_grpo_ext.trl import callbacks as cbs  # noqa: E402
from trl_grpo_ext.trl.recipe import (  # noqa: E402
    load_model,
    precision_line,
    prepare_run,
    report_run,
    sampler_line,
    sampling_mode,
    save_run_config,
)
from trl_grpo_ext.trl.script_args import parse_recipe_args  # noqa: E402

EMBEDDED_RECIPE = Path(__file__).resolve().parent / "gsm8k" / "embedded.yaml"


def main(argv=None) -> int:
    """Train; returns 0, or 2 after one `error: ...` line when the config, data, rewards or model path are wrong."""
    try:
        script_args, training_args, model_args = parse_recipe_args(argv, default_config=EMBEDDED_RECIPE)
        print(f"torch threads: {configure_cpu_threads(training_args)}", flush=True)
        print(precision_line(training_args), flush=True)
        print(sampler_line(training_args), flush=True)
        print(f"sampling: {sampling_mode(training_args)}", flush=True)
        # Every input check, before the model loads and before anything in output_dir is written.
        run = prepare_run(script_args, training_args, model_args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import trl_grpo_ext

    model = load_model(run.model_path, model_args, training_args)
    swanlab_on = "swanlab" in (training_args.report_to or [])
    if swanlab_on:  # before the trainer: transformers' SwanLab callback needs an active run
        start_swanlab(
            training_args.output_dir,
            script_args.swanlab_project,
            training_args.run_name,
            script_args.swanlab_mode,
            training_args.to_dict(),
        )
    # reward models as TRL takes them: the model, with its tokenizer as the reward processing class
    reward_funcs, reward_processing_classes = trl_reward_inputs(run.reward_funcs)
    callbacks = [cbs.MetricsJsonlCallback()]
    if run.eval_problems:
        eval_options = recipe_eval_options(script_args, training_args)
        callbacks.append(cbs.BeforeAfterEvalCallback(run.eval_problems, eval_options))
    callbacks.append(cbs.TrainingPhaseCallback())  # after the eval before training: its time is left out
    trainer = trl_grpo_ext.GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        reward_processing_classes=reward_processing_classes,
        args=training_args,
        train_dataset=run.train_dataset,
        processing_class=run.tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=callbacks,
        environment_factory=run.environment_factory,  # `environments:` (multi-turn with tools), else None
    )
    if swanlab_on:
        trainer.add_callback(cbs.SwanLabCompletionsCallback(trainer))
    save_run_config(trainer, script_args, training_args, model_args)
    if run.resume_from_checkpoint:
        print(f"resuming from {run.resume_from_checkpoint}", flush=True)
    try:
        trainer.train(resume_from_checkpoint=run.resume_from_checkpoint)
    except JudgeUnavailableError as error:  # the checkpoints saved so far stay as they are
        print(f"error: {error}", file=sys.stderr)
        return 1
    trainer.save_model(training_args.output_dir)
    if report_run(trainer, training_args):
        print(f"reward curve: {plot_run_reward_curve(training_args.output_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
