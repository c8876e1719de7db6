"""Run a snippet of Python in a fresh process and read the JSON it prints last.

For what one process cannot show: peaks measured with the allocator's history wiped, and
settings TensorFlow reads once per process (``TF_ENABLE_ONEDNN_OPTS``).
"""

import json
import os
import subprocess
import sys

#: Switches the allocator's statistics on (before TensorFlow is imported).
ALLOCATOR_PREAMBLE = "import os\nos.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'\n"
#: The same, and one large heap region reserved first, so that later allocations split to size
#: (``measure.reserve_cpu_heap``).
MEASURING_PREAMBLE = (ALLOCATOR_PREAMBLE +
                      "from memsave_grads import measure\nmeasure.reserve_cpu_heap()\n")


def run_json(code: str, *args: str, env: dict | None = None,
             preamble: str = MEASURING_PREAMBLE) -> dict:
    """Run ``preamble + code`` with ``args`` in a fresh Python (``env`` added to this
    process's environment); the JSON object it prints on its last line."""
    proc = subprocess.run([sys.executable, "-c", preamble + code, *args], capture_output=True,
                          text=True, check=False,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {})))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
