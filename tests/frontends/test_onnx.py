"""rlx_gpu.onnx against onnxruntime: ONNX's own node tests, random recurrent nodes, the glue ops and Scan.

Every LSTM, GRU, RNN and Scan node test of the onnx wheel runs through the importer on the host and
matches onnxruntime (and ONNX's expected outputs). Random single nodes sample every value of every
recurrent attribute (``onnx_cases.sample``; the whole product is ``tools/onnx_sweep.py``). Where a
row has length 0, the reference's final state is its initial state (ABI.md §8; onnxruntime writes 0).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import rlx_gpu
import rlx_gpu.onnx
from support.onnx_cases import (COMBINATIONS, abi_final_states, node_tests, recurrent_case, run_imported, run_onnxruntime,
                                sample)
from rlx_gpu.conformance.compare import nmse

F32_BOUND = 1e-7  # the conformance suite's f32 bound (configs/default.yaml, tolerances.thunk)
NODE_TESTS = {name: (model, inputs, expected) for name, model, inputs, expected in node_tests()}


def assert_matches(got: dict, want: dict, bound: float = F32_BOUND) -> None:
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert got[name].shape == ref.shape, name
        err = nmse(got[name], ref)
        assert err <= bound, f"{name}: nmse {err:.3g} > {bound:.0e}"


def test_every_node_test_of_the_four_ops_is_collected():
    ops = {model.graph.node[0].op_type for model, _, _ in NODE_TESTS.values()}
    assert ops == {"LSTM", "GRU", "RNN", "Scan"} and len(NODE_TESTS) >= 22


@pytest.mark.parametrize("name", sorted(NODE_TESTS))
def test_onnx_node_test_matches_onnxruntime(name):
    model, inputs, expected = NODE_TESTS[name]
    got = run_imported(model, inputs)
    assert_matches(got, abi_final_states(model, inputs, run_onnxruntime(model, inputs)))
    for out, want in expected.items():  # ONNX's own tolerances for its node tests
        np.testing.assert_allclose(got[out], want, rtol=1e-3, atol=1e-6, err_msg=out)


SAMPLED = [(op, combo) for op in COMBINATIONS for combo in sample(op, 6, seed=21)]


def test_the_sample_holds_every_value_of_every_attribute():
    for op, axes in COMBINATIONS.items():
        rows = [combo for o, combo in SAMPLED if o == op]
        for name, values in axes.items():
            assert {repr(r[name]) for r in rows} == {repr(v) for v in values}, (op, name)


@pytest.mark.parametrize("op,combo", SAMPLED, ids=[f"{op}-{i}" for i, (op, _) in enumerate(SAMPLED)])
def test_random_recurrent_node_matches_onnxruntime(op, combo):
    model, feeds = recurrent_case(op, combo, seed=len(str(combo)))
    assert_matches(run_imported(model, feeds), abi_final_states(model, feeds, run_onnxruntime(model, feeds)))


def test_default_attributes_give_a_version_1_schedule_and_others_name_their_fields():
    plain = dict(direction="bidirectional", layout=0, clip=None, activations="default", sequence_lens="absent",
                 initial=True, bias=True, linear_before_reset=1)
    schedule = rlx_gpu.onnx.import_model(recurrent_case("GRU", plain)[0])
    assert schedule["abi"] == "rlx-thunks/1"
    (gru,) = [t for t in schedule["thunks"] if t["op"] == "gru"]
    assert gru["bidirectional"] and gru["carry"] and "seq_lens" not in gru
    onnx_default = dict(plain, direction="reverse", linear_before_reset=0, clip=0.6)
    schedule = rlx_gpu.onnx.import_model(recurrent_case("GRU", onnx_default)[0])
    (gru,) = [t for t in schedule["thunks"] if t["op"] == "gru"]
    assert schedule["abi"] == "rlx-thunks/2"
    assert (gru["reverse"], gru["linear_before_reset"], gru["clip"]) == (True, False, pytest.approx(0.6))


def test_activations_are_filled_as_onnxruntime_fills_them():
    combo = dict(direction="bidirectional", layout=0, clip=None, activations="default", sequence_lens="absent",
                 initial=False, bias=False)
    model, _ = recurrent_case("RNN", combo)
    node = model.graph.node[0]
    node.attribute.extend([helper.make_attribute("activations", ["LeakyRelu", "HardSigmoid"]),
                           helper.make_attribute("activation_alpha", [0.3])])
    (rnn,) = [t for t in rlx_gpu.onnx.import_model(model)["thunks"] if t["op"] == "rnn"]
    # LeakyRelu takes the one alpha; HardSigmoid gets onnxruntime's defaults 0.2, 0.5
    assert rnn["activations"] == [["leaky_relu", pytest.approx(0.3), 0.0], ["hard_sigmoid", 0.2, 0.5]]
    assert rnn["relu"] is False


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "m", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _info(name, shape, kind=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, kind, shape)


def test_the_glue_ops_match_onnxruntime():
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "w")
    c = numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "c")
    shape = numpy_helper.from_array(np.array([2, 3, 6], np.int64), "shape")
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    n = helper.make_node
    nodes = [
        n("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),                       # [3,2,4]
        n("Reshape", ["xt", "shape6"], ["x2"]),                             # [6,4]
        n("Gemm", ["x2", "w", "c"], ["g"], alpha=0.5, beta=2.0),            # [6,6]
        n("MatMul", ["xt", "w"], ["m"]),                                    # [3,2,6]
        n("Reshape", ["m", "shape"], ["m2"]),                               # [2,3,6]
        n("Sigmoid", ["m2"], ["s"]), n("Exp", ["s"], ["e"]), n("Log", ["e"], ["l"]),
        n("Tanh", ["l"], ["t"]), n("Relu", ["m2"], ["r"]),
        n("Add", ["t", "r"], ["a"]), n("Sub", ["a", "c"], ["b"]), n("Mul", ["b", "b"], ["p"]),
        n("Div", ["p", "e"], ["d"]),
        n("Unsqueeze", ["d", "axes"], ["u"]), n("Squeeze", ["u", "axes"], ["q"]),
        n("Identity", ["q"], ["i"]), n("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
        n("Concat", ["f", "f"], ["cat"], axis=1),                           # [2,6,6]
        n("Reshape", ["g", "shape66"], ["g3"]), n("Add", ["cat", "g3"], ["out"]),
        n("Shape", ["cat"], ["cat_shape"]), n("Slice", ["cat_shape", "one", "two"], ["rows"]),
        n("Concat", ["rows", "rows"], ["dims"], axis=0), n("Expand", ["c", "dims"], ["ex"]),  # [6,6,6]->broadcast
    ]
    consts = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
              (("shape6", [6, 4]), ("shape66", [1, 6, 6]), ("one", [1]), ("two", [2]))]
    model = _model(nodes, [_info("x", [2, 3, 4])], [_info("out", None), _info("ex", None)],
                   [w, c, shape, axes, *consts])
    feeds = {"x": rng.standard_normal((2, 3, 4)).astype(np.float32)}
    assert_matches(run_imported(model, feeds), run_onnxruntime(model, feeds))


def test_a_scan_with_axes_directions_and_outer_values_matches_onnxruntime():
    body = helper.make_graph(
        [helper.make_node("Mul", ["s_in", "decay"], ["sd"]), helper.make_node("Add", ["sd", "x_t"], ["s_mid"]),
         helper.make_node("Add", ["s_mid", "shift"], ["s_out"]), helper.make_node("Tanh", ["s_out"], ["y_t"])],
        "body", [_info("s_in", [3]), _info("x_t", [3])], [_info("s_out", [3]), _info("y_t", [3])])
    node = helper.make_node("Scan", ["s0", "xs"], ["s_final", "ys"], body=body, num_scan_inputs=1,
                            scan_input_axes=[1], scan_input_directions=[1], scan_output_axes=[1],
                            scan_output_directions=[1])
    shift = numpy_helper.from_array(np.array([0.1, -0.2, 0.3], np.float32), "shift")
    model = _model([node], [_info("s0", [3]), _info("xs", [3, 5]), _info("decay", [3])],
                   [_info("s_final", [3]), _info("ys", [3, 5])], [shift])
    rng = np.random.default_rng(4)
    feeds = {"s0": rng.standard_normal(3).astype(np.float32), "xs": rng.standard_normal((3, 5)).astype(np.float32),
             "decay": rng.uniform(0.5, 0.9, 3).astype(np.float32)}
    assert_matches(run_imported(model, feeds), run_onnxruntime(model, feeds))


def test_two_unnamed_recurrent_nodes_of_one_op_get_weights_of_their_own():
    """Unnamed, with Y left out: the weights of each are named apart (the op, then ``_1``), as in the graph's order."""
    rng = np.random.default_rng(5)
    inits, nodes = [], []
    for k in range(2):
        w, r = (rng.uniform(-0.5, 0.5, (1, 4, n)).astype(np.float32) for n in (3, 4))
        inits += [numpy_helper.from_array(w, f"W{k}"), numpy_helper.from_array(r, f"R{k}")]
        nodes.append(helper.make_node("RNN", ["x", f"W{k}", f"R{k}"], ["", f"h{k}"], hidden_size=4))
    model = _model(nodes, [_info("x", [5, 2, 3])], [_info("h0", None), _info("h1", None)], inits)
    feeds = {"x": rng.standard_normal((5, 2, 3)).astype(np.float32)}
    assert_matches(run_imported(model, feeds), run_onnxruntime(model, feeds))
    names = rlx_gpu.onnx.import_model(model)["tensors"]
    assert {"h0.w_ih", "h1.w_ih"} <= set(names)  # the first output's name where a node has none
    del nodes[0].output[1:], nodes[1].output[1:]  # no output named at all: the op's name, then _1
    nodes[0].output.append(""), nodes[1].output.append("")
    graph = helper.make_graph(nodes + [helper.make_node("Tanh", ["x"], ["t"])], "m", [_info("x", [5, 2, 3])],
                              [_info("t", None)], initializer=inits)
    names = rlx_gpu.onnx.import_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))["tensors"]
    assert {"RNN.w_ih", "RNN_1.w_ih"} <= set(names)


