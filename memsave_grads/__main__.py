"""``python -m memsave_grads``: the command line of :mod:`memsave_grads.cli`.

``run`` is also the ``memsave-grads`` console script (pyproject.toml ``[project.scripts]``).
"""

import sys

from memsave_grads.cli import run

if __name__ == "__main__":
    sys.exit(run())
