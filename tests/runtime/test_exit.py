"""``exit_after_success``: a finished rank ends with exit code 0 and loses nothing it printed or logged.

system/distributed.py says why the function leaves through ``os._exit`` (a gloo worker thread can
abort a finished rank at the interpreter's teardown). That race itself is not tested here: it hits
about one 2-rank FSDP launch in four on this machine, so catching it reliably takes some ten
launches of two fresh torch processes (tens of seconds); the torchrun tests (test_train_cli.py)
and every ``run_ranks`` test exercise the exit on real ranks. What is tested is what ``os._exit``
could lose: output still in Python's buffers when the process ends.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import atexit, logging, logging.handlers, sys
from specforge_core.system.distributed import exit_after_success

log_file = logging.FileHandler(sys.argv[1])
buffered = logging.handlers.MemoryHandler(capacity=100, target=log_file)  # holds records until flushed
logging.getLogger().addHandler(buffered)
logging.getLogger().setLevel(logging.INFO)
logging.info("logged before the exit")
print("printed before the exit", end="")  # a pipe: block-buffered, no newline either
sys.stderr.write("stderr before the exit")  # line-buffered: held without a newline
atexit.register(print, "atexit ran")
exit_after_success()
print("after the exit")
"""


def test_exit_after_success_exits_zero_with_stdio_and_logs_flushed(tmp_path):
    log = tmp_path / "child.log"
    # buffered stdio, as in a rank started by hand (the flow's launcher sets PYTHONUNBUFFERED)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(log)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "printed before the exit"  # flushed; nothing after the exit, no atexit handler
    assert out.stderr.endswith("stderr before the exit")
    assert log.read_text() == "logged before the exit\n"
