"""`python -m trl_grpo_ext.cli` = the `trl-grpo-ext` console script."""

import sys

from trl_grpo_ext.cli import main

sys.exit(main())
