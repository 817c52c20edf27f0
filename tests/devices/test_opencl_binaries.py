"""The OpenCL backend's disk cache of program binaries (``backends.opencl_binaries``) on each OpenCL implementation
here that keeps no builds of its own (Intel's CPU runtime; Oclgrind's simulator is checked through the cache by
every Oclgrind test); PoCL, which keeps its own, writes nothing to it.

A program built in one context is loaded from disk in the next (a fresh process's first build) and its kernel runs;
a changed source, option or device is built from source; a build with diagnostics warns of them again when loaded;
a damaged entry is built again and replaced.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from support import background

opencl = pytest.importorskip("rlx_gpu.backends.opencl")
from rlx_gpu.backends import opencl_binaries  # noqa: E402
from rlx_gpu.backends.programs import Program  # noqa: E402
from rlx_gpu.conformance.devices import find  # noqa: E402
from rlx_gpu.errors import KernelBuildWarning  # noqa: E402

IMPLEMENTATIONS = [spec for spec in background.OPENCL_IMPLEMENTATIONS
                   if not opencl_binaries.keeps_own_builds(find(spec).details["platform"])]
POCL = [spec for spec in background.OPENCL_IMPLEMENTATIONS
        if opencl_binaries.keeps_own_builds(find(spec).details["platform"])]
#: a program each compiler builds in a fraction of a second: ``twice`` doubles ``src`` into ``dst``
SOURCE = "__kernel void twice(__global const float *src, __global float *dst) {\n" \
         "    size_t i = get_global_id(0);\n    dst[i] = 2.0f * src[i];\n}\n"
WARNED = SOURCE + "int rlx_w(int a) { return a || 2; }\n"  # clang: use of logical '||' with constant operand


def _program(source: str) -> Program:
    return Program("opencl", "probe", "f32", None, source)


def _primitives(spec: str):
    """A fresh context on device ``spec``: nothing built in it yet, as in a new process."""
    return opencl.OpenCLPrimitives(find(spec), shared=False)


def _twice(prims, built) -> np.ndarray:
    src = np.arange(8, dtype=np.float32)
    buffers = [prims.allocate(src.nbytes) for _ in range(2)]
    prims.write(buffers[0], 0, src.view(np.uint8))
    kernel = prims.get_kernel(built, "twice")
    kernel.set_args(*buffers)
    prims.cl.enqueue_nd_range_kernel(prims.queue, kernel, (8,), None)
    out = np.empty(src.nbytes, np.uint8)
    prims.read(buffers[1], 0, out)
    prims.finish()
    return out.view(np.float32)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(opencl_binaries.CACHE_ENV, str(tmp_path))
    return tmp_path


@pytest.mark.skipif(not IMPLEMENTATIONS, reason="no OpenCL implementation without a build cache of its own")
@pytest.mark.parametrize("spec", IMPLEMENTATIONS)
def test_a_second_context_loads_the_binary_and_a_changed_source_builds(cache, spec):
    first = _primitives(spec)
    first.build_program(_program(SOURCE))
    assert first.binaries.loaded == 0 and len(list(cache.glob("*.clbin"))) == 1
    second = _primitives(spec)
    built = second.build_program(_program(SOURCE))
    assert second.binaries.loaded == 1, "the second build was not served from disk"
    np.testing.assert_array_equal(_twice(second, built), 2 * np.arange(8, dtype=np.float32))
    changed = _program(SOURCE.replace("2.0f", "3.0f"))
    np.testing.assert_array_equal(_twice(second, second.build_program(changed)), 3 * np.arange(8, dtype=np.float32))
    assert second.binaries.loaded == 1 and len(list(cache.glob("*.clbin"))) == 2, "a changed source was loaded"


@pytest.mark.skipif(not IMPLEMENTATIONS, reason="no OpenCL implementation without a build cache of its own")
@pytest.mark.parametrize("spec", IMPLEMENTATIONS)
def test_a_loaded_binary_warns_of_its_build_s_diagnostics(cache, spec):
    said = []
    for prims in (_primitives(spec), _primitives(spec)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prims.build_program(_program(WARNED))
        said.append([str(w.message) for w in caught if w.category is KernelBuildWarning])
    assert prims.binaries.loaded == 1
    assert said[1] == said[0] and "constant operand" in said[0][0], said


@pytest.mark.skipif(not IMPLEMENTATIONS, reason="no OpenCL implementation without a build cache of its own")
def test_a_damaged_entry_is_built_again_and_replaced(cache):
    _primitives(IMPLEMENTATIONS[0]).build_program(_program(SOURCE))
    (entry,) = cache.glob("*.clbin")
    entry.write_bytes(b"not a binary")
    prims = _primitives(IMPLEMENTATIONS[0])
    np.testing.assert_array_equal(_twice(prims, prims.build_program(_program(SOURCE))),
                                  2 * np.arange(8, dtype=np.float32))
    assert prims.binaries.loaded == 0 and entry.read_bytes() != b"not a binary"
    again = _primitives(IMPLEMENTATIONS[0])  # the replacement loads (Intel's builds differ byte for byte)
    np.testing.assert_array_equal(_twice(again, again.build_program(_program(SOURCE))),
                                  2 * np.arange(8, dtype=np.float32))
    assert again.binaries.loaded == 1


def test_the_key_holds_the_device_the_options_and_the_source(tmp_path):
    base = opencl_binaries.BinaryCache(("PoCL", "3.1", "cpu"), ("-cl-std=CL1.2",), tmp_path)
    paths = {base.path(_program(SOURCE)), base.path(_program(WARNED)),
             opencl_binaries.BinaryCache(("PoCL", "3.0", "cpu"), ("-cl-std=CL1.2",), tmp_path).path(_program(SOURCE)),
             opencl_binaries.BinaryCache(("PoCL", "3.1", "cpu"), ("-cl-std=CL2.0",), tmp_path).path(_program(SOURCE))}
    assert len(paths) == 4 and all(p.parent == tmp_path for p in paths)
    assert base.path(_program(SOURCE)) == base.path(_program(SOURCE))
    assert opencl_binaries.BinaryCache(("PoCL",), (), None).path(_program(SOURCE)) is None


@pytest.mark.parametrize("spec", POCL)
def test_pocl_keeps_its_own_builds_and_nothing_here(cache, spec):
    prims = _primitives(spec)
    np.testing.assert_array_equal(_twice(prims, prims.build_program(_program(SOURCE))),
                                  2 * np.arange(8, dtype=np.float32))
    assert prims.binaries.directory is None and not list(cache.iterdir())
