"""``python -m triflash.bench`` / ``triflash-bench``: the command line. See the package
docstring (triflash/bench/__init__.py) for usage and the JSON schema."""
import argparse
import json
import os
import subprocess
import sys

from . import cases as C
from . import decode_cases as DC
from . import report
from .plot import plot as make_plot
from .plot import plot_decode as make_decode_plot
from .isolate import Isolated
from .peers import CPU_IMPLS, GPU_IMPLS, ISOLATED_BY_DEFAULT, SUBJECTS, make_impl

INTERP_WARNING = ("NOTE: running on the CPU under Triton's interpreter (TRITON_INTERPRET=1). "
                  "Timings here mean NOTHING; this run only checks correctness.")
# batch * heads * seqlen_q * seqlen_k * headdim of the cpu preset's largest case: seconds
INTERP_QUICK_WORK = 1 * 2 * 128 * 128 * 64
LAUNCH_BOUND = 0.7  # note rows whose host time per call exceeds this fraction of the GPU time
SHAPE_FLAGS = ("headdims", "seqlens", "batch", "nheads", "total_tokens")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m triflash.bench", description=(
        "Benchmark triflash against SDPA, FlexAttention and FlashAttention 2/3/4 "
        "(TFLOPS in FlashAttention's convention), with a correctness check per case."))
    p.add_argument("--preset", choices=sorted(C.PRESETS) + sorted(DC.PRESETS), help=(
        "named case set: seed (1x8192x36x256), h200 (README set), fa3 (FA3's sweep), "
        "cpu (tiny, interpreter); decode (KV-cache decoding, TB/s against a copy), "
        "decode-cpu (tiny decode cases, interpreter). Default: h200 on CUDA, cpu otherwise; "
        "fa3 when shape flags are given"))
    p.add_argument("--impls", nargs="+", default=["all"], metavar="IMPL",
                   help=f"comma/space separated; default all. GPU: {','.join(GPU_IMPLS)}; "
                        f"CPU: {','.join(CPU_IMPLS)}. --preset decode: GPU "
                        f"{','.join(DC.GPU_IMPLS)}; CPU {','.join(DC.CPU_IMPLS)}")
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=C.MODES)
    g = p.add_argument_group("shapes", "with --preset, the shape flags (headdims, seqlens, "
                             "batch, nheads, total-tokens) select among its cases; without, they "
                             "define the cases (FA3's sweep defaults on CUDA, tiny ones on the CPU)")
    g.add_argument("--headdims", "--headdim", nargs="+", type=int)
    g.add_argument("--seqlens", "--seqlen", nargs="+", type=int)
    g.add_argument("--seqlen-k", type=int, help="key length (default: = seqlen_q)")
    g.add_argument("--total-tokens", type=int, help="batch = total_tokens // seqlen (FA3 style, 16384)")
    g.add_argument("--batch", type=int, help="explicit batch (overrides --total-tokens)")
    g.add_argument("--nheads", type=int, help="default: 2048 // headdim")
    g.add_argument("--nheads-kv", type=int, help="GQA/MQA: number of KV heads")
    g.add_argument("--headdim-v", type=int)
    g.add_argument("--causal", choices=["both", "true", "false"], default="both")
    g.add_argument("--window", nargs=2, type=int, metavar=("LEFT", "RIGHT"),
                   help="sliding window (FA convention, -1 = unbounded)")
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp8"], help=(
        "default bf16 on CUDA, fp16 on CPU; fp8 (e4m3 q and caches, FA3's fp8 forward): the decode presets only"))
    t = p.add_argument_group("timing and checking")
    t.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    t.add_argument("--warmup", type=int, default=50, help="do_bench warmup, ms (default 50)")
    t.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms (default 200)")
    t.add_argument("--rounds", type=int, default=1, help=(
        "time every impl of a case this many times, interleaved, and keep the median "
        "(default 1; the first round is the one that also checks correctness)"))
    t.add_argument("--inference-fwd", action="store_true",
                   help="time fwd under torch.no_grad() (default: autograd on, a training forward)")
    t.add_argument("--cpu-reps", type=int, default=1, help="calls timed per measurement on the CPU")
    t.add_argument("--only-seqlens", action="append", default=[], metavar="IMPL=S1,S2",
                   help="run IMPL only on cases with these seqlens (e.g. flex=8192: its "
                        "torch.compile per shape costs ~20 s a case); repeatable")
    t.add_argument("--isolate", nargs="+", default=["default"], metavar="IMPL", help=(
        "impls loaded and timed in a worker process of their own, so that what their import "
        "does to the process (host time per torch call) falls on no other impl; default: "
        f"{','.join(ISOLATED_BY_DEFAULT)} on CUDA; 'none' for none"))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ref-budget-gb", type=float, default=2.0, help=(
        "fp32 score bytes the reference may materialize per case; larger cases are checked "
        "on a leading subset of batch/heads (default 2)"))
    t.add_argument("--no-check", action="store_true", help="skip the correctness check")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=os.path.join("bench-out", "results.json"),
                   help="JSON results (default %(default)s; the plot beside it)")
    o.add_argument("--plot", help="PNG path (default: the JSON path with .png)")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--commit", help="commit to record when the copy is not a git checkout")
    o.add_argument("--resume", metavar="JSON", help=(
        "a partial results file (.json or .json.gz) of the same commit and preset, e.g. one "
        "a time limit stopped: its cases are kept, not measured again (each case's rows, "
        "hence every ratio, still come from one process); the rest are measured"))
    o.add_argument("--list", action="store_true", help="print the cases and exit")
    return p.parse_args(argv)


