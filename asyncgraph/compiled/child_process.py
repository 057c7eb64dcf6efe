"""A child process that works for a fast form's build: started, fed, waited for, stopped.

Why: a build's heaviest steps (a first ONNX export, an AOTInductor compile) hold the GIL for
long stretches; in a child process they share none with the serving loop (export_worker.py,
aoti_form.py say what each child does). The build thread that waits for the child must still
notice that its Executor closed, and must not wait forever on a child that hangs.

`run_child(module, job, timeout_s, failed)`: `python -m <module>` with the parent's `sys.path`
(started with `subprocess`, not multiprocessing: a spawned child would import the
application's `__main__` again), `job` written to its stdin, its stdout and stderr returned
once it exits. Every POLL_S the waiting thread checks whether the build was cancelled
(runtime/forms.py's `build_cancelled`) or `timeout_s` passed; either stops the child (killed,
never left behind) and raises `failed(why)`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

from asyncgraph.runtime.forms import build_cancelled

POLL_S = 0.1  # how often the parent checks whether the build was cancelled


def run_child(module: str, job: bytes | None, timeout_s: float, what: str,
              failed: Callable[[str], Exception]) -> subprocess.CompletedProcess[bytes]:
    """`python -m module` fed `job`; its exit once it ends (any return code); `failed(why)`
    raised when it cannot start, or was stopped (`what` names it in the reason)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        child = subprocess.Popen([sys.executable, "-m", module], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
    except OSError as exc:
        raise failed(f"the {what} process did not start: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    with child:
        try:
            while True:
                try:
                    stdout, stderr = child.communicate(job, timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    job = None  # written once
                    if build_cancelled() or time.monotonic() > deadline:
                        why = "the Executor closed" if build_cancelled() else (
                            f"it took over {timeout_s:.0f} s")
                        raise failed(f"the {what} process was stopped: {why}") from None
        finally:
            if child.poll() is None:
                child.kill()
                child.communicate()
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def last_line(done: subprocess.CompletedProcess[bytes]) -> str:
    """The last line a child wrote to stderr (why it crashed), at most 300 characters."""
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return (lines[-1] if lines else "no output")[:300]
