"""``hopper.common.launch``: repeat launches skip Triton's argument binding by keying the
compiled kernel on a tuple that must fix everything Triton specializes on. CPU: the key
itself and the launcher's decisions against a stand-in kernel (the GPU suite runs with
TRIFLASH_VERIFY_LAUNCHES=1, where every repeat is checked against Triton's own choice)."""
import inspect

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


def test_launch_key_of_tuple_arguments():
    """Tuples of host scalars (a kernel's strides) and constexpr NamedTuples (``hopper.fwd``'s
    ``FwdMeta``) key element by element, as Triton specializes them."""
    from typing import NamedTuple

    class Meta(NamedTuple):
        A: int
        B: bool
    key = hc._launch_key
    assert key([(3, 0.5), Meta(1, True)]) == key([(3, 0.5), Meta(1, True)])
    assert key([(1, 16)]) != key([(16, 1)]) != key([(16, 17)])            # values, in order
    assert key([(1, 2)]) != key([1, 2]) and key([((1,), 2)]) != key([(1, 2)])  # grouping
    assert key([(1, True)]) != key([(1, 1)]) and key([Meta(1, True)]) != key([(1, True)])
    assert key([Meta(1, True)]) != key([Meta(1, False)])
    assert key([(1, "a string")]) is None                                 # cannot key: no cache


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
        def go(*args, num_warps, enable_fp_fusion):
            assert enable_fp_fusion is True  # (every launch states it: kernels.common.FP_FUSION)
            self.jit_calls.append((grid, args, num_warps))
            return self._compiled(args)
        return go

    def run(self, *args, grid, warmup, num_warps, enable_fp_fusion):
        assert warmup and enable_fp_fusion is True
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


# ---- launch plans (hopper.common.planned_launch) ---------------------------------------------

@pytest.fixture
def fake_fwd(fake_gpu, monkeypatch):
    """hopper.fwd's host code on CPU tensors, its kernel a stand-in that records launches."""
    from triflash.kernels.hopper import fwd as H
    monkeypatch.setattr(hc, "_PLANS", {})
    monkeypatch.setattr(hc, "_capturing", lambda: False)
    monkeypatch.setattr(hc, "VERIFY_LAUNCHES", False)  # (the GPU suite sets it)
    monkeypatch.setitem(hc._NUM_SMS, torch.device("cpu"), 132)
    kernel = _Kernel(len(inspect.signature(H.hopper_fwd_kernel.fn).parameters))
    monkeypatch.setattr(H, "hopper_fwd_kernel", kernel)
    return H, kernel


def _fwd_case(H, shape, hk, d, causal, window, softcap, seed):
    from triflash.kernels import configs, problem
    b, sq, sk, h = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, generator=g, dtype=torch.bfloat16) for _ in range(2))
    out, lse = problem.alloc_fwd_outputs(q, v, False)
    params = problem.AttnParams(d ** -0.5, window, 0 if causal else -1, softcap, sq, sk)
    return (q, k, v, out, lse), params, configs.SM90_HOPPER_FWD[hc.kernel_head_dim(d)]


@pytest.mark.parametrize("shape,hk,d,causal,window,softcap", [
    ((2, 113, 203, 4), 2, 64, False, -1, 0.0), ((16, 1024, 1024, 16), 16, 128, True, -1, 0.0),
    ((1, 777, 2048, 8), 4, 256, True, 200, 30.0), ((3, 1, 1, 2), 1, 96, False, 5, 0.0),
    ((1, 4096, 4096, 36), 36, 256, True, -1, 0.0), ((2, 300, 300, 8), 8, 192, False, -1, 0.0)])