def choose_device(args):
    import torch
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")
    return args.device


def _interpreting():
    from triflash.dispatch import interpreting
    return interpreting()


def rerun_under_interpreter(argv, in_process):
    """`python -m triflash.bench` imports the triflash package before this code runs, and
    Triton reads TRITON_INTERPRET when the kernels are defined. On the CPU, run again in a
    process that has TRITON_INTERPRET=1 from the start."""
    if os.environ.get("TRIFLASH_BENCH_REEXEC"):
        sys.exit("TRITON_INTERPRET=1 did not take effect; cannot run on the CPU")
    env = dict(os.environ, TRITON_INTERPRET="1", TRIFLASH_BENCH_REEXEC="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [report.REPO_DIR, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "triflash.bench", *argv]
    print("CPU run: starting again under Triton's interpreter (TRITON_INTERPRET=1)", flush=True)
    if in_process:  # main([...]) from Python (tests): keep the caller's process alive
        return subprocess.run(cmd, env=env).returncode
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)


def select_impls(args, device):
    names = [n for item in args.impls for n in item.split(",") if n]
    if names == ["all"]:
        names = list(GPU_IMPLS if device == "cuda" else CPU_IMPLS)
    known = set(GPU_IMPLS) | set(CPU_IMPLS)
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown impl(s) {unknown}; choose from {sorted(known)}")
    return names


def build_case_list(args, device):
    """(preset name, cases). With --preset, shape flags keep only the matching cases; without,
    they replace the defaults (FA3's sweep on CUDA, the tiny CPU group otherwise)."""
    shape = {f: getattr(args, f) for f in SHAPE_FLAGS}
    explicit = any(v is not None for v in shape.values())
    if args.dtype == "fp8":
        sys.exit("--dtype fp8: the decode presets only (fp8 has no backward)")
    common = dict(causal=args.causal, dtype=args.dtype or ("bf16" if device == "cuda" else "fp16"),
                  window=args.window, nheads_kv=args.nheads_kv, seqlen_k=args.seqlen_k,
                  headdim_v=args.headdim_v)
    try:
        if args.preset:
            cases = C.filter_cases(C.build_cases(C.PRESETS[args.preset], **common), **shape)
            if not cases:
                sys.exit(f"--preset {args.preset}: no case matches "
                         f"{ {k: v for k, v in shape.items() if v is not None} } (see --list)")
            return args.preset, cases
        if not explicit:
            preset = "h200" if device == "cuda" else "cpu"
            return preset, C.build_cases(C.PRESETS[preset], **common)
        base = "fa3" if device == "cuda" else "cpu"
        return f"custom ({base} defaults)", C.build_cases(C.PRESETS[base], overrides=shape, **common)
    except ValueError as e:
        sys.exit(str(e))


