"""Checkpoint policies: small named predicates that decide, from strings, whether to keep a
forward tensor for the backward pass.

A policy looks at one op at a time, by its *type* or its *name*, never at the graph around it
(that is the planners' job), so a strategy reads as a sentence, as in JAX's
``jax.checkpoint_policies`` (``checkpoint_dots`` keeps the results of matrix products):

- ``checkpoints="speed"`` keeps what :func:`keeps_for_speed` says: the outputs of ops that run a
  matmul, convolution or einsum; the cheap elementwise ops between them are recomputed.
- ``checkpoints=["block*/add"]`` keeps the outputs :func:`matches_tensor` matches; a pattern is
  checked first with :func:`pattern_error`, so a typo is reported before any op is added.

TensorFlow-free: the facts about op types live in :mod:`memsave_grads.core.op_types`.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Iterable

from memsave_grads.core import op_types


def keeps_for_speed(op_types_run: Iterable[str]) -> bool:
    """The ``"speed"`` policy: keep an op's outputs when it runs an expensive op type
    (:data:`op_types.EXPENSIVE_OP_TYPES`).

    ``op_types_run`` is the op's own type and, for a function call, the types of the ops the
    function runs: a Keras grouped convolution is a call of a function holding the Conv2D.
    """
    return any(op_types.is_expensive_op_type(op_type) for op_type in op_types_run)


_PATTERN_OK = re.compile(r"^[^\s]+$")


def pattern_error(pattern: object) -> str | None:
    """Why ``pattern`` is not a usable name pattern, or ``None`` when it is."""
    if not isinstance(pattern, str):
        return f"expected a str, got {type(pattern).__name__}"
    if not pattern:
        return "the pattern is empty"
    if not _PATTERN_OK.match(pattern):
        return "the pattern contains whitespace, which never occurs in TensorFlow names"
    if pattern.count(":") > 1:
        return "a pattern holds at most one ':' (before an output index, as in 'dense/Relu:0')"
    if pattern.count("[") != pattern.count("]"):
        return "unbalanced '[' ']' in the pattern"
    return None


def matches_tensor(pattern: str, op_name: str, output_index: int) -> bool:
    """Name-pattern rule (documented in docs/usage.md).

    Patterns are shell-style globs (``fnmatch``, case-sensitive) matched against the *whole*
    name. A pattern with a ``:`` is matched against the tensor name (``"block3/add:0"``);
    a pattern without one is matched against the op name (``"block*/add"``), selecting every
    output of the matching ops.
    """
    if ":" in pattern:
        return fnmatch.fnmatchcase(f"{op_name}:{output_index}", pattern)
    return fnmatch.fnmatchcase(op_name, pattern)