def test_forward_plan_passes_what_kernel_args_builds(fake_fwd, shape, hk, d, causal, window, softcap):
    """A repeat forward call launches through its signature's plan: the compiled kernel, grid
    and every argument as ``kernel_args`` builds them for the repeat's own tensors (fresh
    ones: nothing of the first call's is passed again)."""
    H, kernel = fake_fwd
    first, params, cfg = _fwd_case(H, shape, hk, d, causal, window, softcap, seed=0)
    H.fwd(*first, params, cfg)
    assert len(kernel.jit_calls) == 1 and len(hc._PLANS) == 1
    again, _, _ = _fwd_case(H, shape, hk, d, causal, window, softcap, seed=1)
    H.fwd(*again, params, cfg)
    assert len(kernel.jit_calls) == 1                                     # the plan, not the JIT
    (compiled,) = kernel.by_key.values()
    grid, args = H.kernel_args(*again, params, cfg, num_sms=132)
    launched = compiled.calls[-1]
    assert launched[:3] == (grid[0], 1, 1) and launched[3:9] == (1234, "fn", "meta", None, None, None)
    assert hc._same_args(list(launched[9:]), args)
    assert not hc._same_args(list(launched[9:]), H.kernel_args(*first, params, cfg, num_sms=132)[1])


def test_forward_plans_are_per_signature(fake_fwd):
    """Another shape, stride, dtype, mask or tile is another plan; a tensor passed in two
    roles (q is k) has its list built every time; under a launch hook, a CUDA graph capture
    or TRIFLASH_VERIFY_LAUNCHES the list is built, and the last checks the plan against it."""
    H, kernel = fake_fwd
    base = ((2, 128, 128, 4), 4, 64, True, -1, 0.0)
    tensors, params, cfg = _fwd_case(H, *base, seed=0)
    H.fwd(*tensors, params, cfg)
    H.fwd(*tensors, params, cfg)
    assert len(hc._PLANS) == 1
    import dataclasses
    H.fwd(*tensors, dataclasses.replace(params, window_right=-1), cfg)      # not causal
    H.fwd(*tensors, params, dataclasses.replace(cfg, stages=2))             # another tile
    q, k, v, out, lse = tensors
    H.fwd(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, out, lse, params, cfg)  # strides
    assert len(hc._PLANS) == 4
    for _ in range(2):
        H.fwd(q, q, q, out, lse, params, cfg)                               # aliases: no plan
    assert len(hc._PLANS) == 4
    launched = [c for c in kernel.by_key.values() if c.calls][0].calls[-1]
    assert hc._same_args(list(launched[9:]), H.kernel_args(q, q, q, out, lse, params, cfg, num_sms=132)[1])
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.setattr(hc, "_capturing", lambda: True)
        H.fwd(*tensors, params, cfg)                                        # capturing: built
    with monkeypatch.context() as m:
        m.setattr(hc, "VERIFY_LAUNCHES", True)
        H.fwd(*_fwd_case(H, *base, seed=3)[0], params, cfg)                 # the plan agrees
        ((dev, key), plan), = [(k_, p) for k_, p in hc._PLANS.items() if k_[1][-1] == cfg
                               and k_[1][-2] == params and k_[1][2] == q.stride()]
        i, _, box, layout = plan.slots[0]
        plan.slots[0] = (i, 1, box, layout)                                 # a broken plan: Q's
        # descriptor over k
        with pytest.raises(AssertionError, match="launch plan"):
            H.fwd(*tensors, params, cfg)


@pytest.mark.parametrize("d,deterministic,causal,pieces", [
    (64, False, True, 1), (128, False, False, 1), (128, True, True, 1), (96, False, False, 1),
    (128, False, False, 4), (256, False, True, 1), (192, True, False, 1)])
