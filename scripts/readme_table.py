#!/usr/bin/env python3
"""Print the README's benchmark table (Markdown) from a ``python -m triflash.bench`` JSON.

    python scripts/readme_table.py bench-out/results.json
    python scripts/readme_table.py bench-out/results.json --update README.md
    python scripts/readme_table.py part1.json part2.json     # a run split in several parts

Rows are cases (batch x seqlen x heads x headdim, causal), columns are impls with
"fwd / bwd" TFLOPS (FlashAttention's convention), triflash's ratios to SDPA-cuDNN and (when
measured) FlashAttention-4, plus triflash's bwd/fwd time ratio. A
result that failed its correctness check is shown with "FAIL"; "-" means not measured
(skipped or unsupported). ``--update`` replaces the text between
``<!-- bench-table:start -->`` and ``<!-- bench-table:end -->`` in the given file.
Needs only the standard library.
"""
import argparse
import gzip
import json
import re
import sys

START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
MODES = ("fwd", "bwd", "fwd_bwd")


def case_key(r):
    # "varlen" is not part of the case: triflash-varlen runs the same problem packed, and its
    # impl name already says so
    return (r["batch"], r["seqlen_q"], r["seqlen_k"], r["nheads"], r["nheads_kv"], r["headdim"],
            r["headdim_v"], r["causal"], tuple(r["window_size"]), r["dtype"])


def case_name(r):
    s = f"{r['batch']}x{r['seqlen_q']}" + (f"/{r['seqlen_k']}" if r["seqlen_k"] != r["seqlen_q"] else "")
    s += f"x{r['nheads']}" + (f" (kv {r['nheads_kv']})" if r["nheads_kv"] != r["nheads"] else "")
    s += f"x{r['headdim']}" + (f"/{r['headdim_v']}" if r["headdim_v"] != r["headdim"] else "")
    if list(r["window_size"]) != [-1, -1]:
        s += f" window {tuple(r['window_size'])}"
    return s


def cell(row):
    if row is None or row.get("tflops") is None:
        return "-"
    text = f"{row['tflops']:.1f}"
    return text + " FAIL" if row.get("passed") is False else text


def _ratio(a, b):
    if not a or not b or not a.get("tflops") or not b.get("tflops"):
        return "-"
    return f"{a['tflops'] / b['tflops']:.2f}x"


