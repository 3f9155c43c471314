"""Which attention plan the decode runner starts on, and what it builds (issue #24 item 2:
flashinfer's JIT off the request path; engine/attention_build.py `plan_attention`).

This machine has no flashinfer, so the module's three questions (built? build it, load it)
go to a recording probe; the decision table is the real function's.
test_flashinfer_build_gpu.py covers the real flashinfer calls. Bugs caught: a restart (module
built) that starts on Triton and builds again, a first start that builds on the request path
(blocking) under `auto`, an explicit `flashinfer` that serves on Triton without trying to
build, a broken probe or load that crashes start-up instead of falling back to Triton."""
from __future__ import annotations

import threading

import pytest
import torch

from freetoken.engine.attention_build import Probe, plan_attention


class _Recorder:
    def __init__(self, built: bool | Exception, build_error: Exception | None = None,
                 load_error: Exception | None = None):
        self.built, self.build_error, self.load_error = built, build_error, load_error
        self.calls: list[tuple[str, int]] = []  # (what, thread id)

    def probe(self) -> Probe:
        def built(dt, d):
            self.calls.append(("built", threading.get_ident()))
            if isinstance(self.built, Exception):
                raise self.built
            return self.built

        def build(dt, d):
            self.calls.append(("build", threading.get_ident()))
            if self.build_error is not None:
                raise self.build_error

        def load(dt, d):
            self.calls.append(("load", threading.get_ident()))
            if self.load_error is not None:
                raise self.load_error

        return Probe(built, build, load)

    def what(self) -> list[str]:
        return [w for w, _ in self.calls]


BF16 = torch.bfloat16


def test_restart_starts_on_flashinfer_loaded_before_ready() -> None:
    r = _Recorder(built=True)
    kind, build = plan_attention("auto", BF16, 128, r.probe(), chosen="flashinfer")
    assert (kind, build) == ("flashinfer", None)
    assert r.what() == ["built", "load"]  # loaded now, on this thread: never built again
    assert {t for _, t in r.calls} == {threading.get_ident()}


def test_first_start_serves_on_triton_while_flashinfer_builds_on_a_thread() -> None:
    r = _Recorder(built=False)
    kind, build = plan_attention("auto", BF16, 128, r.probe(), chosen="flashinfer")
    assert kind == "triton" and build is not None and build.kind == "flashinfer"
    assert build.wait(10) == "ready"
    assert r.what() == ["built", "build"]  # the load waits for the switch (engine thread)
    assert r.calls[1][1] != threading.get_ident()
    build.load()
    assert r.what()[-1] == "load"


def test_explicit_flashinfer_is_built_before_serving() -> None:
    r = _Recorder(built=False)
    kind, build = plan_attention("flashinfer", BF16, 256, r.probe(), chosen="flashinfer")
    assert (kind, build) == ("flashinfer", None)
    assert r.what() == ["built", "build", "load"]
    assert {t for _, t in r.calls} == {threading.get_ident()}  # blocking, as asked


def test_a_probe_that_raises_builds_off_the_request_path() -> None:
    """Cannot tell whether the module is built: Triton now, the build on its thread (which
    fails here: the switch then keeps Triton, tests/kernels/triton/engine)."""
    r = _Recorder(built=RuntimeError("no CUDA arch"), build_error=RuntimeError("nvcc"))
    kind, build = plan_attention("auto", BF16, 128, r.probe(), chosen="flashinfer")
    assert kind == "triton" and build is not None
    assert build.wait(10) == "failed" and isinstance(build.error, RuntimeError)


@pytest.mark.parametrize("case", ["build_fails", "load_fails"])
def test_explicit_flashinfer_that_cannot_build_or_load_serves_on_triton(case) -> None:
    r = _Recorder(built=case == "load_fails",
                  build_error=RuntimeError("nvcc") if case == "build_fails" else None,
                  load_error=OSError("bad .so") if case == "load_fails" else None)
    kind, build = plan_attention("flashinfer", BF16, 128, r.probe(), chosen="flashinfer")
    assert (kind, build) == ("triton", None)
    assert r.what()[-1] == ("build" if case == "build_fails" else "load")


def test_triton_and_torch_plans_build_nothing() -> None:
    r = _Recorder(built=False)
    assert plan_attention("triton", BF16, 128, r.probe(), chosen="triton") == ("triton", None)
    assert plan_attention("auto", torch.float32, 16, r.probe(), chosen="torch") == ("torch",
                                                                                   None)
    assert r.calls == []
