"""GRPO on GSM8K-style math through the PyTRIO client: the experiment loop runs here, the model runs remotely.

    # offline, end to end: the local pytrio server on 127.0.0.1 with the embedded SmolLM2-135M-Instruct
    python recipes/gsm8k_pytrio.py --config recipes/pytrio/embedded.yaml

    # the hosted service: same loop, credentials from `trio login` or PYTRIO_API_KEY
    python recipes/gsm8k_pytrio.py --config recipes/pytrio/service.yaml

Every config key can be overridden on the command line (`--max_steps 5`, `--pytrio_base_url local`, ...);
unknown keys are an error. See docs/pytrio.md.
"""

import json
import logging
import sys
from pathlib import Path

from trl import TrlParser

# Runnable from a checkout without `pip install -e .` too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl_grpo_ext.pytrio.config import PyTrioGRPOConfig
from trl_grpo_ext.pytrio.connection import install_log_redaction, redact
from trl_grpo_ext.pytrio.loop import PyTrioLoopError, run_from_config


def main(argv=None) -> int:
    parser = TrlParser((PyTrioGRPOConfig,))
    try:
        (config,) = parser.parse_args_and_config(args=argv)
    except ValueError as error:  # invalid values, unknown YAML keys: one clear line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request otherwise
    install_log_redaction()
    try:
        summary = run_from_config(config)
    except (PyTrioLoopError, RuntimeError, ValueError, FileNotFoundError) as error:
        print(f"error: {redact(error)}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
