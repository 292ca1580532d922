"""Train a random-weight Llama-style model on synthetic tokens with triflash or one of
PyTorch SDPA's backends as the attention, and report tokens/s and the loss curve.

    python examples/train_llama.py --attn triflash --seqlen 8192 --steps 30 --warmup 5
    python examples/train_llama.py --attn sdpa-flash --seqlen 8192 --steps 30 --warmup 5
    python examples/train_llama.py --tiny --steps 2 --warmup 1     # CPU smoke test (interpreter)

Nothing is downloaded: the model comes from a LlamaConfig, the data is synthetic (each
sequence repeats a random segment, so the loss falls once attention learns to copy). Mixed
precision: fp32 weights and AdamW, the forward under autocast (bf16 on CUDA; fp16 on the CPU,
where Triton's interpreter runs the kernels and its bf16 arithmetic is not faithful).
--attn sdpa runs transformers' "sdpa" with PyTorch's own backend choice; sdpa-flash,
sdpa-cudnn, sdpa-efficient and sdpa-math pin one backend (torch.nn.attention.sdpa_kernel),
and fail if that backend cannot serve the call (e.g. a head dim it lacks). SDPA's
memory-efficient kernel refuses `enable_gqa`, so with sdpa-efficient transformers repeats the
K/V heads itself (its path for torch builds without `enable_gqa`).

Writes <out>/train_<attn>.json (args, loss per step, step times, tokens/s after the warmup,
peak memory, versions, GPU, git commit) and <out>/train_<attn>.png when matplotlib is
installed.
"""
import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(ROOT, "triflash")):
    sys.path.insert(0, ROOT)  # run from a checkout: its triflash
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attn", default="triflash", choices=["triflash", "sdpa", *SDPA_BACKENDS])
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps, warmup included")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (long sequences, big models)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny model and sequence (hidden 64, 2 layers, seqlen 64): a smoke test, CPU included")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="train_out")
    p.add_argument("--commit", help="the commit to record (default: git rev-parse HEAD; a copy of the "
                                    "tree without its own .git would record a wrong one)")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim = 64, 2, 4, 2, 16
        args.intermediate, args.vocab, args.seqlen, args.batch = 128, 128, 64, 2
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    return args


def synthetic_batch(args, gen):
    """Each sequence: a random segment of 1/8 of the sequence, repeated. Tokens past the
    first segment are predictable by copying; the first are not (loss floor > 0)."""
    seg = max(2, args.seqlen // 8)
    base = torch.randint(0, args.vocab, (args.batch, seg), generator=gen)
    ids = base.repeat(1, math.ceil(args.seqlen / seg))[:, :args.seqlen]
    return ids.to(args.device)


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions():
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers", "triflash"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: recorded as such
            out[mod] = None
    return out


def progress(step, total, loss, rate, width=30):
    done = int(width * step / total)
    rate_s = f" {rate:,.0f} tok/s" if rate else ""
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.4f}{rate_s}   ")
    sys.stderr.flush()


def build_model(args):
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      vocab_size=args.vocab, max_position_embeddings=max(args.seqlen, 2048), attention_dropout=0.0,
                      use_cache=False)
    if args.attn == "triflash":
        from triflash.integrations.transformers import register
        impl = register()
    else:
        impl = "sdpa"
        if args.attn == "sdpa-efficient" and args.kv_heads < args.heads:
            from transformers.integrations import sdpa_attention
            sdpa_attention.use_gqa_in_sdpa = lambda *a, **kw: False  # K/V heads repeated instead
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).to(args.device)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    return model.train()


def sdpa_context(attn):
    if attn not in SDPA_BACKENDS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[attn])])


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triflash's kernels are imported
    model = build_model(args)
    amp_dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float16
    fused = {"fused": True} if args.device.startswith("cuda") else {}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, **fused)
    gen = torch.Generator().manual_seed(args.seed + 1)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.attn}: {n_params / 1e6:.1f}M parameters, batch {args.batch} x seqlen {args.seqlen}, "
          f"{args.steps} steps ({args.warmup} warmup) on {args.device}", flush=True)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    tokens_per_step = args.batch * args.seqlen
    t_start = None
    for step in range(args.steps):
        ids = synthetic_batch(args, gen)
        sync(args.device)
        t0 = time.perf_counter()
        if step == args.warmup:
            t_start = t0
        with sdpa_context(args.attn), torch.autocast(args.device.split(":")[0], dtype=amp_dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # syncs
        sync(args.device)
        times.append(time.perf_counter() - t0)
        losses.append(loss_value)
        timed = step + 1 - args.warmup
        rate = tokens_per_step * timed / (time.perf_counter() - t_start) if timed > 0 else None
        progress(step + 1, args.steps, loss_value, rate)
    sys.stderr.write("\n")
    elapsed = sum(times[args.warmup:])
    tokens_per_s = tokens_per_step * (args.steps - args.warmup) / elapsed
    print(f"{args.attn}: {tokens_per_s:,.0f} tokens/s over {args.steps - args.warmup} steps after warmup; "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    result = {
        "args": vars(args), "loss": losses, "step_time_s": times, "tokens_per_s": tokens_per_s,
        "parameters": n_params, "versions": versions(), "git_commit": args.commit or git_commit(),
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else platform.processor()
        or platform.machine(),
        "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30) if args.device.startswith("cuda") else None,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"train_{args.attn}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss-curve plot")
        return result
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{args.attn}, seqlen {args.seqlen}: {tokens_per_s:,.0f} tokens/s")
    fig.tight_layout()
    png = os.path.join(args.out, f"train_{args.attn}.png")
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")
    return result


if __name__ == "__main__":
    main()
