"""A package people can depend on: the TensorFlow range, the canary for the private TensorFlow
APIs memsave_grads/_tf relies on, the wheel's metadata and ``--version``.

The canary checks each private API the way we use it (names, signatures, behaviour), so a new
TensorFlow that changes one fails here with the API's name and the TensorFlow version, rather
than somewhere deep in a parity test.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import pathlib
import subprocess
import sys
import tomllib
import zipfile

import pytest
import tensorflow as tf

from memsave_grads import errors
from memsave_grads._tf import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIST = "memsave-grads"


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


# --- the TensorFlow version check -------------------------------------------------------------

@pytest.mark.parametrize("version", ["2.16.0", "2.16.2", "2.19.1", "2.21.0", "2.21.0rc1"])
def test_supported_versions_pass(version):
    compat.check_version(version)


@pytest.mark.parametrize("version", ["2.15.1", "2.12.0", "1.15.5"])
def test_too_old_tensorflow_is_refused_with_the_remedy(version, monkeypatch):
    monkeypatch.delenv(compat.ALLOW_OLD_TF_ENV, raising=False)
    with pytest.raises(errors.MissingDependencyError) as info:
        compat.check_version(version)
    assert isinstance(info.value, ImportError)  # `except ImportError` keeps working
    message = str(info.value)
    assert version in message and compat.SUPPORTED_RANGE in message and "pip install" in message


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == compat.__name__ and r.levelname == "WARNING"]


def test_old_tensorflow_runs_with_a_warning_when_allowed(monkeypatch, caplog):
    monkeypatch.setenv(compat.ALLOW_OLD_TF_ENV, "1")
    with caplog.at_level("WARNING", logger="memsave_grads"):
        compat.check_version("2.15.1")
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "2.15.1" in warnings[0]


def test_missing_tensorflow_is_refused_with_the_remedy():
    with pytest.raises(errors.MissingDependencyError, match="no 'tensorflow' package"):
        compat.check_version(None)


@pytest.mark.parametrize("version", ["2.22.0", "2.22.0.dev20260101", "3.0.0"])
def test_newer_tensorflow_warns_but_runs(version, caplog):
    # Newer than tested (tf-nightly included) is allowed: a warning names the tested range.
    with caplog.at_level("WARNING", logger="memsave_grads"):
        compat.check_version(version)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and version in warnings[0] and compat.SUPPORTED_RANGE in warnings[0]


def test_parse_version_reads_nightly_and_local_versions():
    assert compat.parse_version("2.22.0.dev20260101") == (2, 22)
    assert compat.parse_version("2.16.1+cpu") == (2, 16)
    with pytest.raises(ValueError):
        compat.parse_version("nightly")


def test_installed_tensorflow_is_in_range():
    assert compat.installed_tensorflow_version() == tf.__version__
    assert compat.MIN_TF_VERSION <= compat.parse_version(tf.__version__), tf.__version__


def test_pyproject_extras_state_the_same_range_as_the_check():
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra, wheel in (("cpu", "tensorflow-cpu"), ("gpu", "tensorflow[and-cuda]"),
                         ("tf", "tensorflow"), ("test", "tensorflow")):
        assert f"{wheel}{compat.SUPPORTED_RANGE}" in extras[extra], (extra, extras[extra])
    # No hard TensorFlow dependency: it would add a second wheel over tensorflow-cpu/tf-nightly.
    assert not [d for d in _pyproject()["project"]["dependencies"] if d.startswith("tensorflow")]


_HIDE_TENSORFLOW = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('tensorflow', 'keras', 'tf_keras'):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
"""


