"""The command line: ``memsave-grads <command> [options]`` (or ``python -m memsave_grads``).

It compares ``tf.gradients`` with ``memsave_grads`` on peak memory, time and accuracy; the
tables in README.md and docs/ come from its subcommands (implemented in
:mod:`memsave_grads.bench.commands`). ``memsave-grads --help`` lists them, ``memsave-grads
<command> --help`` shows one command's options and their defaults.

Parsing happens before TensorFlow is imported, for two reasons:

* speed: ``--help``, ``--version`` and usage errors import neither TensorFlow nor Keras nor
  the benchmark (``import memsave_grads`` is lazy, and :mod:`memsave_grads.core` is
  TensorFlow-free), and every argument is checked, ``--models`` against the model names
  included, before any model is built;
* the allocator: peaks on CPU need ``TF_CPU_ALLOCATOR_USE_BFC=true`` in the environment before
  TensorFlow is imported (the allocator reads it once, at start-up). :func:`main` sets it, with
  ``TF_CPP_MIN_LOG_LEVEL=2`` unless the user chose a level, and only then imports the commands.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import warnings
from typing import Callable, Sequence

from memsave_grads import __version__
from memsave_grads import errors
from memsave_grads import measure
from memsave_grads.core import budgets

PROG = "memsave-grads"

#: The ``checkpoints=`` strategy names, for validating ``explain --checkpoints`` without
#: importing TensorFlow. Kept equal to ``memsave_grads._tf.selection.STRATEGIES`` by
#: tests/test_cli.py.
STRATEGY_NAMES = ("collection", "memory", "speed")
#: ``explain --model``'s batch size where ``--batch`` is not given: the library's own
#: (``_explain.EXPLAINED_BATCH_SIZE``), kept equal by tests/test_cli.py without importing
#: TensorFlow here.
EXPLAIN_BATCH = 32

#: TensorFlow's C++ log level unless the user set one: 2 hides INFO and WARNING start-up lines
#: (oneDNN, CPU features) and keeps errors.
TF_LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
QUIET_TF_LOG_LEVEL = "2"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit status 2."""

    def __init__(self, *args, **kwargs):
        # Room for "benchmark" and "--fractions F,F,..." beside their help.
        kwargs.setdefault("formatter_class",
                          lambda prog: argparse.HelpFormatter(prog, max_help_position=30))
        kwargs.setdefault("allow_abbrev", False)  # "--dep" is a typo, not --depth
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


# --------------------------------------------------------------------------------------------
# Argument types: each raises ArgumentTypeError, which argparse reports as
# "argument --flag: <message>".
# --------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _fractions(text: str) -> list[float]:
    """``0.75,0.5``: budgets as fractions of tf.gradients' predicted peak, each in (0, 1]."""
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = float("nan")
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated fractions in (0, 1] such as '0.75,0.5', got {item!r} "
                f"in {text!r}")
        values.append(value)
    return values


#: The graph families of ``build-time`` (memsave_grads.bench.build_time.FAMILIES).
_BUILD_FAMILIES = ("residual", "transformer", "convnet")


def _build_families(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in _BUILD_FAMILIES]
    if not items or unknown:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated families of {', '.join(_BUILD_FAMILIES)}, got "
            f"{', '.join(map(repr, unknown)) or repr(text)}")
    return items


def _sizes(text: str) -> list[int]:
    return [_positive_int(item.strip()) for item in text.split(",")]


def _model_filter(catalogue: str, with_hub: bool = False) -> Callable[[str], list[str]]:
    """A type for ``--models``: comma-separated name substrings, each matching a model of
    ``memsave_grads.bench.models.<catalogue>()`` or, ``with_hub``, a keras_hub architecture of
    ``benchmark --hub`` (names only: nothing is built)."""
    def parse(text: str) -> list[str]:
        from memsave_grads.bench import models  # pylint: disable=import-outside-toplevel
        filters = [item.strip() for item in text.split(",") if item.strip()]
        candidates = getattr(models, catalogue)()
        if with_hub:
            from memsave_grads.bench import hub  # pylint: disable=import-outside-toplevel
            candidates += list(hub.ARCHITECTURES)
        unmatched = models.unmatched_filters(candidates, filters)
        if not filters or unmatched:
            names = ", ".join(spec.name for spec in candidates)
            raise argparse.ArgumentTypeError(
                f"expected comma-separated substrings of model names (case-insensitive; one of: "
                f"{names}), got {', '.join(map(repr, unmatched)) or repr(text)}")
        return filters
    return parse