def test_an_inf_or_a_nan_stays_where_it_is_through_concat_slice_gather_and_reversal():
    """Selections of run-time values move each element: 0·inf would be NaN in a product with a 0/1 matrix."""
    n = helper.make_node
    ints = {k: numpy_helper.from_array(np.array(v, np.int64), k) for k, v in
            (("idx", [4, 0, 2, 2]), ("s1", [1]), ("e4", [4]), ("ax1", [1]), ("sm", [-1]), ("em", [-100]),
             ("neg", [-1]))}
    nodes = [
        n("Concat", ["a", "b"], ["cat"], axis=1),                                # [2, 5]
        n("Slice", ["cat", "s1", "e4", "ax1"], ["mid"]),                         # [2, 3]
        n("Gather", ["cat", "idx"], ["picked"], axis=1),                         # [2, 4]
        n("Slice", ["cat", "sm", "em", "ax1", "neg"], ["reversed"]),             # [2, 5], backwards
        n("Concat", ["mid", "picked"], ["out"], axis=1),                         # [2, 7]
    ]
    model = _model(nodes, [_info("a", [2, 3]), _info("b", [2, 2])],
                   [_info(k, None) for k in ("cat", "mid", "picked", "reversed", "out")], ints.values())
    feeds = {"a": np.array([[1, np.inf, 4], [-0.0, 2, 3]], np.float32),
             "b": np.array([[5, np.nan], [-np.inf, 7]], np.float32)}
    got, want = run_imported(model, feeds), run_onnxruntime(model, feeds)
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)  # NaN where NaN, and nowhere else
    np.testing.assert_array_equal(got["cat"][0, :3], [1, np.inf, 4])


