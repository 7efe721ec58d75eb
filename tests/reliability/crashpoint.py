"""Run a module and SIGKILL the process at an exact point: just before a chosen rename or call.

    CRASH_ON=rename:/prompts/ python tests/reliability/crashpoint.py specforge_core.prepare --config C.yaml
    CRASH_ON=replace:/vocab/.pt CRASH_SKIP=0 python tests/reliability/crashpoint.py specforge_core.prepare ...
    CRASH_ON=call:specforge_core.loop.trainer:Trainer._optimizer_step CRASH_SKIP=3 python ... specforge_core.train ...

``CRASH_ON=<os function>:<needle>``: ``os.rename`` / ``os.replace`` are wrapped so that the first
call whose destination contains every ``needle`` part (split on ``*``) kills the process with
SIGKILL before renaming: everything before the rename is on disk, the rename never happens.
Renames are the commit points of every atomic write in the project, so this reaches the worst
moment of each one without a hook in the code under test.

``CRASH_ON=call:<module>:<attribute path>``: that function or method is wrapped (in its module, or
on its class) so that a call kills the process before the function runs, e.g. at the start of an
optimizer step or of a chunk's write. The module is imported and patched before the run starts,
so ``from module import name`` in the code under test gets the wrapped function.

``CRASH_SKIP=N`` lets N matching calls through first; ``CRASH_RANK=r`` arms it only where the
environment's RANK is r (under torchrun). A kill chosen this way lands at the same point of the
run on any machine, however fast.
"""

import functools
import importlib
import os
import runpy
import signal
import sys


def arm() -> None:
    spec = os.environ.get("CRASH_ON")
    if not spec or os.environ.get("CRASH_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return
    fn_name, needle = spec.split(":", 1)
    skip = [int(os.environ.get("CRASH_SKIP", "0"))]

    def countdown() -> None:
        if skip[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        skip[0] -= 1

    if fn_name == "call":
        module, path = needle.split(":")
        *owners, name = path.split(".")
        owner = importlib.import_module(module)
        for part in owners:
            owner = getattr(owner, part)
        real_call = getattr(owner, name)

        @functools.wraps(real_call)
        def crashing_call(*args, **kwargs):
            countdown()
            return real_call(*args, **kwargs)

        setattr(owner, name, crashing_call)
        return

    parts = needle.split("*")
    real = getattr(os, fn_name)

    def crashing(src, dst, *args, **kwargs):
        if all(p in os.fspath(dst) for p in parts):
            countdown()
        return real(src, dst, *args, **kwargs)

    setattr(os, fn_name, crashing)


if __name__ == "__main__":
    arm()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
