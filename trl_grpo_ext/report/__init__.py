"""Reports of runs and evals, without reading any file themselves: statistics on `scipy.stats` (`stats`), how
estimates, intervals and verdicts read (`text`), markdown tables (`tables`, on tabulate), numbers of a curve
(`curves`: moving average, mean level) and the PNGs (`plots`, matplotlib on first use).

Used by `trl-grpo-ext compare` (`trl_grpo_ext.experiments.compare`, `trl_grpo_ext.experiments.seed_comparison`), the eval summaries
(`trl_grpo_ext.evaluation`, the recipe's run summary) and recipes/plot_metrics.py.
"""