def _checkpoints(text: str) -> str:
    """A strategy name or a budget string, checked without TensorFlow."""
    if budgets.is_budget_string(text):
        try:
            budgets.Budget.parse(text)
        except errors.MemsaveGradsError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("checkpoints: ")) from None
    elif text not in STRATEGY_NAMES:
        raise argparse.ArgumentTypeError(
            f"expected a strategy ({', '.join(STRATEGY_NAMES)}) or a budget such as "
            f"'budget:50%' or 'budget:4GiB', got {text!r}")
    return text


def _checkpoints_list(text: str) -> list[str]:
    """Comma-separated strategies or budgets, each checked as ``--checkpoints``."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected one or more strategies, got {text!r}")
    return [_checkpoints(item) for item in items]


def _model_source(text: str) -> str:
    """A model the fit-limit and explain commands can load (checked without loading it)."""
    from memsave_grads import fit_limit  # pylint: disable=import-outside-toplevel
    try:
        fit_limit.describe_source(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _writable_path(text: str) -> str:
    """A file to write at the end of a long run: its folder must exist now."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"expected a file in an existing folder, got {text!r} ({folder} does not exist)")
    return text


def _plot_path(text: str) -> str:
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            f"writing the plot {text!r} needs matplotlib, which is not installed: pip install "
            "'memsave-grads[bench]' (or pip install matplotlib)")
    from matplotlib import figure  # pylint: disable=import-outside-toplevel  # not TensorFlow
    suffixes = sorted(figure.Figure().canvas.get_supported_filetypes())
    if text.rpartition(".")[2].lower() not in suffixes:
        raise argparse.ArgumentTypeError(
            f"expected a file name ending in an image format matplotlib writes "
            f"({', '.join('.' + s for s in suffixes)}), got {text!r}")
    return _writable_path(text)


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------


def _add_repeats(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=_positive_int, default=3, metavar="N",
                        help="timed training steps per method, after one warm-up step; the "
                             "median is reported (default: %(default)s)")


def _add_models(parser: argparse.ArgumentParser, default: str = "all",
                catalogue: str = "benchmark_models", with_hub: bool = False) -> None:
    parser.add_argument("--models", type=_model_filter(catalogue, with_hub), default=[],
                        metavar="NAMES",
                        help="only the models whose name contains one of these comma-separated "
                             "substrings (case-insensitive), e.g. 'resnet,tanh' "
                             f"(default: {default})")


def _add_fractions(parser: argparse.ArgumentParser,
                   default: Sequence[float] = (0.75, 0.5, 0.35)) -> None:
    parser.add_argument("--fractions", type=_fractions, default=list(default),
                        metavar="F,F,...",
                        help="budgets as fractions of tf.gradients' predicted peak "
                             f"(default: {','.join(str(f) for f in default)})")


def _add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=_writable_path, metavar="FILE",
                        help="also write the tables to this markdown file")


def _add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("markdown", "json"), default="markdown",
                        help="markdown tables for people, or one JSON object with the raw "
                             "numbers (bytes, seconds) for programs (default: %(default)s)")


def _add_plot(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--plot", type=_plot_path, metavar="FILE",
                        help=f"write {what} to this PNG file (needs matplotlib)")


