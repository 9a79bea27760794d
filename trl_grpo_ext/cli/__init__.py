"""`trl-grpo-ext` console script: one subcommand per module in this package.

Each subcommand module defines `add_arguments(parser)` and `run(args) -> int`; it is imported only
when chosen, so `trl-grpo-ext compare` does not pay for importing torch's training stack.
"""

import argparse
import os
import sys
from importlib import import_module

from trl_grpo_ext.compat import ignore_dependency_warnings
from trl_grpo_ext.cpu.threads import apply_cpu_thread_defaults, threads_mode

SUBCOMMANDS = {
    "pytrio-serve": ("trl_grpo_ext.cli.pytrio_serve", "serve the PyTRIO protocol locally on a transformers model"),
    "sweep": ("trl_grpo_ext.cli.sweep", "expand a grid over a base recipe and run every variant"),
    "compare": ("trl_grpo_ext.cli.compare", "tables and plots comparing finished runs"),
    "eval": ("trl_grpo_ext.cli.evaluate", "GSM8K-style accuracy of a model (pass@1, maj@k, pass@k)"),
}


def main(argv=None) -> int:
    apply_cpu_thread_defaults()  # before a subcommand imports torch: OpenMP reads its settings then
    ignore_dependency_warnings()  # the named ones our dependencies print and we cannot avoid
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="trl-grpo-ext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            import_module(module).add_arguments(p)
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        threads_mode(os.environ)  # read where a model loads: a bad value fails here, first
    except ValueError as error:
        parser.error(str(error))
    return import_module(SUBCOMMANDS[args.command][0]).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
