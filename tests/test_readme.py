"""The README's Python examples run as written, each in a fresh process, and each really goes
through memsave_grads (a plan rewritten, or a recomputed step's gradient built): the front
page stays true."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)

#: Run before a block: counts the rewrites (api.run_plan) and recomputed steps' gradients
#: (recomputation._backward), and prints the count when the process ends.
COUNTING = """
import atexit
from memsave_grads import api, recomputation
_calls = [0]
def _counting(function):
    def counted(*args, **kwargs):
        _calls[0] += 1
        return function(*args, **kwargs)
    return counted
api.run_plan = _counting(api.run_plan)
recomputation._backward = _counting(recomputation._backward)
atexit.register(lambda: print("MEMSAVE_REWRITES", _calls[0]))
"""


def test_the_readme_has_its_four_ways_in():
    assert len(BLOCKS) == 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_example_runs_through_memsave_grads(index, tmp_path):
    # From a file, as a user runs it: AutoGraph reads the source of the loops it converts.
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(COUNTING + BLOCKS[index])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewrites = int(re.search(r"MEMSAVE_REWRITES (\d+)", proc.stdout).group(1))
    assert rewrites > 0, f"block {index} never went through memsave_grads:\n{BLOCKS[index]}"
    assert "saves no memory" not in proc.stderr, proc.stderr[-3000:]
