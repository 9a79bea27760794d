"""GRPO on GSM8K-style math with verifiable rewards, configured by a YAML recipe (recipes/gsm8k/*.yaml).

    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/gsm8k_grpo.py --config recipes/gsm8k/dapo.yaml
    python recipes/gsm8k_grpo.py                      # no --config: the offline embedded default
    python recipes/gsm8k_grpo.py --config recipes/gsm8k/embedded.yaml --max_steps 5   # CLI flags override YAML
"""

import sys
from pathlib import Path

from trl import get_peft_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout without `pip install -e .`
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trl_grpo_ext.callbacks import (
    BeforeAfterEvalCallback,
    MetricsJsonlCallback,
    SwanLabCompletionsCallback,
    init_swanlab,
)
from trl_grpo_ext.recipe import build_datasets, load_model_and_tokenizer, report_run, reward_functions
from trl_grpo_ext.script_args import parse_recipe_args

EMBEDDED_RECIPE = Path(__file__).resolve().parent / "gsm8k" / "embedded.yaml"


def main(argv=None):
    script_args, training_args, model_args = parse_recipe_args(argv, default_config=EMBEDDED_RECIPE)
    import torch

    import trl_grpo_ext

    print(f"torch threads: {torch.get_num_threads()}", flush=True)

    model, tokenizer = load_model_and_tokenizer(model_args, training_args)
    train_dataset, eval_problems = build_datasets(script_args, training_args, tokenizer)
    swanlab_on = "swanlab" in (training_args.report_to or [])
    if swanlab_on:
        init_swanlab(training_args, script_args.swanlab_project, script_args.swanlab_mode, config=training_args.to_dict())
    callbacks = [MetricsJsonlCallback()]
    if eval_problems:
        eval_tokens = script_args.eval_max_new_tokens or training_args.max_completion_length
        callbacks.append(BeforeAfterEvalCallback(eval_problems, eval_tokens))
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
        trainer.add_callback(SwanLabCompletionsCallback(trainer))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if report_run(trainer, training_args):
        from plot_metrics import plot_reward_curve

        print(f"reward curve: {plot_reward_curve(training_args.output_dir)}")


if __name__ == "__main__":
    main()
