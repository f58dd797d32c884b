"""`python -m vllm_overlay COMMAND ...`: the `vllm-overlay` command where its script is not on PATH
(e.g. a `pip install --target` site)."""

import sys

from vllm_overlay.tools.cli.main import main

sys.exit(main())