#: (name, one-line help, description) of each subcommand, in the order --help lists them.
_COMMANDS = (
    ("demo", "one SGD step of a deep residual MLP, tf.gradients vs memsave_grads, as a table",
     "One SGD step of a deep residual MLP (h = h + tanh(h @ W_i)) in a tf.compat.v1 Session, "
     "with tf.gradients and with memsave_grads 'memory' (the default strategy), timed in "
     "turns. Prints a markdown table of peak memory, median step time and gradient error."),
    ("benchmark", "the same measurements over model-scale networks",
     "The demo's measurements over model-scale networks: Keras 2 (tf_keras) ResNet50, "
     "DenseNet121, MobileNetV2, a U-Net and a Transformer encoder stack, a deep residual MLP, "
     "a tanh MLP chain and a small conv ResNet, with the predicted peak of the static memory "
     "model; then, under XLA, the Transformer, the MLPs and the conv ResNet in tf.function "
     "with and without jit_compile, against tf.recompute_grad and keras.RematScope. Progress "
     "on stderr, the "
     "tables on stdout. Needs: pip install 'memsave-grads[bench]'."),
    ("scaling", "peak memory vs depth, and the rewrite time of large graphs",
     "Peak memory vs depth of the residual MLP family (8..256 blocks), tf.gradients vs "
     "'memory', as a table (and a PNG with --plot); then the rewrite time of a 1,000-layer "
     "chain and of every --models Keras graph against plain tf.gradients graph construction."),
    ("explain", "the plan a strategy makes for each network (builds graphs, runs nothing)",
     "The plan 'memory' (or --checkpoints) makes for each --models network, or for your "
     "Keras model with --model (a training step of --batch examples): checkpoints, "
     "segments, predicted peak vs tf.gradients. Builds graphs only; runs nothing."),
    ("budgets", "measured peak and step time under memory budgets",
     "One training step of each --models network under memory budgets of --fractions of "
     "tf.gradients' predicted peak: measured peak against the budget taken from tf.gradients' "
     "*measured* peak, step-time overhead, solve time."),
    ("tradeoff", "the Pareto front of peak memory vs recomputed FLOPs",
     "The Pareto front of predicted peak vs recomputed FLOPs across budgets for each --models "
     "network, as a table (and, with --plot, a PNG with measured points at --fractions)."),
    ("fit-limit", "the largest batch of YOUR model that trains within a memory limit",
     "How much larger can your model train? Finds the largest batch (or, with --vary "
     "sequence, sequence length) that trains within --limit-mib, with tf.gradients and with "
     "each --checkpoints strategy: every try is a fresh process with its allocator capped "
     "(CPU: TF_CPU_BFC_MEM_LIMIT_IN_MB; GPU: a logical device's memory_limit); the search "
     "doubles, then bisects. MODEL: a .keras file, a tf_keras SavedModel folder, or "
     "module:function / file.py:function called with batch_size (and sequence_length) that "
     "returns a compiled Keras model, (model, (x, y)), or a training-step callable that uses "
     "tf.gradients. A progress line per try on stderr, a table on stdout, a PNG with --plot."),
    ("solvers", "the greedy budget solver against the exact ones on small graphs",
     "The greedy heuristic against the exact solvers (dp, milp) on graphs of <= 200 ops: "
     "recompute cost at each budget, relative to the best plan found, and solve times. With "
     "--models, the greedy solver alone on those benchmark networks at --fractions: its "
     "recomputed share of the forward FLOPs, planning seconds and its bound on plans scored."),
    ("build-time", "gradient construction time against graph size",
     "The CPU time to build the gradients of residual MLPs, Transformer encoders and conv "
     "ResNets of growing size (up to about 50 000 graph ops) with tf.gradients and with each "
     "--checkpoints strategy (planning and rewrite), built in turns, best of --rounds; each "
     "as a ratio to tf.gradients. --format json: the CPU seconds of every method."),
)


