"""The overlay's logger, ``vllm_overlay``, and how its lines reach a terminal or a log file.

The overlay never touches vLLM's loggers, the root logger or anyone's handlers, and never turns
propagation off. ``setup()`` only makes sure its lines are seen when nobody configured logging:

- if a handler already receives our records (on our logger or an ancestor, e.g. the user's
  ``logging.basicConfig`` or pytest's capture), nothing is added: the user's configuration decides
  format and destination;
- otherwise one stderr handler is added to our own logger. It is a fallback: it stays silent as
  soon as some ancestor gets a handler later, so a user who configures logging after vLLM loaded
  the plugin does not see every line twice.

Our logger's level is set to INFO only when nobody set it (the one-line summary per process is
INFO and is the point of the overlay); a level the user set is kept.
"""

from __future__ import annotations

import logging
import sys

LOG = logging.getLogger("vllm_overlay")
FORMAT = "%(levelname)s %(asctime)s [vllm-overlay] %(message)s"
DATEFMT = "%m-%d %H:%M:%S"


def _ancestors_handle(logger: logging.Logger) -> bool:
    """Whether a handler above ``logger`` receives its records (propagation followed)."""
    current: logging.Logger | None = logger
    while current is not None and current.propagate:
        current = current.parent  # type: ignore[assignment]
        if current is not None and current.handlers:
            return True
    return False


class FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, only while no ancestor handler would print the record."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(sys.stderr)
        self.logger = logger
        self.setFormatter(logging.Formatter(FORMAT, DATEFMT))

    def emit(self, record: logging.LogRecord) -> None:
        if _ancestors_handle(self.logger):
            return
        self.stream = sys.stderr  # follow a redirected stderr (pytest, tools)
        super().emit(record)


def setup(logger: logging.Logger = LOG) -> None:
    """Idempotent; see the module docstring."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if logger.handlers:  # ours already, or one the user put on our logger
        return
    if _ancestors_handle(logger):
        return
    logger.addHandler(FallbackHandler(logger))