def test_an_inf_in_a_run_time_lstm_weight_stays_in_its_gate():
    """W as a graph input: reordering its gates moves rows; an inf forget weight saturates that gate only."""
    rng = np.random.default_rng(6)
    node = helper.make_node("LSTM", ["x", "W", "R", "B"], ["y", "y_h", "y_c"], hidden_size=3)
    model = _model([node], [_info("x", [1, 2, 2]), _info("W", [1, 12, 2]), _info("R", [1, 12, 3]),
                            _info("B", [1, 24])], [_info(k, None) for k in ("y", "y_h", "y_c")])
    feeds = {"x": rng.standard_normal((1, 2, 2)).astype(np.float32),
             "W": rng.uniform(-0.5, 0.5, (1, 12, 2)).astype(np.float32),
             "R": rng.uniform(-0.5, 0.5, (1, 12, 3)).astype(np.float32),
             "B": rng.uniform(-0.5, 0.5, (1, 24)).astype(np.float32)}
    feeds["W"][0, 6, 1] = np.inf  # ONNX's gates are i, o, f, c: row 6 is unit 0 of the forget gate
    want = run_onnxruntime(model, feeds)
    assert all(np.isfinite(v).all() for v in want.values())
    assert_matches(run_imported(model, feeds), want)


def _glue_model(nodes, inputs, outputs, opset=17, initializers=()):
    return _model(nodes, [_info(k, s) for k, s in inputs.items()], [_info(k, None) for k in outputs],
                  initializers, opset=opset)


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_the_classifier_heads_match_onnxruntime(opset):
    """Softmax and LogSoftmax (over the 2-D coercion before opset 13, one axis from it), reductions,
    Flatten, Dropout at inference and the elementwise ops torch writes around a recurrent model."""
    n = helper.make_node
    rng = np.random.default_rng(opset)
    axes_in = opset >= 18  # ReduceMean takes its axes as an input from opset 18, ReduceSum from 13
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes1")
    nodes = [
        n("Softmax", ["x"], ["soft"], axis=1),
        n("LogSoftmax", ["x"], ["logsoft"], axis=-1),
        n("ReduceMean", ["x", "axes1"] if axes_in else ["x"], ["mean"], keepdims=0, **({} if axes_in else
                                                                                     {"axes": [1]})),
        n("ReduceSum", ["x", "axes1"] if opset >= 13 else ["x"], ["sum"], **({} if opset >= 13 else {"axes": [1]})),
        n("Flatten", ["x"], ["flat"], axis=2),
        n("Dropout", ["flat"], ["dropped"]),
        n("Abs", ["dropped"], ["abs"]), n("Sqrt", ["abs"], ["sqrt"]), n("Neg", ["sqrt"], ["neg"]),
        n("Reciprocal", ["neg"], ["recip"]), n("Softplus", ["recip"], ["softplus"]),
        n("Max", ["softplus", "abs", "bias"], ["max"]), n("Min", ["max", "bias"], ["min"]),
    ]
    bias = numpy_helper.from_array(rng.uniform(0.5, 1.5, 4).astype(np.float32), "bias")
    model = _glue_model(nodes, {"x": [2, 3, 4]},
                        ["soft", "logsoft", "mean", "sum", "flat", "softplus", "min"], opset, [axes, bias])
    feeds = {"x": (rng.standard_normal((2, 3, 4)) * 40).astype(np.float32)}  # exp(x) alone would overflow
    want = run_onnxruntime(model, feeds)
    assert all(np.isfinite(v).all() for v in want.values())
    assert_matches(run_imported(model, feeds), want)