def test_backward_plans_agree_with_the_built_arguments(fake_gpu, monkeypatch, d, deterministic, causal,
                                                       pieces):
    """The backward's launches (dense) go through plans: statistics, dK/dV (hopper/bwd.py's
    kernel, or bwd256's at 192 / 256) and the separate dQ kernel where it runs
    (deterministic=True, or 192 / 256). With TRIFLASH_VERIFY_LAUNCHES=1 a repeat builds its
    arguments as well and the plan must pass the same (fresh tensors each call: q, k, v,
    dout, out, lse and the buffers the backward allocates, the split tiles' piece buffer
    with the last-wave split forced, ``pieces``); without it a repeat takes the plan (no new
    specialization)."""
    from triflash.kernels import configs, problem
    from triflash.kernels.hopper import bwd as HB
    from triflash.kernels.hopper import bwd256, bwd_dq, bwd_stats
    monkeypatch.setattr(hc, "_PLANS", {})
    monkeypatch.setattr(hc, "_capturing", lambda: False)
    monkeypatch.setattr(hc, "VERIFY_LAUNCHES", False)  # (the GPU suite sets it)
    fakes = {}
    monkeypatch.setitem(hc._NUM_SMS, torch.device("cpu"), 132)
    for mod, name in ((HB, "hopper_bwd_kernel"), (bwd_stats, "bwd_stats_kernel"), (HB, "_scale_cast_kernel"),
                      (HB, "_split_fixup_kernel"), (bwd_dq, "hopper_dq_kernel"),
                      (bwd256, "hopper_bwd256_kernel")):
        fakes[name] = _Kernel(len(inspect.signature(getattr(mod, name).fn).parameters))
        monkeypatch.setattr(mod, name, fakes[name])
    b, s, h, hk = 2, 200, 4, 2
    params = problem.AttnParams(d ** -0.5, -1, 0 if causal else -1, 0.0, s, s)
    cfg = configs.SM90_HOPPER_BWD[hc.kernel_head_dim(d)]
    if pieces > 1:  # (every key tile split: the shape's 8 tiles on 132 SMs would not)
        monkeypatch.setattr(HB, "tail_pieces", lambda n_tiles, n_sm: pieces)

    def call(seed):
        g = torch.Generator().manual_seed(seed)
        q, out, dout = (torch.randn(b, s, h, d, generator=g, dtype=torch.bfloat16) for _ in range(3))
        k, v = (torch.randn(b, s, hk, d, generator=g, dtype=torch.bfloat16) for _ in range(2))
        lse = torch.randn(b, h, s, generator=g)
        HB.bwd(dout, q, k, v, out, lse, params, deterministic, cfg)
    call(0)
    separate_dq = deterministic or d in (192, 256)
    assert len(hc._PLANS) == 2 + separate_dq                              # stats, dK/dV (, dQ)
    assert bool(fakes["hopper_dq_kernel"].jit_calls) == separate_dq
    assert bool(fakes["hopper_bwd256_kernel"].jit_calls) == (d in (192, 256))
    assert bool(fakes["_split_fixup_kernel"].jit_calls) == (pieces > 1 and not deterministic)
    if pieces > 1:  # 1D grid: each of the 8 key tiles (2 blocks x 2 KV heads x 2) in 4 pieces
        assert fakes["hopper_bwd_kernel"].jit_calls[0][0] == (32, 1, 1)
    monkeypatch.setattr(hc, "VERIFY_LAUNCHES", True)
    call(1)                                                               # asserts inside
    monkeypatch.setattr(hc, "VERIFY_LAUNCHES", False)
    jit = {n: len(f.jit_calls) for n, f in fakes.items()}
    call(2)
    assert {n: len(f.jit_calls) for n, f in fakes.items()} == jit
    dkdv = "hopper_bwd256_kernel" if d in (192, 256) else "hopper_bwd_kernel"
    assert len(fakes[dkdv].by_key) == 1 and len(fakes["bwd_stats_kernel"].by_key) == 1
    assert len(fakes["hopper_dq_kernel"].by_key) == separate_dq


# ---- plans past Triton's launcher wrapper (LaunchPlan.direct) --------------------------------

def _fake_map(desc, meta):
    """Stands in for ``make_tensordesc_arg``: (the map, shape, strides), the map a function
    of everything the real one encodes."""
    return [("map", desc.base.data_ptr(), tuple(desc.block_shape), meta), *desc.shape, *desc.strides]


