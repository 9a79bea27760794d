"""GRPO on GSM8K-style math with verifiable rewards, one YAML recipe per experiment (recipes/gsm8k/*.yaml).

    python recipes/gsm8k_grpo.py                       # no --config: the offline embedded default
    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/gsm8k_grpo.py --config recipes/gsm8k/dapo.yaml
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # no install needed

from trl import get_peft_config  # noqa: E402

from trl_grpo_ext import callbacks as cbs  # noqa: E402
from trl_grpo_ext.recipe import build_datasets, load_model_and_tokenizer, report_run, reward_functions  # noqa: E402
from trl_grpo_ext.script_args import parse_recipe_args  # noqa: E402

EMBEDDED_RECIPE = Path(__file__).resolve().parent / "gsm8k" / "embedded.yaml"


def main(argv=None):
    script_args, training_args, model_args = parse_recipe_args(argv, default_config=EMBEDDED_RECIPE)
    import torch

    import trl_grpo_ext

    print(f"torch threads: {torch.get_num_threads()}", flush=True)
    model, tokenizer = load_model_and_tokenizer(model_args, training_args)
    train_dataset, eval_problems = build_datasets(script_args, training_args, tokenizer)
    swanlab_on = "swanlab" in (training_args.report_to or [])
    if swanlab_on:  # before the trainer: transformers' SwanLab callback needs an active run
        cbs.init_swanlab(training_args, script_args.swanlab_project, script_args.swanlab_mode, training_args.to_dict())
    callbacks = [cbs.MetricsJsonlCallback()]
    if eval_problems:
        eval_tokens = script_args.eval_max_new_tokens or training_args.max_completion_length
        callbacks.append(cbs.BeforeAfterEvalCallback(eval_problems, eval_tokens))
    trainer = trl_grpo_ext.GRPOTrainer(
        model=model,
        reward_funcs=reward_functions(script_args.reward_funcs, training_args, tokenizer),
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=callbacks,
    )
    if swanlab_on:
        trainer.add_callback(cbs.SwanLabCompletionsCallback(trainer))
    resume = training_args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if str(resume).lower() == "true" else resume)
    trainer.save_model(training_args.output_dir)
    if report_run(trainer, training_args):
        from plot_metrics import plot_reward_curve

        print(f"reward curve: {plot_reward_curve(training_args.output_dir)}")


if __name__ == "__main__":
    main()