def test_without_tensorflow_import_works_and_first_use_says_what_to_install():
    code = _HIDE_TENSORFLOW + """
import memsave_grads as mg
assert mg.Budget.parse("1GiB").bytes == 1 << 30   # the TensorFlow-free names still work
try:
    mg.gradients
except mg.MissingDependencyError as e:
    print("ERROR", e)
assert "tensorflow" not in sys.modules
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    expected = f"ERROR memsave_grads needs TensorFlow {compat.SUPPORTED_RANGE}"
    assert result.stdout.startswith(expected), result.stdout
    assert "pip install" in result.stdout


# --- the canary: private TensorFlow APIs memsave_grads/_tf uses ------------------------------

def _fail(api: str, what: str):
    pytest.fail(f"TensorFlow {tf.__version__}: private API {api} changed ({what}); "
                "memsave_grads/_tf depends on it: update it, or pin TensorFlow to "
                f"{compat.SUPPORTED_RANGE}", pytrace=False)


def _require(condition, api: str, what: str):
    if not condition:
        _fail(api, what)


def _params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_canary_gradients_entry_points():
    """patching.py swaps these exact objects, with wrappers of these exact signatures."""
    from tensorflow.python.ops import gradients_impl  # pylint: disable=import-outside-toplevel
    api = "tensorflow.python.ops.gradients_impl.gradients"
    _require(tf.compat.v1.gradients is gradients_impl.gradients, api,
             "is no longer tf.compat.v1.gradients")
    _require(_params(gradients_impl.gradients) == [
        "ys", "xs", "grad_ys", "name", "colocate_gradients_with_ops", "gate_gradients",
        "aggregation_method", "stop_gradients", "unconnected_gradients"], api,
        f"signature {_params(gradients_impl.gradients)}")
    api = "tensorflow.python.ops.gradients_impl.gradients_v2"
    _require(tf.gradients is gradients_impl.gradients_v2, api, "is no longer tf.gradients")
    _require(_params(gradients_impl.gradients_v2) == [
        "ys", "xs", "grad_ys", "name", "gate_gradients", "aggregation_method",
        "stop_gradients", "unconnected_gradients"], api,
        f"signature {_params(gradients_impl.gradients_v2)}")


def test_canary_operation_and_graph_internals():
    """rewrite.py copies ops with Graph._create_op_internal and these Operation internals."""
    from tensorflow.core.framework import attr_value_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import ops as tf_ops  # pylint: disable=import-outside-toplevel
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        y = tf.tanh(x, name="y")
        gate = tf.no_op(name="gate")
        for name in ("_create_op_internal", "_is_function", "_get_function"):
            _require(hasattr(graph, name), f"Graph.{name}", "missing")
        attrs = dict(y.op.node_def.attr)
        attrs["_class"] = attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue(s=[b"loc:@y"]))
        try:
            copy = graph._create_op_internal(  # pylint: disable=protected-access
                y.op.type, list(y.op.inputs), dtypes=[t.dtype for t in y.op.outputs],
                name="y", attrs=attrs, op_def=y.op.op_def, compute_device=False)
        except TypeError as e:
            _fail("Graph._create_op_internal", f"call as rewrite.py makes it: {e}")
        _require(copy.type == "Tanh" and copy.name != "y"
                 and copy.colocation_groups() == [b"loc:@y"],
                 "Graph._create_op_internal", "copy of Tanh with a _class attr")
        _require(copy._id > y.op._id, "Operation._id",  # pylint: disable=protected-access
                 "not increasing in creation order")
        copy._set_device("/device:CPU:0")  # pylint: disable=protected-access
        _require(copy.device.endswith("CPU:0"), "Operation._set_device", copy.device)
        copy._add_control_inputs([gate])  # pylint: disable=protected-access
        _require(list(copy.control_inputs) == [gate], "Operation._add_control_inputs",
                 f"control inputs {copy.control_inputs}")
        _require(list(gate._control_outputs) == [copy],  # pylint: disable=protected-access
                 "Operation._control_outputs", f"{gate._control_outputs}")  # pylint: disable=protected-access
        _require(hasattr(y.op, "_gradient_function"), "Operation._gradient_function", "missing")
        copy._gradient_function = y.op._gradient_function  # pylint: disable=protected-access
        with tf_ops._colocate_with_for_gradient(copy, None, ignore_existing=True):  # pylint: disable=protected-access
            placed = tf.identity(copy.outputs[0])
        _require(placed.op.colocation_groups() == copy.colocation_groups(),
                 "ops._colocate_with_for_gradient", "does not colocate with the op")
    _require(isinstance(tf.constant(1.0), tf_ops.EagerTensor), "ops.EagerTensor",
             "an eager tensor is not one")


# At module level and without AutoGraph: TF 2.16's AutoGraph converts a tf.function defined
# inside a test function as if it were the test function.
@tf.function(autograph=False)
def _double(v):
    return 2.0 * v


def test_canary_control_flow_v2_and_functions():
    """rewrite.py gives copied If/While ops their own functions; graph.py reads called functions
    and tells v1 control flow apart."""
    from tensorflow.python.framework import func_graph as func_graph_module  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import control_flow_util  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import control_flow_util_v2  # pylint: disable=import-outside-toplevel

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        out = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.sin(x), lambda: tf.cos(x))
        called = _double(x)
    if_op = out.op if out.op.type in ("If", "StatelessIf") else out.op.inputs[0].op
    _require(if_op.type in ("If", "StatelessIf"), "cond_v2", f"tf.cond built {if_op.type}")
    for name in ("IsInWhileLoop", "IsInCond"):
        function = getattr(control_flow_util, name, None)
        _require(function is not None and function(if_op) is False,
                 f"control_flow_util.{name}", "missing or not False for a v2 cond")
    then_name = if_op.get_attr("then_branch").name
    shapes = [t.shape for t in if_op.inputs[1:]]
    try:
        func_graph = control_flow_util_v2.get_func_graph(if_op, shapes, then_name)
    except (AttributeError, TypeError) as e:
        _fail("control_flow_util_v2.get_func_graph", str(e))
    _require(isinstance(func_graph, func_graph_module.FuncGraph),
             "control_flow_util_v2.get_func_graph", f"returned {type(func_graph)}")
    _require(hasattr(func_graph, "captures") and hasattr(func_graph, "outer_graph"),
             "FuncGraph.captures/outer_graph", "missing")
    func_graph.name = f"{then_name}_canary"
    with graph.as_default():
        new_name = control_flow_util_v2.create_new_tf_function(func_graph)
    _require(isinstance(new_name, str), "control_flow_util_v2.create_new_tf_function",
             f"returned {new_name!r}")
    if_op._set_func_attr("then_branch", new_name)  # pylint: disable=protected-access
    _require(if_op.get_attr("then_branch").name == new_name, "Operation._set_func_attr",
             "did not set the function")
    call = called.op
    _require(graph._is_function(call.get_attr("f").name),  # pylint: disable=protected-access
             "Graph._is_function", "False for a tf.function called in the graph")
    function = graph._get_function(call.get_attr("f").name)  # pylint: disable=protected-access
    _require(function is not None and len(function.cached_definition.node_def) > 0,
             "Graph._get_function(...).cached_definition.node_def", "missing or empty")


def test_canary_variable_helpers():
    """stitch.py and graph.py build zero gradients and read handles of resource variables."""
    from tensorflow.python.framework import ops as tf_ops  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import default_gradient  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import resource_variable_ops  # pylint: disable=import-outside-toplevel
    with tf.Graph().as_default():
        var = tf.Variable(tf.zeros([3, 2]))
        _require(resource_variable_ops.is_resource_variable(var),
                 "resource_variable_ops.is_resource_variable", "False for tf.Variable")
        shape = resource_variable_ops.variable_shape(var.handle)
        _require(shape.dtype in (tf.int32, tf.int64) and shape.shape.as_list() == [2],
                 "resource_variable_ops.variable_shape", f"gave {shape}")
        _require(default_gradient.get_zeros_dtype(var.handle) == tf.float32,
                 "default_gradient.get_zeros_dtype", "not the variable's dtype")
        ref = tf.compat.v1.Variable(tf.zeros([3]), use_resource=False)
        _require(not resource_variable_ops.is_resource_variable(ref),
                 "resource_variable_ops.is_resource_variable", "True for a reference variable")
        ref_tensor = tf_ops.convert_to_tensor(ref, as_ref=True)
        _require(ref_tensor.dtype == tf.float32._as_ref,  # pylint: disable=protected-access
                 "ops.convert_to_tensor(as_ref=True)", f"gave {ref_tensor.dtype}, not float32_ref")


def test_canary_onednn_switch():
    """graph.py asks whether oneDNN runs the CPU kernels (its convolution gradients allocate no
    scratch, the Eigen ones tens of MiB)."""
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=import-outside-toplevel
    is_enabled = getattr(_pywrap_util_port, "IsMklEnabled", None)
    _require(callable(is_enabled), "_pywrap_util_port.IsMklEnabled", "missing")
    _require(isinstance(is_enabled(), bool), "_pywrap_util_port.IsMklEnabled",
             f"returned {is_enabled()!r}, not a bool")


# --- metadata, py.typed, --version ---------------------------------------------------------

def test_installed_metadata_matches_pyproject():
    """What `pip show` / METADATA say. Stale after editing pyproject.toml until
    `pip install -e .` runs again (as .ci/run does)."""
    project = _pyproject()["project"]
    meta = importlib.metadata.metadata(DIST)
    assert meta["Version"] == project["version"]
    assert meta["Requires-Python"] == project["requires-python"]
    assert meta["License-Expression"] == project["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert sorted(meta.get_all("Classifier")) == sorted(project["classifiers"])
    for classifier in ("Programming Language :: Python :: 3.11",
                       "Programming Language :: Python :: 3.12",
                       "Operating System :: OS Independent",
                       "Topic :: Scientific/Engineering :: Artificial Intelligence",
                       "Typing :: Typed"):
        assert classifier in project["classifiers"]
    urls = [f"{k}, {v}" for k, v in project.get("urls", {}).items()]
    assert sorted(meta.get_all("Project-URL") or []) == sorted(urls)
    assert set(meta.get_all("Provides-Extra")) >= {"cpu", "gpu", "tf", "test"}
    hard = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert not [r for r in hard if r.startswith("tensorflow")], hard


def test_version_flag_is_the_metadata_version():
    result = subprocess.run([sys.executable, "-m", "memsave_grads", "--version"],
                            capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    assert result.stdout.split() == ["memsave-grads", importlib.metadata.version(DIST)]


def test_py_typed_is_in_the_package():
    assert (ROOT / "memsave_grads" / "py.typed").is_file()


@pytest.mark.slow  # builds a wheel: pip fetches setuptools into an isolated build environment
def test_wheel_ships_py_typed_and_metadata(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
                    str(ROOT)], check=True, timeout=300, capture_output=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = tmp_path.glob("memsave_grads-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "memsave_grads/py.typed" in names
        assert "memsave_grads/_tf/compat.py" in names
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text
    assert "Classifier: Typing :: Typed" in text
    assert not [line for line in text.splitlines()
                if line.startswith("Requires-Dist: tensorflow") and "extra ==" not in line]
