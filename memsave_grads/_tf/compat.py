"""Which TensorFlow we work with, checked before any TensorFlow-facing module imports it.

memsave_grads has no hard dependency on a TensorFlow wheel (TensorFlow Probability's approach):
``tensorflow``, ``tensorflow-cpu``, ``tensorflow[and-cuda]``, ``tf-nightly`` and vendor builds
all provide the same ``tensorflow`` package, and depending on one of them would make pip install
it next to another, the two overwriting each other's files. Instead :func:`require_tensorflow`
runs when a TensorFlow-facing module is first imported (``memsave_grads._tf`` and the lazy
public names; never on ``import memsave_grads``) and says what is missing and how to get it.

The range is where our private TensorFlow APIs (``memsave_grads/_tf``) are tested: the oldest
TensorFlow ``scripts/test_tf_versions.sh`` passed on, up to (not including) the next minor
after the newest one CI runs. ``tests/test_packaging.py`` is the canary for a new version.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys

from memsave_grads.errors import MissingDependencyError

#: This module's messages: a child of the ``memsave_grads`` logger.
_LOG = logging.getLogger(__name__)

#: Oldest TensorFlow the package is tested on (inclusive), as (major, minor).
MIN_TF_VERSION = (2, 16)
#: First TensorFlow minor not tested yet (exclusive): private APIs may change in any minor.
MAX_TF_VERSION_EXCLUSIVE = (2, 22)


def _version_text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


#: Set to 1 to run on a TensorFlow older than MIN_TF_VERSION anyway (with a warning): for
#: scripts/test_tf_versions.sh, which probes older versions, and at the user's own risk.
ALLOW_OLD_TF_ENV = "MEMSAVE_GRADS_ALLOW_OLD_TENSORFLOW"
#: The supported range as a pip specifier (pyproject.toml's extras state the same range).
SUPPORTED_RANGE = f">={_version_text(MIN_TF_VERSION)},<{_version_text(MAX_TF_VERSION_EXCLUSIVE)}"
#: What to tell a user to install; ``[cpu]``/``[gpu]``/``[tf]`` are this package's extras.
INSTALL_HINT = ('pip install "memsave-grads[cpu]" (tensorflow-cpu), "memsave-grads[gpu]" '
                '(tensorflow[and-cuda]) or "memsave-grads[tf]" (tensorflow); or any TensorFlow '
                f'wheel in the supported range, e.g. pip install "tensorflow-cpu{SUPPORTED_RANGE}"')


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a TensorFlow version string: '2.21.0', '2.22.0-dev20260101',
    '2.22.0.dev20260101' (tf-nightly), '2.16.1+cpu'. Raises ValueError if it has none."""
    match = re.match(r"\s*(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return int(match.group(1)), int(match.group(2))


def installed_tensorflow_version() -> str | None:
    """The version of the installed ``tensorflow`` package, or None if there is none.

    Read from the wheel's metadata when we can (no TensorFlow import, which takes seconds):
    whichever distribution provides the top-level ``tensorflow`` package. A source build or a
    TensorFlow already imported answers with ``tf.__version__`` instead.
    """
    module = sys.modules.get("tensorflow")
    if module is not None and hasattr(module, "__version__"):
        return module.__version__
    try:
        if importlib.util.find_spec("tensorflow") is None:
            return None
    except (ImportError, ValueError):  # an import hook hides it, or sys.modules holds None
        return None
    for distribution in importlib.metadata.packages_distributions().get("tensorflow", ()):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    import tensorflow  # pylint: disable=import-outside-toplevel  # no metadata: a source build
    return tensorflow.__version__


def check_version(version: str | None) -> None:
    """Raise MissingDependencyError unless ``version`` (of TensorFlow) is one we can run on.

    Newer than the tested range only logs a warning: nightly builds are welcome, and
    ``pytest tests/test_packaging.py`` tells whether a private API we use has changed.
    """
    if version is None:
        raise MissingDependencyError(
            f"memsave_grads needs TensorFlow {SUPPORTED_RANGE}, but no 'tensorflow' package is "
            f"installed in {sys.prefix}. Remedy: {INSTALL_HINT}.")
    try:
        found = parse_version(version)
    except ValueError:
        _LOG.warning("TensorFlow reports version %r, which we cannot parse; supported: %s",
                     version, SUPPORTED_RANGE)
        return
    if found < MIN_TF_VERSION and os.environ.get(ALLOW_OLD_TF_ENV) == "1":
        _LOG.warning("TensorFlow %s is older than the supported %s; running anyway (%s=1)",
                     version, SUPPORTED_RANGE, ALLOW_OLD_TF_ENV)
    elif found < MIN_TF_VERSION:
        raise MissingDependencyError(
            f"memsave_grads needs TensorFlow {SUPPORTED_RANGE}, but TensorFlow {version} is "
            "installed, older than the oldest we test on. Remedy: upgrade the TensorFlow wheel "
            "you have (the same one, not a second), e.g. "
            f'pip install -U "tensorflow{SUPPORTED_RANGE}" or '
            f'pip install -U "tensorflow-cpu{SUPPORTED_RANGE}" (or set {ALLOW_OLD_TF_ENV}=1 '
            "to try it anyway).")
    if found >= MAX_TF_VERSION_EXCLUSIVE:
        _LOG.warning(
            "TensorFlow %s is newer than the versions memsave_grads is tested on (%s): private "
            "graph APIs may have changed; `pytest tests/test_packaging.py` from the source tree "
            "checks them.", version, SUPPORTED_RANGE)


@functools.cache
def require_tensorflow() -> str:
    """Check the installed TensorFlow once per process; return its version string."""
    version = installed_tensorflow_version()
    check_version(version)
    return version