def _wrapped_launcher(launcher, tensordesc_indices, tensordesc_meta):
    """The shape of triton 3.6's ``wrap_handle_tensordesc``: what ``_direct_launcher`` opens."""
    def inner(*args):
        final_args = list(args[:13])
        n = 0
        for i, arg in enumerate(args[13:]):
            if i in tensordesc_indices:
                final_args.extend(_fake_map(arg, tensordesc_meta[n]))
                n += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner


class _Runner:
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, indices, meta):
        self.raw_calls = []
        self.launch = _wrapped_launcher(lambda *a: self.raw_calls.append(a), set(indices), meta)

    def __call__(self, gx, gy, gz, stream, function, *args):
        self.launch(gx, gy, gz, stream, function, False, False, None, None, *args)


class _WrappedCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, args):
        indices = [i for i, a in enumerate(args) if a.__class__ is hc.TensorDescriptor]
        self.run = _Runner(indices, [{"swizzle": i} for i in indices])


@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (256, True)])
def test_plan_launches_past_the_wrapper_as_the_wrapper_would(fake_fwd, monkeypatch, d, causal):
    """A plan over Triton's launcher wrapper keeps the expanded list and refills only the
    call's tensors and their descriptors' maps: each repeat passes the C launcher exactly
    what the wrapper would have made of the list ``kernel_args`` builds for it (fresh tensors
    every call, one of them at the first call's address, so a kept map is reused)."""
    from triton.backends.nvidia import driver as nvidia_driver
    H, _ = fake_fwd
    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", _fake_map)
    shape = (2, 300, 300, 4)
    first, params, cfg = _fwd_case(H, shape, 2, d, causal, -1, 0.0, seed=0)
    grid, args = H.kernel_args(*first, params, cfg, num_sms=132)
    compiled = _WrappedCompiled(args)
    plan = hc.LaunchPlan(compiled, grid, args, first)
    assert plan.direct is not None
    assert not any(x is t for x in plan.flat for t in first)  # holds no call's tensor (a kept
    del args                                                     # schedule table it may)
    wrapper = compiled.run
    for seed in (1, 2, 3):
        tensors, _, _ = _fwd_case(H, shape, 2, d, causal, -1, 0.0, seed=seed)
        if seed == 3:  # the same q as the call before (a kept map): still its own call's
            tensors = (kept_q,) + tensors[1:]
        kept_q = tensors[0]
        plan.run(tensors, 0)
        direct = wrapper.raw_calls.pop()
        _, built = H.kernel_args(*tensors, params, cfg, num_sms=132)
        wrapper(grid[0], 1, 1, 1234, "fn", "meta", None, None, None, *built)
        expected = wrapper.raw_calls.pop()
        assert len(direct) == len(expected)
        for x, y in zip(direct, expected):
            assert x is y if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) else x == y


def test_plans_fall_back_to_the_launcher_they_cannot_open(fake_fwd):
    """A launcher that is not the wrapper ``_direct_launcher`` knows (a stand-in, scratch
    buffers, a descriptor without metadata): the plan calls ``compiled.run`` as before."""
    H, _ = fake_fwd
    first, params, cfg = _fwd_case(H, (1, 128, 128, 2), 2, 128, False, -1, 0.0, seed=0)
    grid, args = H.kernel_args(*first, params, cfg, num_sms=132)
    assert hc.LaunchPlan(_Compiled(), grid, args, first).direct is None
    scratch = _WrappedCompiled(args)
    scratch.run.global_scratch_size = 64
    assert hc.LaunchPlan(scratch, grid, args, first).direct is None
    no_meta = _WrappedCompiled(args)
    no_meta.run.launch = _wrapped_launcher(no_meta.run.launch, {0}, [None])
    assert hc.LaunchPlan(no_meta, grid, args, first).direct is None
