"""``hopper.common.launch``: repeat launches skip Triton's argument binding by keying the
compiled kernel on a tuple that must fix everything Triton specializes on. CPU: the key
itself and the launcher's decisions against a stand-in kernel (the GPU suite runs with
TRIFLASH_VERIFY_LAUNCHES=1, where every repeat is checked against Triton's own choice)."""
import pytest
import torch

hc = pytest.importorskip("triflash.kernels.hopper.common")


def test_launch_key_separates_what_triton_specializes_on():
    x = torch.zeros(64, 8, dtype=torch.bfloat16)
    y = torch.ones(64, 8, dtype=torch.bfloat16)
    key = hc._launch_key
    assert key([x, 3, 0.5, True, None]) == key([y, 3, 0.5, True, None])  # other data, same key
    assert key([x]) != key([x.float()])                                   # dtype
    assert key([x]) != key([x.view(-1)[1:]])                              # 16-byte alignment
    assert key([x.view(-1)[8:]]) == key([x])                              # 16 bytes in: aligned
    assert key([1]) != key([16]) != key([17])                             # int values
    assert key([1]) != key([True]) and key([1]) != key([1.0])             # int / bool / float
    assert key([None]) != key([0])
    dx, dy = hc.descriptor(x.view(1, 64, 1, 8), 64), hc.descriptor(y.view(1, 64, 1, 8), 64)
    assert key([dx]) == key([dy])
    assert key([dx]) != key([hc.descriptor(x.view(1, 64, 1, 8), 32)])      # box
    assert key([dx]) != key([hc.descriptor(x.float().view(1, 64, 1, 8), 64)])
    assert key([dx]) != key([hc.stat_descriptor(x.float().view(1, 8, 64))])
    assert key(["a string"]) is None and key([[1, 2]]) is None            # cannot key: no cache


class _Compiled:
    def __init__(self):
        self.function, self.packed_metadata, self.calls = "fn", "meta", []

    def run(self, *args):
        self.calls.append(args)


class _Kernel:
    """Stands in for a JITFunction: ``kernel[grid](*args)`` 'compiles' one _Compiled per key."""
    __name__ = "fake"

    def __init__(self, nparams):
        self.device_caches, self.params, self.jit_calls, self.by_key = {}, [None] * nparams, [], {}

    def _compiled(self, args):
        return self.by_key.setdefault(hc._launch_key(args), _Compiled())

    def __getitem__(self, grid):
        def go(*args, num_warps):
            self.jit_calls.append((grid, args, num_warps))
            return self._compiled(args)
        return go

    def run(self, *args, grid, warmup, num_warps):
        assert warmup
        return self._compiled(args)


class _Driver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 1234)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(hc, "driver", _Driver)
    monkeypatch.setattr(hc, "_COMPILED", {})


def test_launch_reuses_the_compiled_kernel(fake_gpu, monkeypatch):
    kernel = _Kernel(3)
    x = torch.zeros(16)
    hc.launch(kernel, (5,), [x, 7, True])
    assert len(kernel.jit_calls) == 1
    compiled = hc.launch(kernel, (5, 2), [torch.ones(16), 7, True])      # a repeat: no JIT
    assert len(kernel.jit_calls) == 1
    assert compiled.calls == [(5, 2, 1, 1234, "fn", "meta", None, None, None, compiled.calls[0][-3], 7, True)]
    hc.launch(kernel, (5,), [x, 8, True])                                 # another int: JIT
    hc.launch(kernel, (5,), [x, 7, True], num_warps=8)                    # other options: JIT
    assert len(kernel.jit_calls) == 3
    short = _Kernel(4)                                                    # a defaulted parameter:
    for _ in range(2):                                                    # always the JIT
        hc.launch(short, (1,), [x, 7, True])
    assert len(short.jit_calls) == 2
    from triton import knobs                                              # a launch hook: the JIT
    hook = lambda *a: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        hc.launch(kernel, (5,), [x, 7, True])
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.jit_calls) == 4
    hc.launch(kernel, (5,), [x, 7, True])
    assert len(kernel.jit_calls) == 4


def test_verify_mode_catches_a_key_that_merges_specializations(fake_gpu, monkeypatch):
    kernel = _Kernel(2)
    monkeypatch.setattr(hc, "VERIFY_LAUNCHES", True)
    x = torch.zeros(16)
    hc.launch(kernel, (1,), [x, 7])
    hc.launch(kernel, (1,), [x, 7])                                       # Triton agrees
    kernel.by_key.clear()                                                 # now it would not
    with pytest.raises(AssertionError, match="two specializations"):
        hc.launch(kernel, (1,), [x, 7])