class Progress:
    """tqdm when importable, else one printed line per step."""

    def __init__(self, total):
        self.total, self.n = total, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="run", dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def step(self, text):
        self.n += 1
        if self.bar is not None:
            self.bar.set_description(text)
            self.bar.update(1)
        else:
            print(f"[{self.n}/{self.total}] {text}", flush=True)

    def write(self, text):
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def isolated_names(args, device):
    names = [n for item in args.isolate for n in item.split(",") if n]
    if names == ["default"]:
        return set(ISOLATED_BY_DEFAULT) if device == "cuda" else set()
    return set() if names == ["none"] else set(names)


def load_impls(names, device, skipped, isolate=()):
    impls = []
    for name in names:
        impl = Isolated(name, device) if name in isolate else make_impl(name)
        if device not in impl.devices:
            skipped[name] = f"needs {' or '.join(impl.devices)}; this run is on {device}"
        else:
            try:
                impl.load()
                impls.append(impl)
                continue
            except Exception as e:  # noqa: BLE001 - any import problem means "not available"
                skipped[name] = f"import failed: {type(e).__name__}: {e}"
        print(f"skipping {name}: {skipped[name]}", flush=True)
    return impls


def _derive(rows, case):
    """TFLOPS and the backward/forward time ratio of one impl's {mode: row} from their ms."""
    from triflash.testing import flops
    for mode, row in rows.items():
        fl = flops(case.batch, case.nheads, case.seqlen_q, case.seqlen_k, case.headdim,
                   case.headdim_v, case.causal, tuple(case.window_size), mode=mode)
        row["tflops"] = fl / (row["ms"] * 1e-3) / 1e12
    if "fwd" in rows and "bwd" in rows:
        rows["bwd"]["bwd_fwd_ratio"] = rows["bwd"]["ms"] / rows["fwd"]["ms"]


def load_resume(path, commit, preset, gpu):
    """The result rows and date of a partial results file of ``commit`` (or a prefix of it),
    ``preset`` and ``gpu``."""
    import gzip
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        data = json.load(f)
    meta = data.get("meta", {})
    for key, want in (("commit", commit), ("preset", preset), ("gpu", gpu)):
        have = meta.get(key)
        same = (have and want and (have.startswith(want) or want.startswith(have))) if key == "commit" \
            else have == want
        if not same:
            raise SystemExit(f"--resume {path}: its {key} is {have!r}, this run's is {want!r}; "
                             "a run resumes only its own commit, preset and GPU")
    return data.get("results", []), meta.get("date")


def case_key(fields):
    """A case's identity in result rows: its fields (shape, mask, dtype), nothing measured."""
    keys = C.Case.__dataclass_fields__
    return json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in fields.items() if k in keys},
                      sort_keys=True)


