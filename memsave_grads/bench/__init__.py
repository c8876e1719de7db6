"""The benchmarks behind ``memsave-grads`` (see :mod:`memsave_grads.cli`); the library never
imports them.

- :mod:`~memsave_grads.bench.models`: the models by name (TensorFlow-free, so ``--models`` is
  checked before anything is built);
- :mod:`~memsave_grads.bench.graphs`, :mod:`~memsave_grads.bench.keras_graphs`: the graphs
  they build (raw ops; Keras 2);
- :mod:`~memsave_grads.bench.harness`: one training step per method, measured, and the tables;
- :mod:`~memsave_grads.bench.xla`: the tf.function table without and with ``jit_compile``
  (each model in a fresh process), against ``tf.recompute_grad`` and ``keras.RematScope``;
- :mod:`~memsave_grads.bench.control_flow`: the same blocks plain, in ``tf.cond``, as nested
  functions and in a ``tf.while_loop`` (``benchmark --control-flow``);
- :mod:`~memsave_grads.bench.hub`: keras_hub backbones under Keras 3 ``fit``, stock and
  wrapped, with and without ``jit_compile`` (``benchmark --hub``);
- :mod:`~memsave_grads.bench.tapes`: ``tf.GradientTape`` programs, unrouted and routed
  (``python -m memsave_grads.bench.tapes``);
- :mod:`~memsave_grads.bench.build_time`: gradient construction time against graph size
  (``build-time``);
- :mod:`~memsave_grads.bench.solvers`: the budget solvers compared on small graphs;
- :mod:`~memsave_grads.bench.fit_limit_models`: the README headline's Keras models, as a user
  hands them to ``fit-limit``;
- :mod:`~memsave_grads.bench.commands`: the command line's subcommands, built from the above
  and, for ``explain`` and ``fit-limit``, from the library's features
  (:mod:`memsave_grads._explain`, :mod:`memsave_grads.fit_limit`, which are not benchmarks).

Imports run one way: commands -> harness, xla, control_flow, hub, build_time, solvers ->
models -> graphs, keras_graphs.
"""
