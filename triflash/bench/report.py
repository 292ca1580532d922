"""Run metadata, the terminal tables and the JSON file."""
import datetime
import json
import os
import platform
import subprocess
import sys

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ERR_NAMES = ("out", "dq", "dk", "dv")


def git_commit(repo_dir=REPO_DIR):
    """(commit, dirty) of the checkout, or (None, None) when it is not a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=repo_dir, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None, None
    try:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return commit, dirty


def collect_meta(device, commit_arg=None, **extra):
    """The JSON's "meta" object (see the schema in triflash/bench/__init__.py)."""
    import torch
    import triton
    commit, dirty = git_commit()
    if commit_arg:
        commit, dirty = commit_arg, None
    elif commit is None:
        commit = os.environ.get("TRIFLASH_COMMIT") or "unknown"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    meta = {
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU, Triton interpreter)",
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": str(cudnn) if cudnn else None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "tflops_convention": "fwd 4*b*h*sq*sk*d (halved when causal), bwd 2.5x fwd, fwd_bwd 3.5x",
    }
    meta.update(extra)
    return meta


def write_json(path, meta, results):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
        f.write("\n")


def case_label(r):
    """'2x8192x16x128 causal' from a result row (mirrors cases.Case.label)."""
    s = f"{r['batch']}x{r['seqlen_q']}" + (f"/{r['seqlen_k']}" if r["seqlen_k"] != r["seqlen_q"] else "")
    s += f"x{r['nheads']}" + (f"(kv{r['nheads_kv']})" if r["nheads_kv"] != r["nheads"] else "")
    s += f"x{r['headdim']}" + (f"/{r['headdim_v']}" if r["headdim_v"] != r["headdim"] else "")
    s += " causal" if r["causal"] else " full"
    if list(r["window_size"]) != [-1, -1]:
        s += f" win{tuple(r['window_size'])}"
    return s + ("" if r["dtype"] == "bf16" else f" {r['dtype']}")


def check_word(r):
    if r["ms"] is None and r["passed"] is None:
        return "skip"
    return {True: "ok", False: "FAIL", None: "-"}[r["passed"]]


def _num(x, fmt):
    return "-" if x is None else format(x, fmt)


def _tflops(x):
    return "-" if x is None else (f"{x:.1f}" if x >= 10 else f"{x:.3g}")


def _render(header, body):
    widths = [max(len(str(row[i])) for row in [header] + body) for i in range(len(header))]
    line = lambda row: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths)))
    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    return "\n".join([line(header), rule] + [line(row) for row in body])


def detail_table(rows):
    """One line per (case, mode, impl): ms, TFLOPS, bwd/fwd, max errors, check."""
    header = ["case", "mode", "impl", "ms", "TFLOPS", "bwd/fwd"] + [f"err {n}" for n in ERR_NAMES] + ["check", "note"]
    body, last = [], None
    for r in rows:
        label = case_label(r)
        errs = r.get("max_err") or {}
        body.append([label if label != last else "", r["mode"], r["impl"], _num(r["ms"], ".3f"),
                     _tflops(r["tflops"]), _num(r.get("bwd_fwd_ratio"), ".2f")]
                    + [_num(errs.get(n), ".1e") for n in ERR_NAMES] + [check_word(r), r.get("note", "")])
        last = label
    return _render(header, body)


def summary_table(rows, impls):
    """Pivot: one line per (case, mode), TFLOPS per impl; FAIL marked next to the number."""
    cells, order = {}, []
    for r in rows:
        key = (case_label(r), r["mode"])
        if key not in cells:
            cells[key] = {}
            order.append(key)
        word = check_word(r)
        text = "skip" if word == "skip" else _tflops(r["tflops"])
        if word == "FAIL":
            text += " FAIL"
        cells[key][r["impl"]] = text
    header = ["case", "mode"] + list(impls)
    body = [[c, m] + [cells[(c, m)].get(i, "") for i in impls] for c, m in order]
    return _render(header, body)


def failures(rows):
    """Lines describing every failed row, loud."""
    out = []
    for r in rows:
        if r["passed"] is False:
            errs = ", ".join(f"{n} {r['max_err'][n]:.2e} > tol {r['tolerance'][n]:.2e}"
                             for n in ERR_NAMES if (r.get("max_err") or {}).get(n) is not None
                             and r.get("tolerance") and not r["max_err"][n] <= r["tolerance"][n])
            out.append(f"FAIL  {r['impl']:<18} {case_label(r)} {r['mode']}: {errs or r.get('note', '')}")
    return out


__all__ = ["collect_meta", "write_json", "detail_table", "summary_table", "failures", "case_label"]