def run_cases(cases, impls, args, device, skipped, on_case=None, done=None):
    """Measure everything; returns the result rows. ``on_case(results)`` runs after each case;
    ``done``: rows by case label that are kept instead of measured (``--resume``)."""
    import torch
    from .runner import free_memory, make_inputs, reference, retime, run_impl
    timing = dict(warmup=args.warmup, rep=args.rep, cpu_reps=args.cpu_reps)
    budget = int(args.ref_budget_gb * (1 << 30) / 4)
    need_grad = any(m != "fwd" for m in args.modes)
    tried = set()  # impls that ran (or failed) on a case already
    only = {}
    for item in args.only_seqlens:
        name, _, lens = item.partition("=")
        only[name] = {int(x) for x in lens.split(",") if x}
    results = []
    progress = Progress(len(cases) * len(impls))
    for case in cases:
        if done and case_key(case.fields()) in done:
            for impl in impls:
                progress.step(f"{case.label()} {impl.name} (kept)")
            results += done[case_key(case.fields())]
            if on_case is not None:
                on_case(results)
            continue
        x = make_inputs(case, device, args.seed)
        ref = None if args.no_check else reference(case, x, need_grad, budget)
        case_rows = []
        rows_by_impl, timers_by_impl = {}, {}  # what later rounds time again (--rounds)
        for impl in impls:
            progress.step(f"{case.label()} {impl.name}")
            if impl.name in skipped:
                continue
            base = dict(impl=impl.name, **{**case.fields(), "varlen": getattr(impl, "varlen", False)},
                        ms=None, tflops=None,
                        max_err=dict.fromkeys(report.ERR_NAMES), passed=None, bwd_fwd_ratio=None,
                        host_ms=None,
                        note=ref.note if ref else "not checked (--no-check)")
            reason = impl.unsupported(case)
            if not reason and impl.name in only and case.seqlen_q not in only[impl.name]:
                reason = f"--only-seqlens {impl.name}={','.join(map(str, sorted(only[impl.name])))}"
            if reason:
                case_rows += [dict(base, mode=m, note=f"skipped: {reason}") for m in args.modes]
                continue
            try:
                timers = {} if args.rounds > 1 else None
                if isinstance(impl, Isolated):
                    measured = impl.measure(case, x, ref, args.modes, timing, args.inference_fwd, timers)
                else:
                    measured = run_impl(impl, case, x, ref, args.modes, device, timing,
                                        args.inference_fwd, timers)
            except Exception as e:  # noqa: BLE001 - recorded, never hidden
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                if impl.name in SUBJECTS:
                    progress.write(f"!!! {impl.name} FAILED to run {case.label()}: {msg}")
                    case_rows += [dict(base, mode=m, passed=False, note=f"error: {msg}") for m in args.modes]
                else:
                    if impl.name not in tried:
                        skipped[impl.name] = f"failed on its first case ({case.label()}): {msg}"
                    progress.write(f"skipping {impl.name} on {case.label()}: {msg}")
                    case_rows += [dict(base, mode=m, note=f"skipped: {msg}") for m in args.modes]
                if device == "cuda":
                    torch.cuda.synchronize()
            else:
                rows = {}
                for mode, m in measured.items():
                    rows[mode] = dict(base, mode=mode, **m)
                    if m["host_ms"] is not None and m["host_ms"] > LAUNCH_BOUND * m["ms"]:
                        rows[mode]["note"] = "; ".join(filter(None, [
                            rows[mode]["note"], f"launch-bound? host {m['host_ms']:.3f} ms/call"]))
                _derive(rows, case)
                if timers:
                    rows_by_impl[impl.name], timers_by_impl[impl.name] = rows, timers
                case_rows += rows.values()
            tried.add(impl.name)
            free_memory(device)
        if timers_by_impl:
            retime(rows_by_impl, timers_by_impl, device, timing, args.rounds)
            for rows in rows_by_impl.values():
                _derive(rows, case)
        del rows_by_impl, timers_by_impl
        _end_case(impls, skipped)
        results += case_rows
        if case_rows:
            progress.write("\n" + report.detail_table(case_rows) + "\n")
        del x, ref
        free_memory(device)
        if on_case is not None:
            on_case(results)
    progress.close()
    return results


