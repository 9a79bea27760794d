"""The stand-in recipe script the sweep tests run instead of a real one (tests/test_sweep*.py)."""

import textwrap

# A stand-in recipe: reads --config like the real ones, writes metrics.jsonl and HF-style checkpoints,
# resumes from --resume_from_checkpoint, fails when its config asks it to, and records each invocation
# (resume flag, SwanLab names, SLURM job, threads) in invocations.jsonl.
FAKE_RECIPE = textwrap.dedent(
    r"""
    import argparse, json, os, sys
    from pathlib import Path
    import yaml

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--resume_from_checkpoint", default=None)
    args = p.parse_args()
    cfg = yaml.safe_load(open(args.config))
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "invocations.jsonl", "a") as f:
        f.write(json.dumps({"resume": args.resume_from_checkpoint, "group": os.environ.get("SWANLAB_GROUP"),
                            "exp": os.environ.get("SWANLAB_EXP_NAME"), "run_name": cfg.get("run_name"),
                            "job": os.environ.get("SLURM_JOB_ID"), "threads": os.environ.get("OMP_NUM_THREADS")}) + "\n")
    print("training", cfg.get("loss_type"), flush=True)
    if cfg.get("fail_always"):
        print("Traceback: boom, this run is broken", file=sys.stderr)
        sys.exit(7)
    start = int(args.resume_from_checkpoint.rsplit("-", 1)[1]) if args.resume_from_checkpoint else 0
    for step in range(start + 1, cfg["max_steps"] + 1):
        if step == cfg.get("crash_once_at") and not (out / "crashed").exists():
            (out / "crashed").write_text("")
            print("killed at step", step, flush=True)
            sys.exit(9)
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "reward": step * cfg.get("learning_rate", 0.0)}) + "\n")
        ckpt = out / f"checkpoint-{step}"
        ckpt.mkdir(exist_ok=True)
        (ckpt / "trainer_state.json").write_text("{}")
    """
)


# The shipped TRL recipe (recipes/gsm8k/embedded.yaml) cut down to 2 steps of the tiny test model.
TINY_RUN = {
    "synthetic_tasks": "chain_sum_easy",
    "num_train_samples": 8,
    "eval_num_samples": 0,
    "max_steps": 2,
    "num_generations": 2,
    "per_device_train_batch_size": 2,
    "max_completion_length": 8,
}
