"""One measurement in a fresh Python process: what fit-limit's tries and the benchmarks that
need a clean process (an allocator cap, XLA's heap, a peak no earlier run has touched) share.

The parent runs ``python -m <module> <request as JSON>`` with the CPU BFC allocator on (its
statistics give the peak) and whatever else the caller sets; the child answers with one line,
``RESULT_PREFIX`` + JSON, on stdout (:func:`serve`), so anything else the child prints is
ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from typing import Callable

RESULT_PREFIX = "MEMSAVE_CHILD_RESULT "


@dataclasses.dataclass(frozen=True)
class ChildRun:
    """What came back: ``result`` (the child's answer) or why there is none."""

    result: dict | None
    returncode: int | None
    stderr: str
    timed_out: bool = False

    @property
    def crashed(self) -> bool:
        """Killed by a signal (a segmentation fault, an abort) rather than exiting."""
        return self.returncode is not None and self.returncode < 0

    def last_error_line(self) -> str:
        if self.timed_out:
            return "ran past its time limit"
        if self.crashed:
            # The last stderr line is then whatever TensorFlow last logged, not the cause.
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"the process was killed by {name}"
        return (self.stderr.strip().splitlines() or [f"exit status {self.returncode}"])[-1]


def run(module: str, request: dict, env: dict | None = None,
        timeout_s: float | None = None) -> ChildRun:
    """Run ``module``'s :func:`serve` on ``request`` in a fresh process; ``env`` is added to
    this process's environment, a None value removing the variable (the BFC allocator is
    always on, TensorFlow's C++ logs quiet unless set)."""
    full_env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", **(env or {}))
    full_env = {name: value for name, value in full_env.items() if value is not None}
    full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        proc = subprocess.run([sys.executable, "-m", module, json.dumps(request)], env=full_env,
                              capture_output=True, text=True, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (
            e.stderr or "")
        return ChildRun(None, None, stderr, timed_out=True)
    answers = [line[len(RESULT_PREFIX):] for line in proc.stdout.splitlines()
               if line.startswith(RESULT_PREFIX)]
    result = json.loads(answers[-1]) if answers else None
    return ChildRun(result, proc.returncode, proc.stderr)


def serve(handle: Callable[[dict], dict]) -> None:
    """The child's side: answer the request in ``sys.argv[1]`` with ``handle(request)``."""
    print(RESULT_PREFIX + json.dumps(handle(json.loads(sys.argv[1]))), flush=True)
