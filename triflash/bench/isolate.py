"""Peers measured in processes of their own (``--isolate``, default: the Dao-AILab packages
fa2 / fa3 / fa4 on CUDA).

Why: importing a peer can change the cost of every torch call in the process. With
FlashAttention-4 (CuTe DSL, tvm-ffi) imported, the host time per call of cuDNN's forward at
1k-2k tokens rose from 0.09 to 0.136 ms and triflash's host-bound 1k rows dropped by up to a
third (``benchmarks/NOTES.md`` at fb45c0d, section bb86392, item 4). A training or serving
process runs one attention library, not several, so an isolated peer is loaded, made and
timed in a ``spawn``ed worker that imports no other implementation.

Nothing else changes: the parent makes the inputs and the fp32 reference once per case and
hands the worker the same tensors (torch.multiprocessing shares them: CUDA IPC on the GPU,
shared memory on the CPU), the worker runs ``runner.run_impl`` on them (correctness check,
timing, host time) and keeps its timed callables, and later rounds (``--rounds``) ask it to
time them again in the parent's interleaved order. The worker's GPU work never overlaps the
parent's: every request is answered before the next measurement starts. ``family="decode"``
does the same for the decoding benchmark's impls (``decode.py``: its inputs, its run_impl).
"""
import queue

from .peers import make_impl


def _factory(family):
    if family == "decode":
        from .decode import make_impl as make_decode_impl
        return make_decode_impl
    return make_impl


def _worker(name, device, requests, replies, family="attn"):
    """The worker's loop: one request at a time, one reply each ("ok", value) or ("err", text)."""
    import traceback

    from .runner import Inputs, bench, free_memory, run_impl
    impl = _factory(family)(name)
    try:
        impl.load()
        replies.put(("ok", impl.version()))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which skips the peer
        replies.put(("err", f"import failed: {type(e).__name__}: {e}"))
        return
    timers = {}
    case_state = {}  # the current case's tensors (the parent's memory), until "end_case"
    while True:
        kind, *payload = requests.get()
        if kind == "stop":
            return
        try:
            if kind == "case":
                case, tensors, ref, modes, timing, inference_fwd, keep_timers = payload
                q, k, v, dout = tensors
                case_state.update(x=Inputs(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout),
                                  ref=ref)
                del q, k, v, dout, tensors, ref
                timers.clear()
                rows = run_impl(impl, case, case_state["x"], case_state["ref"], modes, device, timing,
                                inference_fwd, timers if keep_timers else None)
                replies.put(("ok", rows))
            elif kind == "decode_case":
                from . import decode
                case, tensors, ref, timing, keep_timers = payload
                case_state.update(x=decode.DecodeInputs(**tensors), ref=ref)
                del tensors, ref
                timers.clear()
                rows = decode.run_impl(impl, case, case_state["x"], case_state["ref"], device, timing,
                                       timers if keep_timers else None)
                replies.put(("ok", rows))
            elif kind == "time":
                mode, timing = payload
                replies.put(("ok", bench(timers[mode], device, **timing)[0]))
            elif kind == "end_case":  # let go of the parent's tensors before it frees them
                timers.clear()
                case_state.clear()
                free_memory(device)
                replies.put(("ok", None))
            else:
                replies.put(("err", f"unknown request {kind!r}"))
        except Exception as e:  # noqa: BLE001 - the parent records it as run_impl's failure
            replies.put(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))


class RemoteTimer:
    """A timed callable that lives in an isolated peer's worker (``runner.retime`` asks the
    worker for the measurement instead of timing this object)."""

    def __init__(self, impl, mode):
        self.impl, self.mode = impl, mode

    def remote_ms(self, timing):
        return self.impl.call("time", self.mode, timing)


class Isolated:
    """An impl (``peers.make_impl(name)``) loaded, made and timed in a worker process; the
    parent keeps an unloaded twin for ``unsupported`` (a question about the case alone)."""

    def __init__(self, name, device, family="attn"):
        self.name, self.device, self.family = name, device, family
        self._twin = _factory(family)(name)
        self.devices = self._twin.devices
        self._proc = self._version = None

    def load(self):
        import torch.multiprocessing as tmp
        ctx = tmp.get_context("spawn")
        self._requests, self._replies = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=_worker, args=(self.name, self.device, self._requests,
                                                       self._replies, self.family), daemon=True)
        self._proc.start()
        try:
            self._version = self._reply()
        except RuntimeError:
            self.close()
            raise

    def _reply(self):
        while True:
            try:
                status, value = self._replies.get(timeout=2.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"{self.name}'s worker process died "
                                       f"(exit code {self._proc.exitcode})") from None
                continue
            if status == "err":
                raise RuntimeError(value)
            return value

    def call(self, kind, *payload):
        if self._proc is None or not self._proc.is_alive():
            raise RuntimeError(f"{self.name}'s worker process is not running")
        self._requests.put((kind, *payload))
        return self._reply()

    def unsupported(self, case):
        return self._twin.unsupported(case)

    def version(self):
        return self._version

    def measure(self, case, x, ref, modes, timing, inference_fwd=False, timers=None):
        """``runner.run_impl`` in the worker on the parent's tensors; ``timers`` gets
        ``RemoteTimer``s for later rounds."""
        tensors = (x.q.detach(), x.k.detach(), x.v.detach(), x.dout)
        rows = self.call("case", case, tensors, ref, list(modes), dict(timing), inference_fwd,
                         timers is not None)
        if timers is not None:
            timers.update((m, RemoteTimer(self, m)) for m in modes)
        return rows

    def measure_decode(self, case, x, ref, timing, timers=None):
        """``decode.run_impl`` in the worker on the parent's tensors (``family="decode"``)."""
        rows = self.call("decode_case", case, x.tensors(), ref, dict(timing), timers is not None)
        if timers is not None:
            timers.update((m, RemoteTimer(self, m)) for m in rows)
        return rows

    def layout(self, case):
        return self._twin.layout(case)

    def end_case(self):
        """The worker drops the case's tensors (before the parent frees them)."""
        if self._proc is not None and self._proc.is_alive():
            self.call("end_case")

    def close(self):
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._requests.put(("stop",))
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._proc = None


__all__ = ["Isolated", "RemoteTimer"]
