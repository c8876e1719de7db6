#!/usr/bin/env python
"""Run one of TensorFlow's own gradient test files under ``memsave_grads.patch()`` and count
the regressions: tests that pass unpatched and fail patched.

This script fetches nothing and contains none of TensorFlow's code. Get the test file from
TensorFlow's source at the tag of the installed version (for TF 2.21:
``tensorflow/python/ops/gradients_test.py`` and
``tensorflow/python/ops/parallel_for/gradients_test.py``), keep it *outside* this repository,
and pass its path::

    PYTHONPATH=. python scripts/run_tf_gradients_test.py /tmp/tf/gradients_test.py
    PYTHONPATH=. python scripts/run_tf_gradients_test.py /tmp/tf/pfor_gradients_test.py \\
        --modes v1,v1_cfv2 --strategies memory --only test_jacobian_scan_shape

Every (mode, strategy) runs the whole file in a process of its own (the modes change global
TensorFlow state), ``--jobs`` at a time:

- modes: ``tf2`` (TensorFlow 2 behaviour), ``v1`` (``disable_v2_behavior()``) and
  ``v1_cfv2`` (the same, then ``enable_control_flow_v2()``);
- strategies: ``none`` (unpatched: the reference) and, under
  ``memsave_grads.patch(checkpoints=...)``, ``memory``, ``speed`` and ``every_op`` (the name
  pattern ``["*"]``, which keeps every op of the forward region it can).

As in the TF-semantics suite (tests/tf_semantics_cases.py), the never-worse rule is turned off
so that small test graphs are really rewritten rather than handed to plain tf.gradients
(``--keep-never-worse`` keeps it). A test's calls are counted: routed to memsave_grads,
rewritten (the rewrite ran), fallen back to tf.gradients, raised.

The table printed at the end has one row per (mode, strategy): tests run, passed, skipped,
rewrote (tests with at least one rewritten gradient call) and regressions, each listed below
the table with the start and end of its failure message. A failure of a test that also fails
unpatched (a GPU-only test, a file older or newer than the installed TensorFlow) is not a
regression. The exit status is 1 if there is any regression. ``--json PATH`` writes every
outcome.

Measured for issue 35 (CHANGELOG) with the newest ``gradients_test.py`` of the search index (it
imports ``array_ops_stack`` and ``while_loop``, as TF 2.21 has them) and the one stored
parallel_for ``gradients_test.py`` (older: it imports ``tensorflow.python.keras`` and has no TF2
decorators, so in mode tf2 only one of its tests passes unpatched; run it in v1 modes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import logging as std_logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
import unittest

MODES = ("tf2", "v1", "v1_cfv2")
STRATEGIES = {"memory": "memory", "speed": "speed", "every_op": ["*"]}
REFERENCE = "none"
#: Wall-clock limit of one (mode, strategy) process.
PROCESS_TIMEOUT_S = 1800


# --------------------------------------------------------------------------------------------
# One (mode, strategy) in this process


class _CallCounter:
    """Counts, per test, the calls a patched tf.gradients makes into memsave_grads and what
    became of them, by wrapping ``api.gradients`` and ``stitch.backprop`` (module attributes
    looked up at each call)."""

    def __init__(self):
        from memsave_grads import api, errors  # pylint: disable=import-outside-toplevel
        from memsave_grads._tf import stitch  # pylint: disable=import-outside-toplevel
        self.counts = dict.fromkeys(("routed", "rewrote", "fell_back", "raised"), 0)
        real_gradients, real_backprop = api.gradients, stitch.backprop
        counts = self.counts

        def gradients_spy(*args, **kwargs):
            counts["routed"] += 1
            try:
                return real_gradients(*args, **kwargs)
            except errors.FALLBACK_ERRORS:
                counts["fell_back"] += 1
                raise
            except Exception:
                counts["raised"] += 1
                raise

        def backprop_spy(*args, **kwargs):
            counts["rewrote"] += 1
            return real_backprop(*args, **kwargs)

        api.gradients = gradients_spy
        stitch.backprop = backprop_spy

    def take(self) -> dict:
        taken = dict(self.counts)
        for key in self.counts:
            self.counts[key] = 0
        return taken


class _Recorder(unittest.TestResult):
    """One record per test id: outcome, first line of the failure, memsave_grads' calls."""

    def __init__(self, counter: _CallCounter | None):
        super().__init__()
        self.counter = counter
        self.records: dict[str, dict] = {}

    def startTest(self, test):
        super().startTest(test)
        if self.counter is not None:
            self.counter.take()
        self.records[test.id()] = {"outcome": "pass", "message": ""}

    def stopTest(self, test):
        super().stopTest(test)
        if self.counter is not None:
            self.records[test.id()]["calls"] = self.counter.take()

    def _fail(self, test, outcome, err):
        record = self.records.setdefault(test.id(), {})
        if record.get("outcome") in ("fail", "error"):
            return  # keep the first failure (of several subtests)
        exc_type, exc, _ = err
        text = " ".join(traceback.format_exception_only(exc_type, exc)).strip()
        text = " ".join(text.split())
        if len(text) > 500:  # a traced function's error ends with the cause
            text = f"{text[:150]} ... {text[-350:]}"
        record.update(outcome=outcome, message=text)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._fail(test, "fail", err)

    def addError(self, test, err):
        super().addError(test, err)
        self._fail(test, "error", err)

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._fail(test, "fail", err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.records[test.id()] = {"outcome": "skip", "message": str(reason)[:200]}

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self.records[test.id()] = {"outcome": "fail", "message": "unexpected success"}


def _set_up_mode(mode: str) -> None:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if mode in ("v1", "v1_cfv2"):
        tf.compat.v1.disable_v2_behavior()
    if mode == "v1_cfv2":
        tf.compat.v1.enable_control_flow_v2()


def run_one(test_path: str, mode: str, strategy: str, only: list[str] | None,
            keep_never_worse: bool) -> dict:
    """Every test of the file in ``mode``, unpatched (``strategy == "none"``) or patched."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from absl import flags, logging  # pylint: disable=import-outside-toplevel
    flags.FLAGS(sys.argv[:1], known_only=True)  # TensorFlow's test utilities read flags
    logging.set_verbosity(logging.ERROR)
    # The fallback warnings are counted, not shown.
    std_logging.getLogger("memsave_grads").setLevel(std_logging.ERROR)
    _set_up_mode(mode)
    spec = importlib.util.spec_from_file_location("tf_gradients_test_under_patch", test_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    if only:
        suite = unittest.TestSuite(t for t in _flatten(suite)
                                   if any(name in t.id() for name in only))
    counter = None
    patch = None
    if strategy != REFERENCE:
        import memsave_grads  # pylint: disable=import-outside-toplevel
        from memsave_grads._tf import selection  # pylint: disable=import-outside-toplevel
        if not keep_never_worse:
            selection.NEVER_WORSE_RULE = False
        counter = _CallCounter()
        patch = memsave_grads.patch(checkpoints=STRATEGIES[strategy])
    recorder = _Recorder(counter)
    start = time.perf_counter()
    try:
        suite.run(recorder)
    finally:
        if patch is not None:
            memsave_grads.unpatch()
    return {"mode": mode, "strategy": strategy, "seconds": round(time.perf_counter() - start, 1),
            "tests": recorder.records}


def _flatten(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _flatten(item)
        else:
            yield item


# --------------------------------------------------------------------------------------------
# Every (mode, strategy), each in its own process, and the regressions


def _launch(args, mode: str, strategy: str, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"{mode}-{strategy}.json")
    command = [sys.executable, os.path.abspath(__file__), args.test_file, "--child",
               "--modes", mode, "--strategies", strategy, "--json", out]
    if args.only:
        command += ["--only", args.only]
    if args.keep_never_worse:
        command.append("--keep-never-worse")
    try:
        proc = subprocess.run(command, capture_output=True, text=True,
                              timeout=PROCESS_TIMEOUT_S, check=False)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        code, tail = "timeout", ""
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            return json.load(f)
    return {"mode": mode, "strategy": strategy, "tests": {}, "crashed": f"{code}: {tail}"}


def regressions(reference: dict, patched: dict) -> dict[str, str]:
    """Test id -> failure message, for tests that pass in ``reference`` and not in
    ``patched`` (a test the patched run never reached counts: it crashed the process)."""
    found = {}
    for test_id, record in reference["tests"].items():
        if record["outcome"] != "pass":
            continue
        ours = patched["tests"].get(test_id)
        if ours is None:
            found[test_id] = "not run (the process ended early)"
        elif ours["outcome"] not in ("pass",):
            found[test_id] = ours["message"] or ours["outcome"]
    return found


def report(results: dict, modes, strategies) -> tuple[str, int]:
    lines = [f"{'mode':8} {'strategy':9} {'tests':>6} {'passed':>7} {'skipped':>8} "
             f"{'rewrote':>8} {'regressions':>12}  seconds"]
    total = 0
    details = []
    for mode in modes:
        reference = results[(mode, REFERENCE)]
        for strategy in (REFERENCE,) + tuple(strategies):
            run = results[(mode, strategy)]
            tests = run["tests"].values()
            passed = sum(t["outcome"] == "pass" for t in tests)
            skipped = sum(t["outcome"] == "skip" for t in tests)
            rewrote = sum(t.get("calls", {}).get("rewrote", 0) > 0 for t in tests)
            if strategy == REFERENCE:
                found = {}
                count = "-"
            else:
                found = regressions(reference, run)
                count = len(found)
                total += count
            lines.append(f"{mode:8} {strategy:9} {len(run['tests']):6} {passed:7} {skipped:8} "
                         f"{rewrote if strategy != REFERENCE else '-':>8} {count:>12}  "
                         f"{run.get('seconds', '?')}")
            if run.get("crashed"):
                details.append(f"{mode}/{strategy}: the process crashed: {run['crashed']}")
            for test_id, message in sorted(found.items()):
                details.append(f"{mode}/{strategy}: {test_id}: {message}")
    lines.append(f"regressions in all: {total}")
    return "\n".join(lines + ([""] + details if details else [])), total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", help="path of TensorFlow's test file (outside this repo)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help=f"comma-separated, of {list(STRATEGIES)} (the unpatched "
                             "reference always runs)")
    parser.add_argument("--only", help="comma-separated substrings of test ids to run")
    parser.add_argument("--jobs", type=int, default=2, help="processes at once")
    parser.add_argument("--json", help="write every outcome here")
    parser.add_argument("--keep-never-worse", action="store_true",
                        help="leave the never-worse rule on (small graphs then fall back)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    strategies = [s for s in args.strategies.split(",") if s and s != REFERENCE]
    unknown = sorted(set(modes) - set(MODES)) + sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"unknown mode or strategy: {unknown}")
    only = args.only.split(",") if args.only else None
    if args.child:
        (strategy,) = strategies or [REFERENCE]
        result = run_one(os.path.abspath(args.test_file), modes[0], strategy, only,
                         args.keep_never_worse)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f)
        return 0
    runs = [(mode, strategy) for mode in modes for strategy in [REFERENCE] + strategies]
    with tempfile.TemporaryDirectory() as out_dir, \
            concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {run: pool.submit(_launch, args, *run, out_dir) for run in runs}
        results = {run: future.result() for run, future in futures.items()}
    text, total = report(results, modes, strategies)
    sys.stdout.write(text + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({f"{m}-{s}": r for (m, s), r in results.items()}, f, indent=1)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
