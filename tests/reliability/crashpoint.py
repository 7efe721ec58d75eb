"""Run a module and SIGKILL the process at an exact point: just before a chosen rename.

    CRASH_ON=rename:/prompts/ python tests/reliability/crashpoint.py specforge_core.prepare --config C.yaml
    CRASH_ON=replace:/vocab/.pt CRASH_SKIP=0 python tests/reliability/crashpoint.py specforge_core.prepare ...

``CRASH_ON=<os function>:<needle>``: ``os.rename`` / ``os.replace`` are wrapped so that the first
call whose destination contains every ``needle`` part (split on ``*``) kills the process with
SIGKILL before renaming: everything before the rename is on disk, the rename never happens.
``CRASH_SKIP=N`` lets N matching calls through first; ``CRASH_RANK=r`` arms it only where the
environment's RANK is r (under torchrun). Renames are the commit points of every atomic write in
the project, so this reaches the worst moment of each one without a hook in the code under test.
"""

import os
import runpy
import signal
import sys


def arm() -> None:
    spec = os.environ.get("CRASH_ON")
    if not spec or os.environ.get("CRASH_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return
    fn_name, needle = spec.split(":", 1)
    parts = needle.split("*")
    real = getattr(os, fn_name)
    skip = [int(os.environ.get("CRASH_SKIP", "0"))]

    def crashing(src, dst, *args, **kwargs):
        if all(p in os.fspath(dst) for p in parts):
            if skip[0] == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            skip[0] -= 1
        return real(src, dst, *args, **kwargs)

    setattr(os, fn_name, crashing)


if __name__ == "__main__":
    arm()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