def _end_case(impls, skipped):
    """Ends the case in each worker process (``Isolated``); an impl whose worker died is
    ``skipped`` (impl name -> reason) from then on."""
    for impl in impls:
        if isinstance(impl, Isolated) and impl.name not in skipped:
            try:
                impl.end_case()
            except RuntimeError as e:  # its worker died: no later case for it
                skipped[impl.name] = str(e).splitlines()[0][:300]


DECODE_IGNORED = ("total_tokens", "seqlen_k", "nheads_kv", "headdim_v", "window", "only_seqlens")


def build_decode_cases(args, device):
    """The decode preset's cases; --headdims, --seqlens (cache lengths), --batch and
    --nheads select among them."""
    given = [f"--{f.replace('_', '-')}" for f in DECODE_IGNORED if getattr(args, f)]
    if given:
        sys.exit(f"--preset {args.preset}: {', '.join(given)} do not apply (the cases are fixed; "
                 "--headdims, --seqlens, --batch and --nheads select among them)")
    cases = DC.filter_cases(DC.build_cases(args.preset, args.dtype or ("bf16" if device == "cuda" else "fp16")),
                            headdims=args.headdims, seqlens=args.seqlens, batch=args.batch, nheads=args.nheads)
    if not cases:
        sys.exit(f"--preset {args.preset}: no case matches the shape flags (see --list)")
    return cases


def select_decode_impls(args, device):
    names = [n for item in args.impls for n in item.split(",") if n]
    if names == ["all"]:
        names = list(DC.GPU_IMPLS if device == "cuda" else DC.CPU_IMPLS)
    known = set(DC.GPU_IMPLS) | set(DC.CPU_IMPLS)
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown decode impl(s) {unknown}; choose from {sorted(known)}")
    return names


def load_decode_impls(names, device, skipped, isolate=()):
    from .decode import make_impl as make_decode_impl
    impls = []
    for name in names:
        impl = Isolated(name, device, family="decode") if name in isolate else make_decode_impl(name)
        if device not in impl.devices:
            skipped[name] = f"needs {' or '.join(impl.devices)}; this run is on {device}"
        else:
            try:
                impl.load()
                impls.append(impl)
                continue
            except Exception as e:  # noqa: BLE001 - any import problem means "not available"
                skipped[name] = f"import failed: {type(e).__name__}: {e}"[:500]
        print(f"skipping {name}: {skipped[name]}", flush=True)
    return impls


