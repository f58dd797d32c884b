"""`python3 -m bench.stack STEP ...` from the project root: the same command as `python3 bench/stack.py`."""

import sys

from .cli import main

sys.argv[0] = "python3 -m bench.stack"  # argparse's usage line names the command, not __main__.py
sys.exit(main())
