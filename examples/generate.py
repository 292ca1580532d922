"""Prefill and greedy decoding through transformers' generate() with triflash as the attention,
checked against the same model under "sdpa". Random weights from a config, nothing is
downloaded; a tiny model by default (runs on the CPU through Triton's interpreter).

    python examples/generate.py                                   # tiny, CPU or GPU
    python examples/generate.py --hidden 2048 --layers 16 --head-dim 128 --prompt-len 4096 --new-tokens 64
    python examples/generate.py --cache static --pad 3            # static cache, a left-padded row

Prints each implementation's tokens, its prefill and decode times, and whether the tokens
match (exit status 1 if they do not).
"""
import argparse
import copy
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(ROOT, "triflash")):
    sys.path.insert(0, ROOT)  # run from a checkout: its triflash


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--pad", type=int, default=0, help="left-pad the last row's prompt by this many tokens")
    p.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float16 on the CPU (the interpreter's bf16 is not faithful)")
    return p.parse_args(argv)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(model, ids, mask, args):
    """(new tokens, prefill seconds, decode seconds per token)."""
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    if args.cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=1, **kw)  # warm (compiles kernels)
        sync(args.device)
        t0 = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, **kw)
        sync(args.device)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, max_new_tokens=args.new_tokens, **kw)
        sync(args.device)
        total = time.perf_counter() - t0
    decode = (total - prefill) / max(args.new_tokens - 1, 1)
    return out[:, ids.shape[1]:], prefill, decode


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triflash's kernels are imported
    from transformers import AutoModelForCausalLM, LlamaConfig

    from triflash.integrations.transformers import register

    name = register()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                           else torch.float16)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      vocab_size=args.vocab, max_position_embeddings=args.prompt_len + args.new_tokens + 16,
                      bos_token_id=None, eos_token_id=None)  # random weights: no end-of-sequence stop
    torch.manual_seed(args.seed)
    sdpa = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(args.device, dtype).eval()
    tri = copy.deepcopy(sdpa)
    tri.set_attn_implementation(name)
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt_len), generator=gen).to(args.device)
    mask = torch.ones_like(ids)
    if args.pad:
        mask[-1, :args.pad] = 0
        ids[-1, :args.pad] = 0
    print(f"batch {args.batch}, prompt {args.prompt_len} (last row left-padded by {args.pad}), "
          f"{args.new_tokens} new tokens, {args.cache} cache, {dtype} on {args.device}")
    results = {}
    for label, model in ((name, tri), ("sdpa", sdpa)):
        tokens, prefill, decode = timed_generate(model, ids, mask, args)
        results[label] = tokens
        print(f"{label:>8}: prefill {prefill * 1e3:8.1f} ms, decode {decode * 1e3:7.2f} ms/token")
        for row in tokens.tolist():
            print(f"          {row}")
    match = torch.equal(results[name], results["sdpa"])
    print(f"tokens match sdpa: {match}")
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