def run_decode_cases(cases, impls, args, device, skipped, on_case=None, done=None):
    """Measure every decode case; returns the result rows (schema: package docstring)."""
    from . import decode as D
    from .runner import free_memory, retime
    timing = dict(warmup=args.warmup, rep=args.rep, cpu_reps=args.cpu_reps)
    budget = int(args.ref_budget_gb * (1 << 30) / 4)
    results = []
    progress = Progress(len(cases) * len(impls))
    for case in cases:
        key = DC.case_key(case.fields())
        if done and key in done:
            for impl in impls:
                progress.step(f"{case.label()} {impl.name} (kept)")
            results += done[key]
            if on_case is not None:
                on_case(results)
            continue
        x = D.make_inputs(case, device, args.seed)
        refs = {}  # by kv_full: the keys each sequence attends to
        case_rows, rows_by_impl, timers_by_impl = [], {}, {}
        for impl in impls:
            progress.step(f"{case.label()} {impl.name}")
            if impl.name in skipped:
                continue
            layout, full = impl.layout(case)
            notes = []
            if layout == "dense" and case.page_size:
                notes.append("dense cache holding the paged case's tokens")
            if full:
                notes.append(f"reads every sequence's whole cache ({case.cache_len}): no per-sequence lengths")
            base = dict(impl=impl.name, **case.fields(), kv_layout=layout, kv_full=full,
                        kv_tokens=case.kv_tokens(full), kv_bytes=case.kv_bytes(full), ms=None, host_ms=None,
                        tb_s=None, tflops=None, max_err={"out": None}, tolerance=None, passed=None, note="")
            reason = D.dtype_unsupported(impl.name, case) or impl.unsupported(case)
            if reason:
                case_rows.append(dict(base, note=f"skipped: {reason}"))
                continue
            ref = None
            if not args.no_check:
                if full not in refs:
                    refs[full] = D.reference(case, x, full, budget)
                ref = refs[full]
            notes.append(ref.note if ref is not None else "not checked (--no-check)")
            base["note"] = "; ".join(filter(None, notes))
            try:
                timers = {} if args.rounds > 1 else None
                if isinstance(impl, Isolated):
                    measured = impl.measure_decode(case, x, ref, timing, timers)
                else:
                    measured = D.run_impl(impl, case, x, ref, device, timing, timers)
            except Exception as e:  # noqa: BLE001 - recorded, never hidden
                msg = D.error_text(e)
                if impl.name in DC.SUBJECTS:
                    progress.write(f"!!! {impl.name} FAILED to run {case.label()}: {msg}")
                    case_rows.append(dict(base, passed=False, note=f"error: {msg}"))
                else:
                    progress.write(f"skipping {impl.name} on {case.label()}: {msg}")
                    case_rows.append(dict(base, note=f"skipped: {msg}"))
                if device == "cuda":
                    import torch
                    torch.cuda.synchronize()
            else:
                rows = {}
                for mode, m in measured.items():
                    rows[mode] = row = dict(base, **m)
                    row["note"] = "; ".join(filter(None, [base["note"], m.get("note")]))
                    if m["host_ms"] is not None and m["host_ms"] > LAUNCH_BOUND * m["ms"]:
                        row["note"] = "; ".join(filter(None, [
                            row["note"], f"launch-bound? host {m['host_ms']:.3f} ms/call"]))
                    D.derive(row, case)
                if timers:
                    rows_by_impl[impl.name], timers_by_impl[impl.name] = rows, timers
                case_rows += rows.values()
            free_memory(device)
        if timers_by_impl:
            retime(rows_by_impl, timers_by_impl, device, timing, args.rounds)
            for rows in rows_by_impl.values():
                for row in rows.values():
                    D.derive(row, case)
        del rows_by_impl, timers_by_impl
        _end_case(impls, skipped)
        results += case_rows
        if case_rows:
            progress.write("\n" + report.decode_detail_table(case_rows) + "\n")
        del x, refs
        free_memory(device)
        if on_case is not None:
            on_case(results)
    progress.close()
    return results


