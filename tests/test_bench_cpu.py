"""The benchmark's CPU path (Triton interpreter): runs end to end, writes the documented
JSON, and triflash passes the FA3 tolerance check. Tiny shapes; about 30 s."""
import importlib.util
import json
import pathlib

import pytest

from triflash.bench import main

ROW_KEYS = {"impl", "mode", "batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "headdim",
            "headdim_v", "causal", "window_size", "dtype", "varlen", "ms", "tflops", "max_err",
            "passed", "note", "bwd_fwd_ratio"}
META_KEYS = {"commit", "date", "gpu", "torch", "triton", "cudnn", "peers_skipped"}


def _run(tmp_path, *args):
    out = tmp_path / "bench.json"
    rc = main(["--device", "cpu", "--out", str(out), *args])
    data = json.loads(out.read_text())
    assert META_KEYS <= set(data["meta"])
    for r in data["results"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert set(r["max_err"]) == {"out", "dq", "dk", "dv"}
    return rc, data, out


def test_cpu_preset(tmp_path):
    rc, data, out = _run(tmp_path, "--preset", "cpu", "--seqlens", "64",
                         "--impls", "triflash,triflash-portable,sdpa-math,fa3")
    assert rc == 0
    assert data["meta"]["interpreter"] is True
    assert data["meta"]["complete"] is True  # rewritten with complete=False after each case
    assert "fa3" in data["meta"]["peers_skipped"]  # GPU-only peer: skipped with a reason
    rows = [r for r in data["results"] if r["impl"].startswith("triflash")]
    assert {(r["impl"], r["mode"], r["causal"]) for r in rows} == {
        (i, m, c) for i in ("triflash", "triflash-portable") for m in ("fwd", "bwd")
        for c in (False, True)}
    for r in rows:
        assert r["passed"] is True, r
        assert r["ms"] > 0 and r["tflops"] > 0
        grads = [r["max_err"][n] for n in ("dq", "dk", "dv")]
        assert all(g is not None for g in grads) == (r["mode"] == "bwd")
        assert (r["bwd_fwd_ratio"] is not None) == (r["mode"] == "bwd")
    assert any(r["impl"] == "sdpa-math" and r["passed"] for r in data["results"])
    if importlib.util.find_spec("matplotlib"):
        assert out.with_suffix(".png").stat().st_size > 0
        # and again from the JSON alone (how older runs' plots are made)
        from triflash.bench import plot
        assert plot.main([str(out), str(tmp_path / "again.png")]) == 0
        assert (tmp_path / "again.png").stat().st_size > 0

    # the README table is generated from the JSON
    spec = importlib.util.spec_from_file_location(
        "readme_table", pathlib.Path(__file__).parents[1] / "scripts" / "readme_table.py")
    readme_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_table)
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- bench-table:start -->\nold\n<!-- bench-table:end -->\ny\n")
    readme_table.main([str(out), "--update", str(readme)])
    text = readme.read_text()
    assert "old" not in text and "| 1x64x2x64 | yes |" in text and text.endswith("end -->\ny\n")


def test_window_gqa_and_unsupported_peer(tmp_path):
    rc, data, _ = _run(tmp_path, "--seqlens", "64", "--nheads", "4",
                       "--nheads-kv", "2", "--window", "16", "0", "--causal", "false",
                       "--impls", "triflash", "sdpa-math", "--no-plot")
    assert rc == 0
    by_impl = {(r["impl"], r["mode"]): r for r in data["results"]}
    assert by_impl[("triflash", "bwd")]["passed"] is True
    assert by_impl[("triflash", "fwd")]["window_size"] == [16, 0]
    sdpa = by_impl[("sdpa-math", "fwd")]
    assert sdpa["ms"] is None and sdpa["passed"] is None and sdpa["note"].startswith("skipped:")


@pytest.mark.parametrize("preset,n", [("seed", 2), ("h200", 2 + 3 * 2 + 2 * 4 * 2)])
def test_presets_list(preset, n, capsys):
    """GPU presets expand to the documented cases (listing needs no GPU)."""
    from triflash.bench.cases import PRESETS, build_cases
    cases = build_cases(PRESETS[preset])
    assert len(cases) == n
    assert cases[0].batch == 1 and cases[0].nheads == 36 and cases[0].headdim == 256
    if preset == "h200":
        assert {(c.batch, c.seqlen_q, c.nheads, c.headdim) for c in cases} >= {
            (2, 8192, 32, 64), (16, 1024, 8, 256), (1, 16384, 16, 128)}