def test_a_training_mode_dropout_names_its_node():
    flag = numpy_helper.from_array(np.array(True), "train")
    ratio = numpy_helper.from_array(np.array(0.5, np.float32), "ratio")
    model = _glue_model([helper.make_node("Dropout", ["x", "ratio", "train"], ["y"], name="drop")], {"x": [2, 3]},
                        ["y"], initializers=[flag, ratio])
    with pytest.raises(rlx_gpu.onnx.OnnxImportError, match=r"'drop' \(Dropout\): input training_mode is true"):
        rlx_gpu.onnx.load(model)


def _scan8(lens_given: str, direction: int = 0) -> tuple:
    """A Scan-8 over a batch of 3 rows of 4 steps; ``sequence_lens`` an initializer, a graph input or absent."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]), helper.make_node("Tanh", ["s_out"], ["y_t"])],
        "body", [_info("s_in", [2]), _info("x_t", [2])], [_info("s_out", [2]), _info("y_t", [2])])
    lens = np.array([4, 2, 1], np.int64)
    node = helper.make_node("Scan", ["lens" if lens_given != "absent" else "", "s0", "xs"], ["s_final", "ys"],
                            body=body, num_scan_inputs=1, directions=[direction], name="scan")
    inputs = [_info("s0", [3, 2]), _info("xs", [3, 4, 2])]
    if lens_given == "input":
        inputs.insert(0, _info("lens", [3], TensorProto.INT64))
    inits = [numpy_helper.from_array(lens, "lens")] if lens_given == "initializer" else []
    model = _model([node], inputs, [_info("s_final", None), _info("ys", None)], inits, opset=8)
    rng = np.random.default_rng(9)
    feeds = {"s0": rng.standard_normal((3, 2)).astype(np.float32),
             "xs": rng.standard_normal((3, 4, 2)).astype(np.float32)}
    return model, feeds, lens


@pytest.mark.parametrize("direction", [0, 1])
def test_a_scan_8_with_rows_of_different_lengths_matches_onnxruntime(direction):
    """Known lengths (int64, as ONNX has them): each row runs its own steps, its scan outputs zero after them."""
    model, feeds, lens = _scan8("initializer", direction)
    assert_matches(run_imported(model, feeds), run_onnxruntime(model, feeds))


def test_a_scan_8_names_its_node_and_calls_sequence_lens_an_input():
    model, feeds, lens = _scan8("input")
    with pytest.raises(rlx_gpu.onnx.OnnxImportError) as info:
        rlx_gpu.onnx.load(model)
    assert "graph input 'lens' has the ONNX element type int64" in str(info.value)
    assert "read by ONNX node 'scan' (Scan) as its input sequence_lens" in str(info.value)
    model, _, _ = _scan8("initializer")
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array([4, 5, 0], np.int64), "lens"))
    with pytest.raises(rlx_gpu.onnx.OnnxImportError) as info:
        rlx_gpu.onnx.load(model)
    message = str(info.value)
    assert "'scan' (Scan): input sequence_lens is int64 [4, 5, 0]" in message and "in 1..4" in message
    assert "attribute" not in message


def test_an_unsupported_op_names_the_node_and_the_op():
    model = _model([helper.make_node("Erf", ["x"], ["y"], name="head")], [_info("x", [2, 3])], [_info("y", None)])
    with pytest.raises(rlx_gpu.onnx.OnnxImportError, match=r"'head' \(Erf\).*Erf is not supported"):
        rlx_gpu.onnx.load(model)


@pytest.mark.parametrize("op,inputs,says", [
    ("MatMul", {"a": [2, 3], "b": [4, 5]}, "inputs of shapes [2, 3] and [4, 5] do not multiply"),
    ("Add", {"a": [2, 3], "i": ([2, 3], TensorProto.INT32)}, "differ in dtype"),
    ("Sub", {"a": [2, 3], "c": [4]}, "do not broadcast"),
])
def test_a_node_the_builder_refuses_is_named_in_the_error(op, inputs, says):
    infos = [_info(k, *(v if isinstance(v, tuple) else (v,))) for k, v in inputs.items()]
    model = _model([helper.make_node(op, list(inputs), ["y"], name="culprit")], infos, [_info("y", None)])
    with pytest.raises(rlx_gpu.onnx.OnnxImportError, match=rf"'culprit' \({op}\): .*{re.escape(says)}"):
        rlx_gpu.onnx.load(model)


@pytest.mark.parametrize("attribute,value,says", [
    ("activations", ["Sigmoid", "Swish", "Tanh"], "'Swish' is not one of"),
    ("activations", ["Sigmoid", "Tanh"], "takes 3 per direction"),
    ("layout", 2, "0 (time-major) and 1"),
    ("clip", -1.0, "positive"),
    ("output_sequence", 1, "LSTM is read with"),
])
def test_an_unsupported_attribute_names_node_op_attribute_and_value(attribute, value, says):
    combo = dict(direction="forward", layout=0, clip=None, activations="default", sequence_lens="absent",
                 initial=False, bias=True, input_forget=0, peepholes=False)
    model, _ = recurrent_case("LSTM", combo)
    node = model.graph.node[0]
    kept = [a for a in node.attribute if a.name != attribute]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(attribute, value)])
    with pytest.raises(rlx_gpu.onnx.OnnxImportError) as info:
        rlx_gpu.onnx.load(model)
    message = str(info.value)
    assert "'lstm0' (LSTM)" in message and f"{attribute}={value!r}" in message and says in message


def test_a_symbolic_input_shape_is_given_by_shapes():
    model = _model([helper.make_node("Tanh", ["x"], ["y"])], [_info("x", ["batch", 3])], [_info("y", None)])
    with pytest.raises(rlx_gpu.onnx.OnnxImportError, match=r"symbolic shape \[.batch., 3\].*--shape x=N,3"):
        rlx_gpu.onnx.load(model)
    schedule = rlx_gpu.onnx.load(model, shapes={"x": [2, 3]})
    assert schedule.tensors["x"].shape == (2, 3) and schedule.inputs == ("x",) and schedule.outputs == ("y",)


def _symbolic_gru() -> tuple:
    """A GRU whose X and initial_h both have a symbolic batch (what an exporter with dynamic axes writes)."""
    rng = np.random.default_rng(8)
    w, r = (numpy_helper.from_array(rng.uniform(-0.4, 0.4, (1, 3 * 4, k)).astype(np.float32), n)
            for n, k in (("W", 3), ("R", 4)))
    node = helper.make_node("GRU", ["x", "W", "R", "", "", "h0"], ["y", "h_n"], hidden_size=4, name="gru")
    model = _model([node], [_info("x", [5, "batch", 3]), _info("h0", [1, "batch", 4])],
                   [_info("y", None), _info("h_n", None)], [w, r])
    feeds = {"x": rng.standard_normal((5, 2, 3)).astype(np.float32),
             "h0": rng.standard_normal((1, 2, 4)).astype(np.float32)}
    return model, feeds


def test_every_symbolic_input_is_named_with_the_shape_to_give():
    model, feeds = _symbolic_gru()
    with pytest.raises(rlx_gpu.onnx.OnnxImportError) as info:
        rlx_gpu.onnx.load(model)
    message = str(info.value)
    assert "'x' has the symbolic shape [5, 'batch', 3]" in message
    assert "'h0' has the symbolic shape [1, 'batch', 4]" in message
    assert "shapes={'x': [5,N,3], 'h0': [1,N,4]}" in message and "--shape x=5,N,3 --shape h0=1,N,4" in message
    schedule = rlx_gpu.onnx.load(model, shapes={"x": [5, 2, 3], "h0": [1, 2, 4]})
    assert schedule.tensors["h0"].shape == (1, 2, 4)


@pytest.mark.parametrize("shapes, expected", [
    ({"x": [5, 2], "h0": [1, 2, 4]}, r"shapes\['x'\] = \[5, 2\] does not fit graph input 'x' of shape \[5, 'batch', 3\]"),
    ({"x": [6, 2, 3], "h0": [1, 2, 4]}, r"shapes\['x'\] = \[6, 2, 3\] does not fit .*equal to its fixed ones"),
    ({"x": [5, 0, 3], "h0": [1, 2, 4]}, r"shapes\['x'\] = \[5, 0, 3\] does not fit .*at least 1"),
    ({"x": [5, 2, 3], "h0": [1, 2, 4], "c0": [1]}, r"shapes names 'c0', which is no graph input; the graph inputs "
                                                     r"are 'x', 'h0'"),
])
def test_shapes_that_do_not_fit_the_graph_inputs_are_refused_naming_them(shapes, expected):
    model, _ = _symbolic_gru()
    with pytest.raises(rlx_gpu.onnx.OnnxImportError, match=expected):
        rlx_gpu.onnx.load(model, shapes=shapes)


def test_the_cli_runs_a_model_with_a_symbolic_shape_given_by_shape(tmp_path, capsys):
    from rlx_gpu.cli import main

    model, feeds = _symbolic_gru()
    path = tmp_path / "gru.onnx"
    path.write_bytes(model.SerializeToString())
    assert main(["run", str(path), "--device", "host"]) == 2
    assert "--shape x=5,N,3 --shape h0=1,N,4" in capsys.readouterr().err
    np.savez(tmp_path / "in.npz", **feeds)
    out = tmp_path / "out.npz"
    assert main(["run", str(path), "--device", "host", "--shape", "x=5,2,3", "--shape", "h0=1,2,4",
                 "--inputs", str(tmp_path / "in.npz"), "--out", str(out)]) == 0
    with np.load(out) as got:
        assert_matches(dict(got), run_onnxruntime(model, feeds))
    assert main(["run", "demo", "--shape", "x=1,2"]) == 2
    assert "--shape sizes the inputs of an ONNX model" in capsys.readouterr().err


def test_the_cli_imports_a_model_and_runs_it_directly(tmp_path, capsys):
    from rlx_gpu.cli import main

    combo = dict(direction="bidirectional", layout=0, clip=None, activations="default", sequence_lens="absent",
                 initial=True, bias=True, linear_before_reset=1)
    model_path = tmp_path / "gru.onnx"
    model_path.write_bytes(recurrent_case("GRU", combo)[0].SerializeToString())
    out = tmp_path / "gru.json"
    assert main(["import", str(model_path), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"to {out}" in said and "inputs X, initial_h, outputs Y, Y_h" in said
    assert rlx_gpu.load_schedule(out).to_dict() == rlx_gpu.onnx.load(model_path).to_dict()
    assert main(["run", str(model_path), "--device", "host", "--check"]) == 0
    assert "gru" in capsys.readouterr().out
    (tmp_path / "broken.onnx").write_bytes(b"\x08\x07not protobuf")
    assert main(["import", str(tmp_path / "broken.onnx"), "-o", str(tmp_path / "x.json")]) == 2
    assert "OnnxImportError" in capsys.readouterr().err


def _busiest(op: str) -> dict:
    """The sampled combination of ``op`` with the most attributes away from their defaults."""
    defaults = {name: values[0] for name, values in COMBINATIONS[op].items()}
    return max((combo for o, combo in SAMPLED if o == op), key=lambda c: sum(c[k] != defaults[k] for k in c))


# each op at a target, LSTM (the most fields) at both: every new field set is a kernel build on PoCL
@pytest.mark.parametrize("op,target", [("LSTM", "cpu"), ("LSTM", "gpu"), ("GRU", "gpu"), ("RNN", "cpu")])
def test_a_random_recurrent_node_matches_onnxruntime_on_opencl(op, target):
    """On PoCL; the recurrent thunk runs there when its device kernels take its fields."""
    from host_fallback.abi import used
    from rlx_gpu.conformance.devices import find, open_device
    from rlx_gpu.launches import PLANNERS
    from rlx_gpu.runtime.config import load_config
    from rlx_gpu.runtime.executor import Device

    device = Device(open_device(find("opencl"), target), load_config())
    combo = _busiest(op)
    model, feeds = recurrent_case(op, combo, seed=7)
    schedule = rlx_gpu.onnx.load(model)
    (thunk,) = [t for t in schedule.thunks if t.op == op.lower()]
    placed = {a.index: a.backend for a in device.place(schedule)}
    if set(used(thunk)) <= PLANNERS[thunk.op].v2_fields:
        assert placed[thunk.index] == "opencl", (used(thunk), placed)
    arena = schedule.pristine_arena()
    for name, values in feeds.items():
        schedule.tensors[name].write(arena, values)
    out = device.run(schedule, arena)
    got = {name: schedule.tensors[name].read(out) for name in schedule.outputs}
    assert_matches(got, abi_final_states(model, feeds, run_onnxruntime(model, feeds)))