def _add_options(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "demo":
        parser.add_argument("--depth", type=_positive_int, default=64, metavar="N",
                            help="residual blocks (default: %(default)s)")
        parser.add_argument("--width", type=_positive_int, default=1024, metavar="N",
                            help="units per layer (default: %(default)s)")
        parser.add_argument("--batch", type=_positive_int, default=256, metavar="N",
                            help="batch size (default: %(default)s)")
        _add_repeats(parser)
    elif name == "benchmark":
        _add_repeats(parser)
        _add_models(parser, with_hub=True)
        _add_output(parser)
        _add_format(parser)
        parser.add_argument("--xla", choices=("with", "without", "only"), default="with",
                            help="the table under XLA (tf.function with and without "
                                 "jit_compile, against tf.recompute_grad and "
                                 "keras.RematScope): with the graph table, without it, or "
                                 "only it (default: %(default)s)")
        parser.add_argument("--control-flow", choices=("with", "without", "only"),
                            default="without",
                            help="the control-flow table (the same blocks plain, in a tf.cond "
                                 "each, as nested tf.functions and in one tf.while_loop, "
                                 "tf.gradients against 'memory', a fresh process per cell): "
                                 "with the other tables, without it, or only it "
                                 "(default: %(default)s)")
        parser.add_argument("--hub", choices=("with", "without", "only"), default="without",
                            help="the keras_hub table (GPT-2, Llama, Gemma, Qwen3-MoE, BERT "
                                 "and T5 backbones from small configurations, Keras 3 fit "
                                 "stock and under wrap_model, with and without jit_compile, a "
                                 "fresh process per cell; needs keras-hub): with the other "
                                 "tables, without it, or only it (default: %(default)s)")
    elif name == "scaling":
        _add_models(parser, default="all Keras networks", catalogue="keras_models")
        _add_plot(parser, "the peak-vs-depth plot")
        _add_output(parser)
    elif name == "explain":
        _add_models(parser)
        parser.add_argument("--model", type=_model_source, metavar="MODEL",
                            help="explain this Keras model instead (as fit-limit's MODEL) "
                                 "for a batch of --batch")
        # Default None, so that --batch given without --model is told apart and refused (the
        # benchmark networks' batch is their own); 32 where --model is given.
        parser.add_argument("--batch", type=_positive_int, metavar="N",
                            help=f"with --model: the batch size (default: {EXPLAIN_BATCH})")
        parser.add_argument("--sequence-length", type=_positive_int, metavar="N",
                            help="with --model: fills unknown input dimensions")
        parser.add_argument("--checkpoints", type=_checkpoints, default="memory",
                            metavar="STRATEGY",
                            help="the strategy to explain: "
                                 f"{', '.join(STRATEGY_NAMES)} or a budget such as "
                                 "'budget:50%%' (default: %(default)s)")
        _add_format(parser)
    elif name == "budgets":
        _add_models(parser)
        _add_fractions(parser)
        parser.add_argument("--calibrate", action="store_true",
                            help="calibrate each budget on the measured step first "
                                 "(memsave_grads.calibrate_budget), then measure its plan")
        _add_repeats(parser)
        _add_output(parser)
    elif name == "tradeoff":
        _add_models(parser, default="ResNet50")
        _add_fractions(parser)
        _add_repeats(parser)
        _add_plot(parser, "the front and the measured points")
        _add_output(parser)
    elif name == "fit-limit":
        parser.add_argument("model", type=_model_source, metavar="MODEL",
                            help="a .keras file, a tf_keras SavedModel folder, or "
                                 "module:function / path/to/file.py:function")
        parser.add_argument("--limit-mib", type=_positive_int, required=True, metavar="MIB",
                            help="the memory limit of every try, in MiB")
        parser.add_argument("--checkpoints", type=_checkpoints_list, default=["memory"],
                            metavar="S[,S...]",
                            help="the strategies to try besides tf.gradients "
                                 "(default: memory)")
        parser.add_argument("--keras-remat", action="store_true",
                            help="also try Keras 3's own keras.RematScope(mode='full')")
        parser.add_argument("--release-gradients-early", action="store_true",
                            help="also try each strategy with wrap_model(..., "
                                 "release_gradients_early=True) (Keras models)")
        parser.add_argument("--vary", choices=("batch", "sequence"), default="batch",
                            help="what to grow: the batch, or the sequence length at a fixed "
                                 "--batch (the function then takes sequence_length) "
                                 "(default: %(default)s)")
        parser.add_argument("--batch", type=_positive_int, default=8, metavar="N",
                            help="the batch size with --vary sequence (default: %(default)s)")
        parser.add_argument("--start", type=_positive_int, default=8, metavar="N",
                            help="the first size tried (default: %(default)s)")
        parser.add_argument("--max", type=_positive_int, default=4096, metavar="N",
                            help="the largest size tried (default: %(default)s)")
        parser.add_argument("--steps", type=_positive_int, default=3, metavar="N",
                            help="measured steps per try, after one warm-up step "
                                 "(default: %(default)s)")
        parser.add_argument("--tries", type=_positive_int, default=1, metavar="K",
                            help="fresh processes per size: a size fits only if all K fit "
                                 "(near the limit one try can fit and the next run out; "
                                 "K=3 makes a lucky answer less likely, for up to K times "
                                 "the tries) "
                                 "(default: %(default)s)")
        parser.add_argument("--reserve-limit", action="store_true",
                            help="CPU: take the whole limit as one allocator region before "
                                 "the model loads, as TensorFlow does on a GPU without memory "
                                 "growth (without it the CPU allocator grows in regions of "
                                 "doubling size, and a tensor cannot span two)")
        _add_plot(parser, "peak memory against size, per method")
        _add_output(parser)
        _add_format(parser)
    elif name == "build-time":
        parser.add_argument("--families", type=_build_families, default=list(_BUILD_FAMILIES),
                            metavar="F[,F...]",
                            help=f"graph families, of {', '.join(_BUILD_FAMILIES)} "
                                 "(default: all)")
        parser.add_argument("--sizes", type=_sizes, default=None, metavar="N[,N...]",
                            help="sizes (blocks or layers) of every family (default: each "
                                 "family's own, up to about 50 000 graph ops)")
        parser.add_argument("--checkpoints", type=_checkpoints_list,
                            default=["memory", "budget:50%"], metavar="S[,S...]",
                            help="the strategies built besides tf.gradients "
                                 "(default: memory,budget:50%%)")
        parser.add_argument("--rounds", type=_positive_int, default=3, metavar="N",
                            help="builds of each method, in turns; the best counts "
                                 "(default: %(default)s)")
        _add_output(parser)
        _add_format(parser)
    elif name == "solvers":
        from memsave_grads.bench import models  # pylint: disable=import-outside-toplevel
        _add_models(parser, default="the small graphs, all solvers")
        _add_fractions(parser, default=models.SOLVER_FRACTIONS)
        _add_output(parser)


def _add_verbose(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="also memsave_grads' debug messages: per gradients call, the "
                             "forward ops, checkpoints and recomputed ops per level (of this "
                             "process: fit-limit's tries run in processes of their own)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``memsave-grads``: one subparser per command (cheap: imports nothing)."""
    parser = _Parser(
        prog=PROG,
        description="Compare tf.gradients with memsave_grads on peak memory, time and accuracy.",
        epilog=f"'{PROG} COMMAND --help' shows a command's options. Peak memory on CPU needs "
               f"{measure.CPU_BFC_ENV}=true before TensorFlow is imported: the command sets it, "
               f"and {TF_LOG_LEVEL_ENV}={QUIET_TF_LOG_LEVEL} unless you set a level.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    _add_verbose(parser, default=0)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands",
                                       parser_class=_Parser)
    for name, summary, description in _COMMANDS:
        command = subparsers.add_parser(name, help=summary, description=description)
        _add_options(name, command)
        _add_verbose(command, default=argparse.SUPPRESS)  # "demo -v" as "-v demo"
    parser.command_parsers = subparsers.choices  # so an unknown option is reported by its command
    return parser


# --------------------------------------------------------------------------------------------
# Running a command
# --------------------------------------------------------------------------------------------


#: Commands that measure peaks in this process (the allocator's statistics). The others build
#: graphs only (explain, solvers, build-time) or measure in processes of their own (fit-limit).
_MEASURES_PEAKS_HERE = frozenset({"demo", "benchmark", "scaling", "budgets", "tradeoff"})


def _prepare_environment(command: str) -> dict[str, str | None]:
    """Set the allocator switch (and quiet TensorFlow's C++ start-up logs) before TensorFlow
    is imported; if it already was and ``command`` measures peaks here, warn that they cannot
    be measured, and go on. Returns the variables' values before, for :func:`main` to put
    back (a caller of ``main()`` in its own process keeps its environment)."""
    before = {name: os.environ.get(name) for name in (measure.CPU_BFC_ENV, TF_LOG_LEVEL_ENV)}
    if ("tensorflow" in sys.modules and os.environ.get(measure.CPU_BFC_ENV) != "true"
            and command in _MEASURES_PEAKS_HERE):
        warnings.warn(
            f"TensorFlow was imported before {measure.CPU_BFC_ENV}=true was set, so the CPU "
            "allocator keeps no statistics and peak memory cannot be measured (commands that "
            "measure peaks will raise AllocatorStatsUnavailableError). Run the command in a "
            f"fresh process, or set {measure.CPU_BFC_ENV}=true before importing TensorFlow.",
            RuntimeWarning, stacklevel=3)
    os.environ[measure.CPU_BFC_ENV] = "true"
    os.environ.setdefault(TF_LOG_LEVEL_ENV, QUIET_TF_LOG_LEVEL)
    return before


def _restore_environment(before: dict[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


#: A line of TensorFlow's C++ logging: severity letter, date, time (before absl is initialised
#: "00:00:<epoch seconds>"), thread, file:line.
_TF_LOG_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ [^\s\]]+:\d+\] ")
#: absl (C++) prints this before its first message when TensorFlow's libraries load.
_ABSL_PRE_INIT_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called"
#: Logged as an error on every machine without a GPU driver; it says no more than the INFO line
#: "Could not find cuda drivers" before it, so it counts as INFO.
_NO_GPU_DRIVER_ERROR = "failed call to cuInit"
#: TF_CPP_MIN_LOG_LEVEL (0..3) -> the severities it hides (TensorFlow's meaning of the variable).
_HIDDEN_SEVERITIES = ("", "I", "IW", "IWE")


def _hidden_severities() -> frozenset[str]:
    try:
        level = int(os.environ.get(TF_LOG_LEVEL_ENV, "0"))
    except ValueError:
        level = 0
    return frozenset(_HIDDEN_SEVERITIES[min(max(level, 0), 3)])


def _severity(line: str) -> str:
    """"I", "W", "E" or "F" for a line of TensorFlow's C++ logging, "" for any other line."""
    if line.startswith(_ABSL_PRE_INIT_NOTICE):
        return "W"
    match = _TF_LOG_LINE.match(line)
    if match is None:
        return ""
    if _NO_GPU_DRIVER_ERROR in line:
        return "I"
    return match.group(1)


@contextlib.contextmanager
def _start_up_noise_filtered():
    """Apply TF_CPP_MIN_LOG_LEVEL to what TensorFlow's libraries print while they load.

    They log through absl before it is initialised, which ignores the level: under the
    default of this command (2), every import printed "Could not find cuda drivers" INFO lines
    twice on a machine without a GPU. Everything written to file descriptor 2 meanwhile is
    held and written back afterwards, less the lines of the hidden severities (and absl's
    notice about them): errors, Python warnings and tracebacks all pass.
    """
    hidden = _hidden_severities()
    sys.stderr.flush()
    try:
        saved_fd = os.dup(2) if hidden else None
    except OSError:  # no file descriptor 2 to redirect
        saved_fd = None
    if saved_fd is None:  # nothing to hide, or no way to: leave the output alone
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if _severity(line) not in hidden:
                    sys.stderr.write(line)
            sys.stderr.flush()


def _require_tensorflow(parser: argparse.ArgumentParser) -> None:
    """Exit with status 2 and one line saying what to install where TensorFlow is missing or
    too old (memsave_grads/_tf/compat.py decides, from the wheel's metadata, without importing
    it), rather than with a traceback from the first ``import tensorflow``."""
    try:
        importlib.import_module("memsave_grads._tf")  # checks the installed TensorFlow
    except errors.MissingDependencyError as e:
        parser.exit(2, f"{PROG}: error: {e}\n")


def _import_tensorflow() -> None:
    """Import TensorFlow here, once the environment is set, with its start-up noise filtered
    (a later import by the commands then finds it loaded)."""
    if "tensorflow" not in sys.modules:
        with _start_up_noise_filtered():
            import tensorflow  # pylint: disable=import-outside-toplevel
            # Finding the devices ends the start-up: on a machine without a GPU driver it is
            # what logs cuInit's failure (see _severity).
            tensorflow.config.list_physical_devices()


#: What the command's own lines look like on stderr: severity, time, the module, the message.
_LOG_FORMAT = "%(levelname).1s%(asctime)s %(name)s] %(message)s"
#: TF_CPP_MIN_LOG_LEVEL (0..3) -> the lowest level TensorFlow's Python logger shows, so that its
#: Python messages (deprecations...) follow the same setting as its C++ ones.
_TF_PYTHON_LEVELS = (logging.INFO, logging.WARNING, logging.ERROR, logging.FATAL)


@contextlib.contextmanager
def _logging_to_stderr(verbose: int):
    """While a command runs, the ``memsave_grads`` logger's messages go to stderr, progress
    (INFO) included, debug with ``-v``; TensorFlow's Python logger shows what
    TF_CPP_MIN_LOG_LEVEL lets through. Both loggers are as they were afterwards (``main``
    also runs inside other programs and tests).

    One handler each, and neither propagates to the root logger: absl's handler (on the root
    once absl's logging is used) printed TensorFlow's deprecation warnings a second time."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT, datefmt="%m%d %H:%M:%S"))
    try:
        tf_level = int(os.environ.get(TF_LOG_LEVEL_ENV, "0"))
    except ValueError:
        tf_level = 0
    ours = logging.getLogger("memsave_grads")
    # TensorFlow gives its logger a handler of its own on first use (tf.get_logger()); asked
    # now, that happens before the state is saved, not during the command.
    theirs = sys.modules["tensorflow"].get_logger() if "tensorflow" in sys.modules else (
        logging.getLogger("tensorflow"))
    saved = [(logger, logger.handlers[:], logger.level, logger.propagate)
             for logger in (ours, theirs)]
    ours.handlers[:] = [handler]
    ours.setLevel(logging.DEBUG if verbose else logging.INFO)
    theirs.setLevel(_TF_PYTHON_LEVELS[min(max(tf_level, 0), 3)])
    if not theirs.handlers:
        theirs.handlers[:] = [handler]
    ours.propagate = theirs.propagate = False
    try:
        yield
    finally:
        for logger, handlers, level, propagate in saved:
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit status.

    Usage errors exit with status 2 (``SystemExit``) before anything is imported or built.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"expected a command, one of {', '.join(n for n, _, _ in _COMMANDS)}; "
                     "got none")
    if unknown:
        parser.command_parsers[args.command].error(
            f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "explain" and args.model and args.models:
        parser.command_parsers[args.command].error(
            "argument --models: explains the benchmark networks; with --model (a model of "
            f"yours) leave it out, got --models {','.join(args.models)}")
    if args.command == "explain" and not args.model:
        for flag, value in (("--batch", args.batch), ("--sequence-length", args.sequence_length)):
            if value is not None:
                parser.command_parsers[args.command].error(
                    f"argument {flag}: sizes a model of yours, given with --model; the "
                    f"benchmark networks have their own sizes. Got {flag} {value} without "
                    "--model")
    if args.command == "explain" and args.batch is None:
        args.batch = EXPLAIN_BATCH
    if args.command == "fit-limit" and args.start > args.max:
        parser.command_parsers[args.command].error(
            f"argument --start: expected at most --max ({args.max}), got {args.start}")
    _require_tensorflow(parser)
    environment = _prepare_environment(args.command)
    try:
        _import_tensorflow()
        from memsave_grads.bench import commands  # pylint: disable=import-outside-toplevel
        with _logging_to_stderr(args.verbose):
            try:
                return commands.COMMANDS[args.command](args)
            except commands.CommandLineError as e:
                parser.command_parsers[args.command].error(str(e))
    finally:
        _restore_environment(environment)


def run() -> int:
    """The ``memsave-grads`` console script and ``python -m memsave_grads``."""
    return main()