def main_decode(args, argv, in_process):
    """``--preset decode`` (and decode-cpu): KV-cache attention in TB/s against a copy."""
    device = choose_device(args)
    cases = build_decode_cases(args, device)
    if args.list:
        print("\n".join(f"{c.label()} ({c.dtype}, {c.mode})" for c in cases))
        return 0
    if device == "cpu" and not _interpreting():
        return rerun_under_interpreter(argv, in_process)
    from . import decode as D
    interp = _interpreting()
    if interp:
        print(INTERP_WARNING, flush=True)
        if args.preset != "decode-cpu":
            print(f"WARNING: --preset {args.preset} on the interpreter runs for hours; "
                  "--preset decode-cpu is the CPU demo", flush=True)
    skipped = {}
    names = [n for item in args.isolate for n in item.split(",") if n]
    isolate = (set(DC.ISOLATED_BY_DEFAULT) if device == "cuda" else set()) if names == ["default"] \
        else set() if names == ["none"] else set(names)
    impls = load_decode_impls(select_decode_impls(args, device), device, skipped, isolate)
    print(f"{len(cases)} cases x {len(impls)} impls ({', '.join(i.name for i in impls)}) on {device}, "
          f"preset {args.preset}", flush=True)
    versions = {i.name: i.version() for i in impls if i.version()}
    done, resumed = {}, None
    if args.resume:
        now = report.collect_meta(device, args.commit)
        rows, date = load_resume(args.resume, now["commit"], args.preset, now["gpu"])
        wanted = {DC.case_key(c.fields()): c.label() for c in cases}
        for row in rows:
            if DC.case_key(row) in wanted:
                done.setdefault(DC.case_key(row), []).append(row)
        resumed = {"from": os.path.basename(args.resume), "date": date,
                   "cases_kept": [wanted[k] for k in wanted if k in done]}
        print(f"--resume: {len(done)} of {len(cases)} cases kept from {args.resume} ({date})", flush=True)
    timing = dict(warmup=args.warmup, rep=args.rep, cpu_reps=args.cpu_reps)
    copies = [D.measure_copy(device, timing)]
    print(f"copy: {copies[0]['bytes'] / 2**30:.3g} GiB in {copies[0]['ms']:.3f} ms = "
          f"{copies[0]['tb_s']:.3f} TB/s (read + written)", flush=True)

    def meta(complete):
        extra = {"resumed": resumed} if resumed else {}
        best = max(copies, key=lambda c: c["tb_s"])
        return dict(report.collect_meta(
            device, args.commit, peers_skipped=skipped, preset=args.preset, interpreter=interp,
            impl_versions=versions,
            timing={"warmup_ms": args.warmup, "rep_ms": args.rep, "return_mode": "median",
                    "rounds": args.rounds, "l2": "flushed before every timed call (do_bench)",
                    "isolated": sorted(i.name for i in impls if isinstance(i, Isolated))},
            copy_tb_s=best["tb_s"],
            copy={"bytes": best["bytes"], "ms": [c["ms"] for c in copies], "tb_s": [c["tb_s"] for c in copies],
                  "what": "dst.copy_(src) on the device, bf16; tb_s = (bytes read + written) / time / 1e12; "
                          "copy_tb_s: the fastest of the copies (before and after the cases)"},
            tb_s_convention=("K+V bytes the impl logically reads (per sequence: the keys it attends x "
                             "nheads_kv x (headdim + headdim_v) x element size) / time / 1e12"),
            **extra), complete=complete)

    try:
        results = run_decode_cases(cases, impls, args, device, skipped,
                                   on_case=lambda rows: report.write_json(args.out, meta(False), rows), done=done)
    finally:
        for impl in impls:
            if isinstance(impl, Isolated):
                impl.close()
    copies.append(D.measure_copy(device, timing))
    meta = meta(True)
    report.write_json(args.out, meta, results)
    names = [i.name for i in impls]
    print(f"\nK+V TB/s; copy {meta['copy_tb_s']:.3f} TB/s (read + written)"
          + (" -- interpreter: meaningless" if interp else ""))
    print(report.decode_summary_table(results, names, meta["copy_tb_s"]))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    print(f"\nresults: {args.out}")
    if not args.no_plot:
        png = args.plot or os.path.splitext(args.out)[0] + ".png"
        title = f"{meta['gpu']} -- commit {meta['commit'][:10]}" + (" -- TIMINGS MEANINGLESS" if interp else "")
        if make_decode_plot(results, png, title, meta["copy_tb_s"]):
            print(f"plot: {png}")
    fails = report.failures(results)
    if fails:
        print(f"\n{'!' * 72}\n{len(fails)} CORRECTNESS FAILURE(S):\n" + "\n".join(fails) + f"\n{'!' * 72}")
    else:
        print("\nall checked results within FA3 tolerance")
    if interp:
        print(INTERP_WARNING)
    return 1 if any(r["passed"] is False and r["impl"] in DC.SUBJECTS for r in results) else 0


