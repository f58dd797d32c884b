"""The overlay's logger, ``vllm_overlay``, and how its lines reach a terminal or a log file.

The overlay never touches vLLM's loggers, the root logger or anyone's handlers. ``setup()`` only
makes sure its lines are seen, in one format, when nobody configured logging:

- if a handler already receives our records (on our logger or an ancestor, e.g. the user's
  ``logging.basicConfig(format=...)`` or pytest's capture), nothing is added: the user's configuration
  decides format and destination;
- otherwise one stderr handler is added to our own logger. It is a fallback: it stays silent as
  soon as some ancestor gets a handler later, so a user who configures logging after vLLM loaded
  the plugin does not see every line twice.

One handler above ours is not taken as anyone's configuration: the bare one that Python's module-level
``logging.debug()`` / ``info()`` / ``warning()`` put on the root logger on first use when it has none
(``basicConfig()``: a plain ``StreamHandler`` to stderr with ``BASIC_FORMAT``). vLLM's CPU build calls
``logging.debug`` while loading a MoE model's weights (``is_zentorch_moe_supported``), in every CPU worker,
after the plugin loaded: without this rule every later overlay line of that worker would come out as
``WARNING:vllm_overlay:...``. While such handlers are all there is above it, the fallback prints the
record in our format and keeps it from propagating (once, not twice); as soon as any other handler
is above it, the record propagates as usual and the fallback is silent.

Our logger's level is set to INFO only when nobody set it (the one-line summary per process is
INFO and is the point of the overlay); a level the user set is kept.
"""

from __future__ import annotations

import logging
import sys

LOG = logging.getLogger("vllm_overlay")
FORMAT = "%(levelname)s %(asctime)s [vllm-overlay] %(message)s"
DATEFMT = "%m-%d %H:%M:%S"


def _ancestor_handlers(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers above ``logger`` that would receive its records were it propagating (the
    ancestors' own propagation followed)."""
    found: list[logging.Handler] = []
    current = logger.parent
    while current is not None:
        found.extend(current.handlers)
        if not current.propagate:
            break
        current = current.parent
    return found


def implicit_default(handler: logging.Handler) -> bool:
    """Whether ``handler`` is the bare stderr handler ``logging.basicConfig()`` adds with no
    arguments, as Python's module-level logging functions do on first use (see the module docstring)."""
    fmt = getattr(handler.formatter, "_fmt", None)
    return (type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.__stderr__)
            and handler.level == logging.NOTSET and not handler.filters and fmt in (None, logging.BASIC_FORMAT))


def _ancestors_handle(logger: logging.Logger) -> bool:
    """Whether a handler above ``logger`` receives its records (propagation followed), other than
    the implicit default one."""
    if not logger.propagate:
        return False
    return any(not implicit_default(h) for h in _ancestor_handlers(logger))


class FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, only while no ancestor handler would print the record."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(sys.stderr)
        self.logger = logger
        self.setFormatter(logging.Formatter(FORMAT, DATEFMT))

    def emit(self, record: logging.LogRecord) -> None:
        above = _ancestor_handlers(self.logger)
        if any(not implicit_default(h) for h in above):
            self.logger.propagate = True  # someone configured logging: their handlers print it
            return
        # nothing above, or only the implicit default handler: ours prints it, and only ours
        self.logger.propagate = not above
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