def _order(names, preferred=("triflash", "triflash-portable", "triflash-deterministic",
                             "triflash-varlen", "fa4", "fa3", "sdpa-cudnn", "sdpa-flash",
                             "sdpa-efficient", "flex", "fa2", "sdpa-math")):
    rank = {n: i for i, n in enumerate(preferred)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def markdown(data, modes=("fwd", "bwd")):
    """The Markdown block: a meta line, the table, and the skipped peers."""
    meta, results = data["meta"], data["results"]
    modes = [m for m in modes if any(r["mode"] == m for r in results)]
    results = [r for r in results if r["mode"] in modes]
    impls = _order({r["impl"] for r in results if r.get("tflops") is not None})
    cases, table = [], {}
    for r in results:
        key = case_key(r)
        if key not in table:
            cases.append((key, r))
            table[key] = {}
        table[key][(r["impl"], r["mode"])] = r
    ratio_impl = next((i for i in ("triflash", "triflash-portable") if i in impls), None)
    head = ["case (b x s x h x d)", "causal"] + [f"{i} {' / '.join(modes)}" for i in impls]
    vs_cudnn = ratio_impl and "sdpa-cudnn" in impls
    if vs_cudnn:
        head.append(f"{ratio_impl} / sdpa-cudnn {' / '.join(modes)}")
    vs_fa4 = ratio_impl and "fa4" in impls
    if vs_fa4:
        head.append(f"{ratio_impl} / fa4 {' / '.join(modes)}")
    if ratio_impl and "fwd" in modes and "bwd" in modes:
        head.append(f"{ratio_impl} bwd/fwd time")
    dtypes = sorted({r["dtype"] for r in results})
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, r in cases:
        row = [case_name(r), "yes" if r["causal"] else "no"]
        row += [" / ".join(cell(table[key].get((i, m))) for m in modes) for i in impls]
        for peer, wanted in (("sdpa-cudnn", vs_cudnn), ("fa4", vs_fa4)):
            if wanted:
                row.append(" / ".join(_ratio(table[key].get((ratio_impl, m)), table[key].get((peer, m)))
                                      for m in modes))
        if len(head) > len(row):
            bwd = table[key].get((ratio_impl, "bwd")) or {}
            row.append(f"{bwd['bwd_fwd_ratio']:.2f}" if bwd.get("bwd_fwd_ratio") else "-")
        lines.append("| " + " | ".join(row) + " |")
    versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "triton", "cudnn") if meta.get(k))
    commit = str(meta.get("commit", "unknown"))
    dirty = " (with local changes)" if meta.get("dirty") else ""
    rounds = (meta.get("timing") or {}).get("rounds") or 1
    timing = ("median of triton.testing.do_bench" if rounds == 1 else
              f"median of {rounds} interleaved rounds of triton.testing.do_bench (each a median)")
    info = (f"{meta.get('gpu', '?')}, {'/'.join(dtypes)}, commit `{commit[:12]}`{dirty}, "
            f"{meta.get('date', '?')}, {versions}. TFLOPS: fwd 4*b*h*sq*sk*d (halved when causal), "
            f"bwd 2.5x; {timing}. Generated by scripts/readme_table.py.")
    out = [info, ""] + lines
    peer_versions = {k: v for k, v in (meta.get("impl_versions") or {}).items()
                     if not k.startswith("triflash")}
    if peer_versions:
        out += ["", "Peers: " + "; ".join(f"{k}: {v}" for k, v in sorted(peer_versions.items()))]
    skipped = meta.get("peers_skipped") or {}
    if skipped:
        out += ["", "Not measured: " + "; ".join(f"{k} ({v})" for k, v in sorted(skipped.items()))]
    if any(r.get("passed") is False for r in results):
        out += ["", "**FAIL: a result marked FAIL exceeded FlashAttention-3's error tolerance.**"]
    if meta.get("interpreter"):
        out += ["", "**CPU interpreter run: the numbers are meaningless.**"]
    return "\n".join(out)


def load(paths):
    """One {"meta", "results"} from one or more JSON files; a later file's result for the same
    (case, impl, mode) replaces an earlier one."""
    datas = []
    for path in paths:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:  # old runs: .json.gz
            datas.append(json.load(f))
    meta = dict(datas[0]["meta"])
    rows = {}
    for d in datas:
        for r in d["results"]:
            rows[(case_key(r), r["impl"], r["mode"])] = r
    commits = sorted({str(d["meta"].get("commit")) for d in datas})
    meta["commit"] = ", ".join(c[:12] for c in commits)
    meta["dirty"] = any(d["meta"].get("dirty") for d in datas)
    meta["impl_versions"] = {k: v for d in datas for k, v in (d["meta"].get("impl_versions") or {}).items()}
    measured = {r["impl"] for r in rows.values() if r.get("tflops") is not None}
    meta["peers_skipped"] = {k: v for d in datas for k, v in (d["meta"].get("peers_skipped") or {}).items()
                             if k not in measured}
    return {"meta": meta, "results": list(rows.values())}


def update(path, block):
    with open(path) as f:
        text = f.read()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        sys.exit(f"{path}: markers {START} ... {END} not found")
    text = pattern.sub(lambda _: f"{START}\n{block}\n{END}", text, count=1)
    with open(path, "w") as f:
        f.write(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="results JSON(s) from python -m triflash.bench")
    p.add_argument("--update", metavar="README", help="replace the marked block in this file")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["fwd", "bwd"],
                   help="columns per impl (default: fwd bwd)")
    args = p.parse_args(argv)
    block = markdown(load(args.json), args.modes)
    if args.update:
        update(args.update, block)
        print(f"updated {args.update}")
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
