"""GRPO on GSM8K-style math through the PyTRIO client: the experiment loop runs here, the model runs remotely.

    # no --config: the offline embedded default (recipes/pytrio/embedded.yaml): the local pytrio server on
    # 127.0.0.1 with the embedded SmolLM2-135M-Instruct, end to end, no network, no credentials
    python recipes/gsm8k_pytrio.py

    # the hosted service: same loop, credentials from `trio login` or PYTRIO_API_KEY
    python recipes/gsm8k_pytrio.py --config recipes/pytrio/service.yaml

Every config key can be overridden on the command line (`--max_steps 5`, `--pytrio_base_url local`, ...).
Bad input (unknown or mistyped keys, bad values, data, reward names, a refused resume) stops the recipe with one
`error: ...` line and exit code 2 before any model loads or any file is written; a failure while training exits 1.
See docs/pytrio.md.
"""

import json
import logging
import os
import sys
from pathlib import Path

from trl_grpo_ext.compat import ignore_dependency_warnings  # noqa: E402
from trl_grpo_ext.cpu.threads import apply_cpu_thread_defaults, threads_mode  # noqa: E402

apply_cpu_thread_defaults()  # before torch loads (here or in the local server): OpenMP reads its settings then
ignore_dependency_warnings()  # the named ones our dependencies print and we cannot avoid

from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig  # noqa: E402
from trl_grpo_ext.pytrio.connection import install_log_redaction, redact  # noqa: E402
from trl_grpo_ext.pytrio.loop import GRPOLoop, PyTrioLoopError, run_from_config  # noqa: E402
from trl_grpo_ext.trl.script_args import parse_recipe_args  # noqa: E402

EMBEDDED_CONFIG = Path(__file__).resolve().parent / "pytrio" / "embedded.yaml"


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request otherwise
    install_log_redaction()
    try:
        threads_mode(os.environ)  # TRL_GRPO_EXT_CPU_THREADS, read by the local server's model load
        (config,) = parse_recipe_args(argv, default_config=EMBEDDED_CONFIG, dataclass_types=(PyTrioGRPOConfig,))
        # data, reward names, model path, resume state: before the local server loads the model or a file is written
        loop = GRPOLoop(config)
        loop.check_inputs()
    except (ValueError, FileNotFoundError) as error:  # one clear line, no traceback
        print(f"error: {redact(error)}", file=sys.stderr)
        return 2
    try:
        summary = run_from_config(config, loop=loop)
    except (PyTrioLoopError, RuntimeError, ValueError, FileNotFoundError) as error:
        print(f"error: {redact(error)}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