def main(argv=None):
    """Entry point; returns the exit status (1 if a triflash row failed its check)."""
    in_process = argv is not None
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: must be >= 1")
    if args.preset in DC.PRESETS:
        return main_decode(args, argv, in_process)
    device = choose_device(args)
    preset, cases = build_case_list(args, device)
    if args.list:
        print("\n".join(f"{c.label()} ({c.dtype})" for c in cases))
        return 0
    if device == "cpu" and not _interpreting():
        return rerun_under_interpreter(argv, in_process)
    interp = _interpreting()
    if interp:
        print(INTERP_WARNING, flush=True)
    if device == "cpu" and cases and cases[0].dtype == "bf16":
        print("WARNING: the interpreter computes bf16 arithmetic wrongly; use --dtype fp16", flush=True)
    skipped = {}
    isolate = isolated_names(args, device)
    impls = load_impls(select_impls(args, device), device, skipped, isolate)
    print(f"{len(cases)} cases x {len(args.modes)} modes x {len(impls)} impls "
          f"({', '.join(i.name for i in impls)}) on {device}, preset {preset}", flush=True)
    if interp:
        work = max(c.batch * c.nheads * c.seqlen_q * c.seqlen_k * c.headdim for c in cases)
        if work > INTERP_QUICK_WORK:
            print(f"WARNING: the interpreter runs every kernel instance in Python: a case of this "
                  f"size ({work / INTERP_QUICK_WORK:.0f}x the cpu preset's largest) takes "
                  f"minutes to hours before its first line; `--preset cpu` (the default on a CPU) "
                  f"is the demo", flush=True)
    versions = {i.name: i.version() for i in impls if i.version()}
    done, resumed = {}, None
    if args.resume:
        now = report.collect_meta(device, args.commit)
        rows, date = load_resume(args.resume, now["commit"], preset, now["gpu"])
        wanted = {case_key(c.fields()): c.label() for c in cases}
        for row in rows:
            if case_key(row) in wanted:
                done.setdefault(case_key(row), []).append(row)
        resumed = {"from": os.path.basename(args.resume), "date": date,
                   "cases_kept": [wanted[k] for k in wanted if k in done]}
        print(f"--resume: {len(done)} of {len(cases)} cases kept from {args.resume} ({date})", flush=True)

    def meta(complete):
        extra = {"resumed": resumed} if resumed else {}
        return dict(report.collect_meta(device, args.commit, peers_skipped=skipped, preset=preset,
                                        interpreter=interp, impl_versions=versions,
                                        timing={"warmup_ms": args.warmup, "rep_ms": args.rep,
                                                "return_mode": "median", "rounds": args.rounds,
                                                "fwd_autograd": not args.inference_fwd,
                                                "isolated": sorted(i.name for i in impls
                                                                   if isinstance(i, Isolated))},
                                        **extra),
                    complete=complete)

    # rewritten after every case: a run stopped by a time limit keeps what it measured
    try:
        results = run_cases(cases, impls, args, device, skipped,
                            on_case=lambda rows: report.write_json(args.out, meta(False), rows), done=done)
    finally:
        for impl in impls:
            if isinstance(impl, Isolated):
                impl.close()
    meta = meta(True)
    report.write_json(args.out, meta, results)
    names = [i.name for i in impls]
    print("\nTFLOPS (FA convention)" + (" -- interpreter: meaningless" if interp else ""))
    print(report.summary_table(results, names))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    print(f"\nresults: {args.out}")
    if not args.no_plot:
        png = args.plot or os.path.splitext(args.out)[0] + ".png"
        title = f"{meta['gpu']} -- commit {meta['commit'][:10]}" + (" -- TIMINGS MEANINGLESS" if interp else "")
        if make_plot(results, png, title):
            print(f"plot: {png}")
    fails = report.failures(results)
    if fails:
        print(f"\n{'!' * 72}\n{len(fails)} CORRECTNESS FAILURE(S):\n" + "\n".join(fails) + f"\n{'!' * 72}")
    else:
        print("\nall checked results within FA3 tolerance")
    if interp:
        print(INTERP_WARNING)
    return 1 if any(r["passed"] is False and r["impl"] in SUBJECTS for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
