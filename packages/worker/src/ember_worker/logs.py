"""Logging of Ember's processes: one format, and the level handed from the command line to the
processes it starts (engine cores, worker ranks) through ``EMBER_LOGGING_LEVEL``.

Without it a started process would log only warnings (Python's default), so a worker's INFO lines
(the loader's dtype, the experts' load) would never show under ``ember serve``.
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "EMBER_LOGGING_LEVEL"
LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Log at ``level`` to stderr in Ember's format, here and in the processes started from here
    (which call ``configure_started_process_logging``)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    os.environ[LEVEL_ENV] = level.lower()


def configure_started_process_logging() -> None:
    """Log at the level the starting process set in ``EMBER_LOGGING_LEVEL``; where it set none
    (a process started by a library user), leave logging as it is."""
    level = os.environ.get(LEVEL_ENV)
    if level:
        logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr)
