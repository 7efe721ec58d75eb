"""What every command shares: its argument parser and how it ends.

    ap = command_parser(__doc__, "python -m specforge_core.export")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return run_command(lambda: {"out": do_it(load_config(args.config, args.overrides))})

The commands are the modules at the top of ``specforge_core`` (``train``, ``prepare``, ``export``,
``evaluate``, ``regenerate``) and ``specforge_core.config``. Their contract, kept here once:

- ``--config C.yaml`` then dotted overrides (``training.max_steps=20``), loaded by
  :func:`~specforge_core.config.load_config` (unknown keys refused with the field named);
- on success the exit code is 0 and a command's summary, when it has one, is one JSON line on
  stdout (``train`` prints ``step=`` lines instead, ``config`` the resolved YAML);
- a :class:`~specforge_core.errors.SpecForgeError` (bad config, data, model, checkpoint, resume)
  prints ``error: <where>: <what>`` and ``fix: ...`` on stderr, no traceback, exit code 2;
  anything else is a bug and keeps its traceback.
"""

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from specforge_core.errors import SpecForgeError

EXIT_OK, EXIT_INPUT_ERROR = 0, 2


def command_parser(doc: str, prog: str, *, config: bool = True, config_required: bool = True,
                   overrides_example: str = "training.max_steps=20") -> argparse.ArgumentParser:
    """A parser whose description is the first line of the command's docstring; with ``config``,
    ``--config`` and the trailing dotted overrides."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.strip().splitlines()[0])
    if config:
        ap.add_argument("--config", required=config_required, help="YAML run config")
        ap.add_argument("overrides", nargs="*", help=f"dotted config overrides, e.g. {overrides_example}")
    return ap


def report_error(error: SpecForgeError, prefix: str = "error") -> int:
    print(f"{prefix}: {error}", file=sys.stderr, flush=True)
    return EXIT_INPUT_ERROR


def run_command(body: Callable[[], Any], *, error_prefix: str = "error") -> int:
    """Run ``body``; print its result (a dict or list: one JSON line; None: nothing) and return
    the exit code: 0, or 2 with the message on stderr when it raised a SpecForgeError."""
    try:
        result = body()
    except SpecForgeError as e:
        return report_error(e, error_prefix)
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    if result is not None:
        print(json.dumps(result), flush=True)
    return EXIT_OK
