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
    """'2x8192x16x128 causal' from a result row (mirrors cases.Case.label); a decode row's
    label is decode_cases.label's."""
    if "cache_len" in r:
        from .decode_cases import label
        return label(r)
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


def _tb(x):
    return "-" if x is None else f"{x:.3g}"


def decode_detail_table(rows):
    """One line per (case, impl) of a decode run: what it read, ms, TB/s, error, check."""
    header = ["case", "impl", "layout", "GB read", "ms", "TB/s", "TFLOPS", "err out", "check", "note"]
    body, last = [], None
    for r in rows:
        label = case_label(r)
        layout = r["kv_layout"] + (" full" if r.get("kv_full") else "")
        body.append([label if label != last else "", r["impl"], layout, f"{r['kv_bytes'] / 1e9:.3f}",
                     _num(r["ms"], ".4f"), _tb(r.get("tb_s")), _tflops(r.get("tflops")),
                     _num((r.get("max_err") or {}).get("out"), ".1e"), check_word(r), r.get("note", "")])
        last = label
    return _render(header, body)


def best_peer(rows, subjects=("triflash", "triflash-dense")):
    """The row of the fastest peer (highest TB/s) among one case's rows, or None."""
    peers = [r for r in rows if r["impl"] not in subjects and r.get("tb_s") is not None and r["passed"] is not False]
    return max(peers, key=lambda r: r["tb_s"], default=None)


def decode_ratios(rows, copy_tb_s, subject="triflash"):
    """{case label: (subject's row, best peer's row, subject / best peer TB/s, subject / copy)}
    with None where a value is missing. TB/s ratios: on rows that read the same bytes,
    the inverse ratio of times; a peer that reads every sequence's whole cache (kv_full) is
    compared by bandwidth, not by time."""
    by_case = {}
    for r in rows:
        by_case.setdefault(case_label(r), []).append(r)
    out = {}
    for label, case_rows in by_case.items():
        mine = next((r for r in case_rows if r["impl"] == subject and r.get("tb_s") is not None), None)
        peer = best_peer(case_rows)
        vs_peer = mine["tb_s"] / peer["tb_s"] if mine and peer else None
        vs_copy = mine["tb_s"] / copy_tb_s if mine and copy_tb_s else None
        out[label] = (mine, peer, vs_peer, vs_copy)
    return out


def decode_summary_table(rows, impls, copy_tb_s):
    """Pivot: one line per decode case, K+V TB/s per impl, then triflash / the best peer
    (TB/s, the peer named) and triflash / the copy's TB/s (read + written). A '*' marks a
    peer that read every sequence's whole cache (ragged cases). Prefill-over-a-cache rows
    follow in a table of their own: time and TFLOPS of every impl, and the kvcache call
    against flash_attn_func on the same tokens."""
    cols = [i for i in impls if i != "triflash-dense"]
    cells, order = {}, []
    for r in rows:
        key = case_label(r)
        if key not in cells:
            cells[key] = {}
            order.append(key)
        word = check_word(r)
        text = "skip" if word == "skip" else _tb(r.get("tb_s"))
        if word == "FAIL":
            text += " FAIL"
        elif r.get("kv_full") and word != "skip":
            text += "*"
        cells[key][r["impl"]] = text
    ratios = decode_ratios(rows, copy_tb_s)
    header = ["case"] + cols + ["triflash/best peer", "triflash/copy"]
    body = []
    for c in order:
        _, peer, vs_peer, vs_copy = ratios[c]
        body.append([c] + [cells[c].get(i, "") for i in cols]
                    + [f"{vs_peer:.2f}x ({peer['impl']}{'*' if peer.get('kv_full') else ''})" if vs_peer else "-",
                       _num(vs_copy, ".2f")])
    text = _render(header, body)
    notes = ["* read every sequence's whole cache (no per-sequence lengths): compared by TB/s, not time"]
    if any(r.get("page_size") and r.get("kv_layout") == "dense" for r in rows):
        notes.append("peers without a page table read a dense cache holding the paged case's tokens")
    text += "\n" + "\n".join(notes)
    prefill = [r for r in rows if r.get("mode") == "prefill-cache"]
    if prefill:
        body = []
        for label in dict.fromkeys(case_label(r) for r in prefill):
            case_rows = [r for r in prefill if case_label(r) == label]
            dense = next((r for r in case_rows if r["impl"] == "triflash-dense" and r["ms"]), None)
            for r in case_rows:
                if r["ms"] is None:
                    continue
                rel = f"{r['ms'] / dense['ms']:.2f}" if dense else "-"
                body.append([label, r["impl"], f"{r['ms']:.4f}", _tflops(r.get("tflops")), _tb(r.get("tb_s")),
                             rel, check_word(r)])
                label = ""
        if body:
            text += "\n\nprefill over a cache (triflash-dense: flash_attn_func on the same tokens)\n"
            text += _render(["case", "impl", "ms", "TFLOPS", "TB/s", "time / triflash-dense", "check"], body)
    return text


def main(argv=None):
    """``python -m triflash.bench.report RESULTS.json``: the summary table of a results file
    (a decode run's: TB/s and the ratios to the best peer and to the copy)."""
    import gzip
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m triflash.bench.report RESULTS.json")
    with (gzip.open if args[0].endswith(".gz") else open)(args[0], "rt") as f:
        data = json.load(f)
    meta, rows = data.get("meta", {}), data["results"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    print(f"{meta.get('gpu', '')} -- commit {str(meta.get('commit', ''))[:10]} -- {meta.get('date', '')}")
    if any("cache_len" in r for r in rows):
        print(f"K+V TB/s; copy {meta.get('copy_tb_s') or 0:.3f} TB/s (read + written)")
        print(decode_summary_table(rows, impls, meta.get("copy_tb_s")))
    else:
        print("TFLOPS (FA convention)")
        print(summary_table(rows, impls))
    return 0


__all__ = ["collect_meta", "write_json", "detail_table", "summary_table", "failures", "case_label",
           "decode_detail_table", "decode_summary_table", "decode_ratios", "best_peer"]


if __name__ == "__main__":
    raise SystemExit(main())
