"""Everything that touches TensorFlow internals (docs/design.md, "Layout and the layering rule").

Importing this package checks the installed TensorFlow first (:mod:`memsave_grads._tf.compat`):
memsave_grads depends on no TensorFlow wheel, so a missing or too old TensorFlow is reported
here, with the remedy, rather than as an AttributeError deep in a private module.
"""

from memsave_grads._tf import compat

compat.require_tensorflow()