def test_headdims_preset():
    """Every tuned head dim at 2 x 8192 tokens, FA3's heads rule (2048 // head dim)."""
    from triflash.bench.cases import PRESETS, build_cases
    cases = build_cases(PRESETS["headdims"])
    assert [(c.headdim, c.nheads, c.batch, c.causal) for c in cases] == [
        (d, 2048 // d, 2, causal) for d in (64, 96, 128, 192, 256) for causal in (False, True)]


def test_preset_shape_flags_select():
    """With a preset, shape flags select among its cases (a split H200 run stays correct)."""
    from triflash.bench.cases import PRESETS, build_cases, filter_cases
    cases = filter_cases(build_cases(PRESETS["h200"]), headdims=[256])
    assert cases and all(c.headdim == 256 for c in cases)
    assert any(c.nheads == 36 for c in cases) and any(c.batch == 16 for c in cases)


def test_json_written_after_each_case(tmp_path, monkeypatch):
    """A run stopped mid-way (a device time limit) keeps the cases it finished."""
    from triflash.bench import __main__ as bench_main
    out = tmp_path / "bench.json"
    seen = []
    original = bench_main.run_cases

    def run_cases_then_stop(cases, impls, args, device, skipped, on_case=None, done=None):
        def record(rows):
            on_case(rows)
            seen.append(json.loads(out.read_text()))
            raise KeyboardInterrupt  # the time limit, after the first case
        return original(cases, impls, args, device, skipped, on_case=record, done=done)

    monkeypatch.setattr(bench_main, "run_cases", run_cases_then_stop)
    with pytest.raises(KeyboardInterrupt):
        main(["--device", "cpu", "--out", str(out), "--preset", "cpu", "--seqlens", "64",
              "--impls", "triflash"])
    assert len(seen) == 1 and seen[0]["meta"]["complete"] is False
    assert seen[0]["results"] and all(r["impl"] == "triflash" for r in seen[0]["results"])


def test_resume_keeps_finished_cases(tmp_path):
    """--resume: the cases of a partial file of the same commit are kept row for row, the
    others measured, the file complete; another commit's file is refused."""
    import gzip
    from triflash.bench.report import case_label
    args = ["--device", "cpu", "--preset", "cpu", "--seqlens", "64", "--impls", "triflash", "--commit", "abc1234"]
    full = tmp_path / "full.json"
    assert main([*args, "--out", str(full)]) == 0
    rows = json.loads(full.read_text())
    labels = list(dict.fromkeys(case_label(r) for r in rows["results"]))
    assert len(labels) >= 2
    # a partial file: the first case only, its times made up so that keeping them shows
    first = [dict(r, ms=123.0) for r in rows["results"] if case_label(r) == labels[0]]
    partial = tmp_path / "partial.json.gz"
    with gzip.open(partial, "wt") as f:
        json.dump({"meta": dict(rows["meta"], complete=False), "results": first}, f)
    out = tmp_path / "resumed.json"
    assert main([*args, "--out", str(out), "--resume", str(partial)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["complete"] is True and len(data["meta"]["resumed"]["cases_kept"]) == 1
    assert [r for r in data["results"] if case_label(r) == labels[0]] == first
    rest = [r for r in data["results"] if case_label(r) != labels[0]]
    assert {case_label(r) for r in rest} == set(labels[1:])
    assert all(r["ms"] != 123.0 and r["passed"] for r in rest if r["ms"] is not None)
    with pytest.raises(SystemExit, match="commit"):
        main([*args[:-1], "fff0000", "--out", str(tmp_path / "x.json"), "--resume", str(partial)])


def test_rounds_interleave_and_take_the_median(tmp_path):
    """--rounds 3: every impl that ran is timed three times; ms is the median of the rounds
    and TFLOPS / the bwd/fwd ratio follow it."""
    import statistics
    rc, data, _ = _run(tmp_path, "--preset", "cpu", "--seqlens", "64", "--causal", "true",
                       "--impls", "triflash,sdpa-math", "--rounds", "3")
    assert rc == 0 and data["meta"]["timing"]["rounds"] == 3
    timed = [r for r in data["results"] if r["ms"] is not None]
    assert {r["impl"] for r in timed} == {"triflash", "sdpa-math"}
    by_key = {(r["impl"], r["mode"], r["headdim"]): r for r in timed}
    for r in timed:
        assert len(r["ms_rounds"]) == 3 and r["ms"] == statistics.median(r["ms_rounds"])
        if r["mode"] == "bwd":
            fwd = by_key[(r["impl"], "fwd", r["headdim"])]
            assert r["bwd_fwd_ratio"] == pytest.approx(r["ms"] / fwd["ms"])
            assert r["tflops"] * r["ms"] == pytest.approx(2.5 * fwd["tflops"] * fwd["ms"])
    with pytest.raises(SystemExit, match="rounds"):
        main(["--device", "cpu", "--rounds", "0"])


def test_isolated_peer_runs_in_its_own_process(tmp_path, monkeypatch):
    """--isolate: the peer is loaded, checked and timed in a worker process on the parent's
    tensors (shared, not regenerated), later rounds included; the JSON says which impls were
    isolated. A peer whose worker cannot import it is skipped with the reason."""
    rc, data, _ = _run(tmp_path, "--preset", "cpu", "--seqlens", "64", "--causal", "true",
                       "--impls", "triflash,sdpa-math,triflash-portable", "--rounds", "2",
                       "--isolate", "sdpa-math,triflash-portable", "--no-plot")
    assert rc == 0
    assert data["meta"]["timing"]["isolated"] == ["sdpa-math", "triflash-portable"]
    rows = {(r["impl"], r["mode"]): r for r in data["results"]}
    for impl in ("sdpa-math", "triflash-portable"):
        for mode in ("fwd", "bwd"):
            r = rows[(impl, mode)]
            assert r["passed"] is True and len(r["ms_rounds"]) == 2, r
            # same inputs as the parent's impls: the same errors as the in-process triflash
            # where the kernels are the same
    assert rows[("triflash-portable", "bwd")]["max_err"] == rows[("triflash", "bwd")]["max_err"]

    from triflash.bench import isolate
    impl = isolate.Isolated("fa3", "cpu")
    with pytest.raises(RuntimeError, match="import failed"):
        impl.load()
    impl.close()


def test_readme_table_ratios_to_cudnn_and_fa4():
    """The README table's ratio columns: triflash over SDPA-cuDNN and over FA4 when measured."""
    spec = importlib.util.spec_from_file_location(
        "readme_table", pathlib.Path(__file__).parents[1] / "scripts" / "readme_table.py")
    readme_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_table)
    base = dict(batch=1, seqlen_q=8192, seqlen_k=8192, nheads=36, nheads_kv=36, headdim=256,
                headdim_v=256, causal=False, window_size=[-1, -1], dtype="bf16", passed=True)
    rows = [dict(base, impl=i, mode=m, tflops=t, bwd_fwd_ratio=3.0 if m == "bwd" else None)
            for i, ts in (("triflash", (600.0, 400.0)), ("sdpa-cudnn", (500.0, 400.0)),
                          ("fa4", (750.0, 320.0))) for m, t in zip(("fwd", "bwd"), ts)]
    text = readme_table.markdown(dict(meta=dict(gpu="x", commit="abc", date="d"), results=rows))
    assert "triflash / sdpa-cudnn fwd / bwd | triflash / fa4 fwd / bwd" in text
    assert "| 1.20x / 1.00x | 0.80x / 1.25x |" in text
    rows = [r for r in rows if r["impl"] != "fa4"]  # no FA4: no FA4 column
    assert "/ fa4" not in readme_table.markdown(dict(meta=dict(gpu="x", commit="abc", date="d"), results=rows))


# --preset decode: flash_attn_with_kvcache in K+V TB/s against a copy (bench/decode*.py)

DECODE_ROW_KEYS = {"impl", "mode", "batch", "cache_len", "nheads", "nheads_kv", "headdim", "headdim_v",
                   "page_size", "seqlen_q", "seqlen_new", "seqlen_k", "ragged", "lens_seed", "causal",
                   "dtype", "kv_layout", "kv_full", "kv_tokens", "kv_bytes", "ms", "host_ms", "tb_s",
                   "tflops", "max_err", "tolerance", "passed", "note"}


def test_decode_preset_cases():
    """The issue's cases: (batch, cache_len, heads, kv heads, head dim, page size, query
    tokens, ragged, new tokens), all causal bf16, one prefill-over-a-cache row last."""
    from triflash.bench.decode_cases import build_cases
    cases = build_cases("decode")
    got = [(c.batch, c.cache_len, c.nheads, c.nheads_kv, c.headdim, c.page_size, c.seqlen_q, c.ragged,
            c.seqlen_new) for c in cases]
    assert got == [
        (64, 8192, 32, 8, 128, None, 1, False, 0),
        (64, 8192, 32, 8, 128, 64, 1, False, 0),
        (64, 8192, 32, 8, 128, 1, 1, False, 0),
        (64, 8192, 32, 8, 128, 256, 1, False, 0),
        (128, 4096, 32, 8, 128, 16, 1, False, 0),
        (1, 131072, 32, 8, 128, None, 1, False, 0),
        (8, 32768, 32, 8, 128, None, 1, False, 0),
        (32, 8192, 16, 2, 256, None, 1, False, 0),
        (64, 8192, 32, 8, 64, None, 1, False, 0),
        (64, 8192, 32, 8, 128, None, 4, False, 0),
        (64, 8192, 32, 8, 128, None, 1, True, 0),
        (64, 8192, 32, 8, 128, 64, 1, True, 0),
        (256, 2048, 32, 8, 128, None, 1, False, 0),
        (1, 3577, 32, 8, 128, None, 2048, False, 2048),
    ]
    assert all(c.causal and c.dtype == "bf16" for c in cases)
    assert [c.mode for c in cases] == ["decode"] * 13 + ["prefill-cache"]
    assert len({c.label() for c in cases}) == len(cases)
    assert build_cases("decode", dtype="fp16")[0].dtype == "fp16"
    # every case of the CPU preset runs under the interpreter (test_decode_cpu_run)
    cpu = build_cases("decode-cpu")
    assert {c.mode for c in cpu} == {"decode", "prefill-cache"} and any(c.ragged and c.page_size for c in cpu)


def test_decode_byte_accounting():
    """kv_bytes: keys attended x kv heads x (d + dv) x 2 bytes, summed over sequences; ragged
    cases count each sequence's own length (or, kv_full, the whole cache)."""
    from triflash.bench.decode_cases import DecodeCase, visible_pairs
    dense = DecodeCase(64, 8192, 32, 8, 128)
    paged = DecodeCase(64, 8192, 32, 8, 128, page_size=64)
    assert dense.kv_bytes() == paged.kv_bytes() == 64 * 8192 * 8 * 256 * 2 == 2 ** 31
    assert dense.kv_tokens() == 64 * 8192 and paged.pages_per_seq == 128 and paged.capacity == 8192
    assert DecodeCase(64, 8192, 32, 8, 128, page_size=1).pages_per_seq == 8192
    assert DecodeCase(8, 32768, 32, 8, 128).kv_bytes() == 8 * 32768 * 8 * 256 * 2
    assert DecodeCase(32, 8192, 16, 2, 256).kv_bytes() == 32 * 8192 * 2 * 512 * 2
    assert DecodeCase(64, 8192, 32, 8, 64).kv_bytes() == 2 ** 30

    ragged = DecodeCase(64, 8192, 32, 8, 128, ragged=True)
    lens = ragged.seqlens()
    assert lens == DecodeCase(64, 8192, 32, 8, 128, page_size=64, ragged=True).seqlens()  # fixed seed
    assert len(lens) == 64 and all(1 <= n <= 8192 for n in lens) and len(set(lens)) > 32
    assert DecodeCase(64, 8192, 32, 8, 128, ragged=True, lens_seed=1).seqlens() != lens
    assert ragged.kv_tokens() == sum(lens) and ragged.kv_bytes() == sum(lens) * 8 * 256 * 2
    assert ragged.kv_bytes(full=True) == dense.kv_bytes() > ragged.kv_bytes()
    assert dense.kv_bytes(full=True) == dense.kv_bytes()

    prefill = DecodeCase(1, 3577, 32, 8, 128, seqlen_q=2048, seqlen_new=2048)
    assert prefill.mode == "prefill-cache" and prefill.seqlen_k == 5625 and prefill.keys() == [5625]
    assert prefill.kv_bytes() == 5625 * 8 * 256 * 2
    # the 2048 queries are the last 2048 of 5625 positions: query i sees 3577 + i + 1 keys
    assert visible_pairs(2048, 5625, True) == 2048 * 3577 + 2048 * 2049 // 2
    assert prefill.flops() == 2.0 * 32 * visible_pairs(2048, 5625, True) * 256
    assert visible_pairs(1, 8192, True) == 8192 and visible_pairs(4, 8192, True) == 4 * 8189 + 6
    assert visible_pairs(64, 64, True) == 64 * 65 // 2 and visible_pairs(3, 5, False) == 15
    assert DecodeCase(1, 3577, 32, 8, 128, page_size=16, seqlen_q=2048, seqlen_new=2048).capacity == 5632

    from triflash.bench.decode import derive
    row = dict(ms=0.5, kv_full=False)
    derive(row, ragged)
    assert row["tb_s"] == pytest.approx(ragged.kv_bytes() / 0.5e-3 / 1e12)
    assert row["tflops"] == pytest.approx(2.0 * 32 * sum(lens) * 256 / 0.5e-3 / 1e12)
    row = dict(ms=0.5, kv_full=True)
    derive(row, ragged)
    assert row["tb_s"] == pytest.approx(2 ** 31 / 0.5e-3 / 1e12)

    from triflash.bench.decode_cases import DecodeCase as DC
    for bad in (dict(nheads_kv=3), dict(page_size=0), dict(page_size=16, headdim_v=64),
                dict(ragged=True, seqlen_new=4)):
        with pytest.raises(ValueError):
            DC(**{**dict(batch=2, cache_len=64, nheads=4, nheads_kv=2, headdim=128), **bad})


def test_decode_inputs_paged_layout():
    """A paged cache holds the dense cache's tokens: K and V two views of one (blocks, page,
    2, kv heads, d) tensor, pages in a random permutation of the blocks."""
    import torch
    from triflash.bench.decode import make_inputs
    from triflash.bench.decode_cases import DecodeCase
    case = DecodeCase(3, 64, 4, 2, 64, page_size=16, ragged=True, dtype="fp16")
    x = make_inputs(case, "cpu")
    pt, kv = x.page_table, x.kv_paged
    assert pt.dtype == torch.int32 and pt.shape == (3, 4) and kv.shape == (12, 16, 2, 2, 64)
    assert sorted(pt.flatten().tolist()) == list(range(12)) and pt.flatten().tolist() != list(range(12))
    k, v = kv[:, :, 0], kv[:, :, 1]
    assert k.data_ptr() == kv.data_ptr() and v.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    for b in range(3):
        for r in range(64):
            block, row = pt[b, r // 16], r % 16
            assert torch.equal(k[block, row], x.k_cache[b, r]) and torch.equal(v[block, row], x.v_cache[b, r])
    assert x.cache_seqlens.tolist() == case.seqlens() and x.k_full.shape == (3, 64, 2, 64)
    prefill = DecodeCase(1, 40, 4, 2, 64, seqlen_q=24, seqlen_new=24, dtype="fp16")
    x = make_inputs(prefill, "cpu")
    assert x.k_full.shape == (1, 64, 2, 64) and torch.equal(x.k_full[:, 40:], x.k_new)
    assert torch.equal(x.v_full[:, :40], x.v_cache[:, :40]) and x.cache_seqlens.tolist() == [40]


def _decode_row(impl, tb_s, label_fields, **kw):
    from triflash.bench.decode_cases import DecodeCase
    case = DecodeCase(**label_fields)
    full = kw.pop("kv_full", False)
    row = dict(impl=impl, **case.fields(), kv_layout="dense", kv_full=full, kv_tokens=case.kv_tokens(full),
               kv_bytes=case.kv_bytes(full), ms=None if tb_s is None else case.kv_bytes(full) / tb_s / 1e9,
               host_ms=None, tb_s=tb_s, tflops=None, max_err={"out": 1e-3}, tolerance={"out": 1e-2},
               passed=None if tb_s is None else True, note="")
    row.update(kw)
    return row


def test_decode_report_ratios(tmp_path, capsys):
    """The report: TB/s per impl, triflash / the best (fastest checked) peer, triflash / the
    copy; '*' marks a peer that read the whole cache; prefill-cache rows against
    flash_attn_func on the same tokens; the same from the JSON file alone."""
    from triflash.bench import report
    dense = dict(batch=64, cache_len=8192, nheads=32, nheads_kv=8, headdim=128)
    ragged = dict(dense, ragged=True)
    prefill = dict(batch=1, cache_len=3577, nheads=32, nheads_kv=8, headdim=128, seqlen_q=2048, seqlen_new=2048)
    rows = [
        _decode_row("triflash", 4.0, dense), _decode_row("sdpa-cudnn", 3.2, dense),
        _decode_row("fa4", 3.9, dense, passed=False),   # a failed check is no "best peer"
        _decode_row("sdpa-flash", None, dense, note="skipped: no"),
        _decode_row("triflash", 3.0, ragged), _decode_row("sdpa-cudnn", 3.5, ragged, kv_full=True),
        _decode_row("triflash", 2.0, prefill), _decode_row("triflash-dense", 2.5, prefill),
        _decode_row("fa4", 2.2, prefill),
    ]
    ratios = report.decode_ratios(rows, 4.8)
    mine, peer, vs_peer, vs_copy = ratios[report.case_label(rows[0])]
    assert peer["impl"] == "sdpa-cudnn" and vs_peer == pytest.approx(1.25) and vs_copy == pytest.approx(4.0 / 4.8)
    assert ratios[report.case_label(rows[4])][2] == pytest.approx(3.0 / 3.5)
    assert ratios[report.case_label(rows[6])][1]["impl"] == "fa4"  # triflash-dense is no peer
    text = report.decode_summary_table(rows, ["triflash", "triflash-dense", "sdpa-cudnn", "sdpa-flash", "fa4"], 4.8)
    lines = text.splitlines()
    assert lines[0].split() == ["case", "triflash", "sdpa-cudnn", "sdpa-flash", "fa4", "triflash/best",
                                "peer", "triflash/copy"]
    dense_line = next(line for line in lines if line.startswith("64x8192 h32/8"))
    assert "1.25x (sdpa-cudnn)" in dense_line and "0.83" in dense_line and "3.9 FAIL" in dense_line
    assert "skip" in dense_line
    ragged_line = next(line for line in lines if line.startswith("64x8192 ragged"))
    assert "3.5*" in ragged_line and "0.86x (sdpa-cudnn*)" in ragged_line
    assert "time / triflash-dense" in text
    prefill = text.split("time / triflash-dense")[1].splitlines()
    assert "1x3577+2048" in prefill[2] and "1.25" in prefill[2]  # kvcache 2.0 TB/s, dense 2.5: 1.25x the time
    assert any("FAIL" in line and "fa4" in line for line in report.failures(rows))

    path = tmp_path / "decode.json"
    report.write_json(str(path), {"gpu": "x", "commit": "abc", "date": "d", "copy_tb_s": 4.8}, rows)
    assert report.main([str(path)]) == 0
    assert "1.25x (sdpa-cudnn)" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib"):
        from triflash.bench import plot
        assert plot.main([str(path), str(tmp_path / "decode.png")]) == 0
        assert (tmp_path / "decode.png").stat().st_size > 0


def test_decode_impl_names_and_errors():
    """The CLI's impl names (decode_cases, no torch) are decode.py's; error notes are one line
    without the wrappers of run_impl and of a worker process."""
    from triflash.bench import decode, decode_cases
    for name in set(decode_cases.GPU_IMPLS) | set(decode_cases.CPU_IMPLS):
        assert decode.make_impl(name).name == name
    assert set(decode_cases.ISOLATED_BY_DEFAULT) <= set(decode_cases.GPU_IMPLS)
    inner = decode.ImplError("RuntimeError: No available kernel. Aborting execution.; Flash refused GQA")
    assert decode.error_text(inner) == "RuntimeError: No available kernel. Aborting execution.; Flash refused GQA"
    assert decode.error_text(RuntimeError("ImplError: ValueError: bad\nTraceback ...")) == "ValueError: bad"
    assert decode.error_text(KeyError("x")) == "KeyError: 'x'"


def test_decode_fa4_kvcache_call_form(monkeypatch):
    """fa4-kvcache calls FA4's flash_attn_varlen_func over the cache as given: the paged
    views and page table, per-sequence lengths as seqused_k, FA4's split heuristic
    (num_splits=0); a prefill over a cache (an append) is refused."""
    import sys
    import types
    import torch
    from triflash.bench import decode
    from triflash.bench.decode_cases import DecodeCase
    calls = []

    def varlen(q, k, v, **kw):
        calls.append((q, k, v, kw))
        return torch.zeros_like(q), None
    fake = types.ModuleType("flash_attn.cute")
    fake.flash_attn_func, fake.flash_attn_varlen_func = object(), varlen
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake)
    impl = decode.make_impl("fa4-kvcache")
    impl.load()
    assert impl.paged and impl.ragged
    case = DecodeCase(3, 64, 4, 2, 64, page_size=16, ragged=True, dtype="fp16")
    assert impl.layout(case) == ("paged", False)
    x = decode.make_inputs(case, "cpu")
    out = impl.make(case, x, "cpu")()
    assert out.shape == x.q.shape
    q, k, v, kw = calls[-1]
    assert q is x.q and k.data_ptr() == x.kv_paged.data_ptr() and torch.equal(v, x.kv_paged[:, :, 1])
    assert kw["seqused_k"] is x.cache_seqlens and kw["page_table"] is x.page_table
    assert kw["causal"] is True and kw["num_splits"] == 0
    dense = DecodeCase(2, 64, 4, 2, 64, dtype="fp16")
    x = decode.make_inputs(dense, "cpu")
    impl.make(dense, x, "cpu")()
    q, k, v, kw = calls[-1]
    assert k is x.k_cache and v is x.v_cache and kw["page_table"] is None
    assert "append" in impl.unsupported(DecodeCase(1, 40, 4, 2, 64, seqlen_q=24, seqlen_new=24))


def test_decode_cpu_run(tmp_path):
    """--preset decode-cpu end to end under the interpreter: every form (dense, paged with page
    sizes 16 and 1, ragged dense and paged, 4 query tokens, a prefill over a cache) checked
    against the fp32 reference; the documented rows; the copy; the plot; --resume."""
    from triflash.bench.decode_cases import build_cases, case_key, label
    out = tmp_path / "decode.json"
    args = ["--device", "cpu", "--preset", "decode-cpu", "--commit", "abc1234"]
    assert main([*args, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    meta, rows = data["meta"], data["results"]
    assert meta["preset"] == "decode-cpu" and meta["complete"] is True and meta["copy_tb_s"] > 0
    assert meta["copy_tb_s"] == max(meta["copy"]["tb_s"]) and len(meta["copy"]["ms"]) == 2
    cases = build_cases("decode-cpu", dtype="fp16")
    assert len(rows) == 3 * len(cases)
    for r in rows:
        assert DECODE_ROW_KEYS <= set(r), DECODE_ROW_KEYS - set(r)
    by = {(label(r), r["impl"]): r for r in rows}
    for case in cases:
        mine = by[(case.label(), "triflash")]
        assert mine["passed"] is True and mine["ms"] > 0, mine
        assert mine["kv_tokens"] == sum(case.seqlens()) + case.batch * case.seqlen_new
        assert mine["kv_bytes"] == case.kv_bytes() and mine["kv_full"] is False
        assert mine["kv_layout"] == ("paged" if case.page_size else "dense")
        assert mine["tb_s"] == pytest.approx(mine["kv_bytes"] / mine["ms"] / 1e9)
        sdpa = by[(case.label(), "sdpa-math")]
        if case.seqlen_q > 1:
            assert sdpa["ms"] is None and sdpa["note"].startswith("skipped: SDPA's is_causal")
        else:
            assert sdpa["passed"] is True and sdpa["kv_layout"] == "dense"
            assert sdpa["kv_full"] is case.ragged and sdpa["kv_tokens"] == case.kv_tokens(case.ragged)
        dense = by[(case.label(), "triflash-dense")]
        assert (dense["passed"] is True) == (case.mode == "prefill-cache")
    assert any(r["ragged"] and r["page_size"] and r["impl"] == "triflash" for r in rows)
    if importlib.util.find_spec("matplotlib"):
        assert out.with_suffix(".png").stat().st_size > 0

    # --resume: the first case's rows are kept as they are, the others measured again
    first = [dict(r, ms=123.0) for r in rows if label(r) == cases[0].label()]
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"meta": dict(meta, complete=False), "results": first}))
    again = tmp_path / "resumed.json"
    assert main([*args, "--out", str(again), "--resume", str(partial), "--seqlens", "64",
                 "--impls", "triflash", "sdpa-math", "triflash-dense", "--no-plot"]) == 0
    data = json.loads(again.read_text())
    assert data["meta"]["resumed"]["cases_kept"] == [cases[0].label()]
    kept = [r for r in data["results"] if case_key(r) == case_key(cases[0].fields())]
    assert kept == first
    assert all(r["ms"] != 123.0 for r in data["results"] if r not in first)


def test_decode_isolated_peer(tmp_path):
    """A decode peer in a worker process of its own, on the parent's tensors, two rounds."""
    out = tmp_path / "decode.json"
    assert main(["--device", "cpu", "--preset", "decode-cpu", "--seqlens", "16", "--impls", "triflash,sdpa-math",
                 "--isolate", "sdpa-math", "--rounds", "2", "--no-plot", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["timing"]["isolated"] == ["sdpa-math"]
    rows = {r["impl"]: r for r in data["results"]}
    assert set(rows) == {"triflash", "sdpa-math"} and rows["triflash"]["page_size"] == 1
    for r in rows.values():
        assert r["passed"] is True and len(r["ms_rounds"]) == 2 and r["ms"] == pytest.approx(
            sorted(r["ms_rounds"])[0] / 2 + sorted(r["ms_rounds"])[1] / 2)
    # same tensors as the parent: the isolated peer's error equals an in-process one's
    assert rows["sdpa-math"]["max_err"]["out"] < rows["sdpa-math"]["tolerance"]["out"]


def test_decode_cpu_run_fp8(tmp_path):
    """--preset decode-cpu --dtype fp8 (FA3's fp8 caches): triflash's rows checked against the
    fp32 reference, at 1 byte per element; peers without fp8 skipped with the reason; the
    paged layout holds the dense cache's bits; the training presets refuse fp8."""
    import torch
    from triflash.bench.decode import make_inputs
    from triflash.bench.decode_cases import DecodeCase, label
    case = DecodeCase(2, 32, 4, 2, 64, page_size=16, dtype="fp8")
    x = make_inputs(case, "cpu")
    assert x.kv_paged.dtype == torch.float8_e4m3fn and case.kv_bytes() == 2 * 32 * 2 * 128
    k = x.kv_paged[:, :, 0]
    assert torch.equal(k[x.page_table[1, 1], 3].view(torch.uint8), x.k_cache[1, 19].view(torch.uint8))
    out = tmp_path / "decode.json"
    assert main(["--device", "cpu", "--preset", "decode-cpu", "--dtype", "fp8", "--impls", "triflash,sdpa-math",
                 "--headdims", "64", "--commit", "abc1234", "--out", str(out), "--no-plot"]) == 0
    rows = json.loads(out.read_text())["results"]
    mine = [r for r in rows if r["impl"] == "triflash"]
    assert mine and all(r["passed"] is True and r["dtype"] == "fp8" for r in mine), mine
    assert all(r["note"] == "skipped: no fp8 (e4m3) inputs" for r in rows if r["impl"] == "sdpa-math")
    assert {label(r) for r in mine} and all(r["kv_bytes"] * 2 == DecodeCase(**{
        f: r[f] for f in DecodeCase.__dataclass_fields__ if f in r and f != "dtype"}).kv_bytes() for r in mine)
    with pytest.raises(SystemExit, match="fp8"):
        main(["--device", "cpu", "--preset", "cpu", "--dtype", "fp8", "--out", str(tmp_path / "t.json")])
