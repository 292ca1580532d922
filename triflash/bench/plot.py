"""TFLOPS against sequence length, one panel per (mode, headdim, causal), one line per impl,
as in FlashAttention-3's README figures. matplotlib is optional."""
import math

MARKERS = "os^vD<>ph*x+"
IMPL_ORDER = ["triflash", "triflash-portable", "triflash-dense", "fa4", "fa4-kvcache", "fa3", "flashinfer", "sdpa-cudnn",
              "sdpa-flash", "sdpa-efficient", "flex", "fa2", "sdpa-math"]


def _series(results):
    """{panel key: {series key: [(seqlen, tflops)]}} from the measured rows."""
    panels = {}
    for r in results:
        if r.get("tflops") is None:
            continue
        win = tuple(r["window_size"])
        panel = (r["mode"], r["headdim"], r["causal"], win, r["dtype"])
        # points of one line share the head counts (FA3 sweeps: 16k tokens, 2048 // headdim)
        family = (r["nheads"], r["nheads_kv"])
        panels.setdefault(panel, {}).setdefault((r["impl"], family), []).append(
            (r["seqlen_q"], r["tflops"], r["passed"]))
    return panels


def plot(results, path, title=""):
    """Write the PNG; returns the path, or None (with a printed reason) if not possible."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    panels = _series(results)
    if not panels:
        print("plot skipped: no timed results")
        return None
    mode_order = {"fwd": 0, "bwd": 1, "fwd_bwd": 2}
    keys = sorted(panels, key=lambda p: (mode_order.get(p[0], 9), p[1], p[2], p[3], p[4]))
    impls = sorted({impl for p in panels.values() for impl, _ in p},
                   key=lambda n: (IMPL_ORDER.index(n) if n in IMPL_ORDER else 99, n))
    colors = {impl: plt.cm.tab10(i % 10) for i, impl in enumerate(impls)}
    ncols = min(4, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.8 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        mode, d, causal, win, dtype = key
        series = panels[key]
        families = sorted({fam for _, fam in series}, key=lambda f: (-len([1 for _, g in series if g == f]), f))
        for (impl, fam), pts in sorted(series.items(), key=lambda kv: (impls.index(kv[0][0]), kv[0][1])):
            pts.sort()
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            main = fam == families[0]  # the sweep: lines; other head counts: hollow markers
            ax.plot(xs, ys, "-" if main else ":", marker=MARKERS[impls.index(impl) % len(MARKERS)],
                    color=colors[impl], label=impl if main else None,
                    mfc=None if main else "none", lw=(2.2 if impl.startswith("triflash") else 1.2) if main else 0.8)
            for x, y, passed in pts:
                if passed is False:
                    ax.annotate("FAIL", (x, y), color="red", fontsize=7, ha="center", va="bottom")
        for fam in families[1:]:
            heads = f"{fam[0]} heads" + (f" ({fam[1]} kv)" if fam[1] != fam[0] else "")
            ax.plot([], [], "o", mfc="none", color="gray", label=f"hollow: {heads}")
        ax.set_xscale("log", base=2)
        xs_all = sorted({p[0] for pts in series.values() for p in pts})
        ax.set_xticks(xs_all)
        ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 else str(x) for x in xs_all])
        t = f"{mode}, headdim {d}, {'causal' if causal else 'non-causal'}"
        if win != (-1, -1):
            t += f", window {win}"
        ax.set_title(t + f" ({dtype})", fontsize=10)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOPS")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_decode(results, path, title="", copy_tb_s=None):
    """A decode run: K+V TB/s per case (groups) and impl (bars), a dashed line at the copy's
    TB/s (bytes read + written); hatched bars read every sequence's whole cache (ragged
    cases, peers without per-sequence lengths). Returns the path, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    from .report import case_label
    rows = [r for r in results if r.get("tb_s") is not None]
    if not rows:
        print("plot skipped: no timed results")
        return None
    labels = list(dict.fromkeys(case_label(r) for r in rows))
    impls = sorted({r["impl"] for r in rows}, key=lambda n: (IMPL_ORDER.index(n) if n in IMPL_ORDER else 99, n))
    from matplotlib.patches import Patch
    by_key = {(r["impl"], case_label(r)): r for r in rows}
    colors = {impl: plt.cm.tab10(j % 10) for j, impl in enumerate(impls)}
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(labels) + 3), 5.6))
    labelled = set()
    for i, label in enumerate(labels):
        here = [impl for impl in impls if (impl, label) in by_key]  # bars of this case only
        width = 0.8 / len(here)
        for j, impl in enumerate(here):
            r, x = by_key[(impl, label)], i - 0.4 + width * (j + 0.5)
            ax.bar(x, r["tb_s"], width, color=colors[impl], hatch="//" if r.get("kv_full") else None,
                   edgecolor="white" if r.get("kv_full") else colors[impl],
                   label=None if impl in labelled else impl)
            labelled.add(impl)
            if r.get("passed") is False:
                ax.annotate("FAIL", (x, r["tb_s"]), color="red", fontsize=7, ha="center", va="bottom")
    if copy_tb_s:
        ax.axhline(copy_tb_s, color="black", ls="--", lw=1.2,
                   label=f"device copy, read + written ({copy_tb_s:.3g} TB/s)")
    handles, names = ax.get_legend_handles_labels()
    if any(r.get("kv_full") for r in rows):
        handles.append(Patch(facecolor="lightgray", hatch="//", edgecolor="white"))
        names.append("hatched: every sequence's whole cache read (ragged)")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("K+V TB/s (bytes the impl reads / time)")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(handles, names, fontsize=8, ncol=2)
    if title:
        ax.set_title(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["plot", "plot_decode"]


def main(argv=None):
    """``python -m triflash.bench.plot RESULTS.json [OUT.png]``: the plot of a committed run
    (older runs keep only their JSON in benchmarks/results/)."""
    import json
    import os
    import sys
    args = sys.argv[1:] if argv is None else argv
    if not args or len(args) > 2:
        raise SystemExit("usage: python -m triflash.bench.plot RESULTS.json [OUT.png]")
    import gzip
    with (gzip.open if args[0].endswith(".gz") else open)(args[0], "rt") as fh:  # old runs: .json.gz
        data = json.load(fh)
    meta = data.get("meta", {})
    stem = args[0][:-3] if args[0].endswith(".gz") else args[0]
    out = args[1] if len(args) > 1 else os.path.splitext(stem)[0] + ".png"
    title = f"{meta.get('gpu', '')} -- commit {str(meta.get('commit', ''))[:10]}"
    if any("cache_len" in r for r in data["results"]):  # a decode run (--preset decode)
        return 0 if plot_decode(data["results"], out, title, meta.get("copy_tb_s")) else 1
    return 0 if plot(data["results"], out, title) else 1


if __name__ == "__main__":
    raise SystemExit(main())
