"""Tokens per second of `generate()` with attn_implementation="flashgen" against "sdpa".

A randomly initialised Llama-shaped model (no download: the weights do not change the work
per token), greedy decoding from the same prompt, dynamic and static caches. Each new token
of a "flashgen" model runs the decode family (`flashgen.attention_with_kvcache`). Prints
tokens per second for each (implementation, cache), medians of interleaved rounds, the
median ratio and its range over the rounds, and whether the tokens agree with sdpa's.

Run on the GPU machine, e.g. the Llama 3 8B attention shape at 2 layers:
    python3 benchmarks/decode_generate.py --layers 2 --prompt 4096 --new 256 --batch 8
A tiny CPU run (the Triton interpreter; checks the pipeline, says nothing of speed):
    TRITON_INTERPRET=1 python3 benchmarks/decode_generate.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(attn: str, args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    if args.tiny:
        size = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 1}
    else:  # Llama 3 8B's attention: 32 query heads, 8 KV heads, head dim 128
        size = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                "num_key_value_heads": 8}
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, num_hidden_layers=args.layers,
        max_position_embeddings=args.prompt + args.new + 8, attn_implementation=attn, **size)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=args.device, dtype=dtype).eval()


def generate_seconds(model: torch.nn.Module, ids: torch.Tensor, tokens: int, cache: str,
                     device: str) -> tuple[float, torch.Tensor]:
    """Seconds of one greedy `generate` of `tokens` new tokens, and its output."""
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=tokens, min_new_tokens=tokens, **extra)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def decode_rate(model: torch.nn.Module, ids: torch.Tensor, new: int, cache: str,
                device: str) -> tuple[float, torch.Tensor]:
    """New tokens per second of the decode steps: a `generate` of `new` tokens less one of a
    single token (the prompt's prefill), each timed once."""
    prefill, _ = generate_seconds(model, ids, 1, cache, device)
    total, out = generate_seconds(model, ids, new, cache, device)
    return ids.shape[0] * (new - 1) / max(total - prefill, 1e-9), out


def forced_logits(model: torch.nn.Module, seq: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of each new position, the model fed `seq` one token at a time after the
    prompt's prefill (teacher forcing: both implementations see the same tokens, so their
    logits compare step by step even where greedy choices part on a near tie)."""
    with torch.no_grad():
        out = model(seq[:, :prompt], use_cache=True)
        cache, logits = out.past_key_values, [out.logits[:, -1]]
        for i in range(prompt, seq.shape[1] - 1):
            out = model(seq[:, i:i + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--caches", default="dynamic,static")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds; the ratio is the median of theirs")
    parser.add_argument("--tiny", action="store_true",
                        help="hidden 64, 2 layers, a short prompt: for the CPU interpreter")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.prompt, args.new, args.vocab, args.batch = 2, 6, 4, 128, 2
        args.dtype = "fp32"
    import flashgen.integrations.transformers as integration

    integration.register()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=gen).to(args.device)
    print(f"B{args.batch} prompt {args.prompt} new {args.new} layers {args.layers} "
          f"{args.dtype} on {args.device}")
    for cache in args.caches.split(","):
        models = {attn: build(attn, args, dtype) for attn in ("sdpa", "flashgen")}
        for model in models.values():
            # Every length the rounds reach, once: kernels specialise (Triton) and plans
            # build (cuDNN) per cache length, which the first round would otherwise time.
            generate_seconds(model, ids, args.new, cache, args.device)
        # Rounds interleaved, each starting with the other implementation: this host's speed
        # drifts between runs (sdpa alone moved 2155-2919 tok/s across runs on one H100).
        rates: dict[str, list[float]] = {attn: [] for attn in models}
        ratios, outs = [], {}
        for r in range(args.rounds):
            for attn in (("sdpa", "flashgen") if r % 2 == 0 else ("flashgen", "sdpa")):
                rate, outs[attn] = decode_rate(models[attn], ids, args.new, cache, args.device)
                rates[attn].append(rate)
            ratios.append(rates["flashgen"][-1] / rates["sdpa"][-1])
        del models
        a, b = outs["sdpa"], outs["flashgen"]
        n = min(a.shape[1], b.shape[1])  # an end-of-sequence token may stop one early
        same = (a[:, :n] == b[:, :n]).all(0)
        first = int(same.logical_not().nonzero()[0]) if not bool(same.all()) else a.shape[1]
        sdpa, ours = (statistics.median(rates[attn]) for attn in ("sdpa", "flashgen"))
        print(f"{cache:8s} sdpa {sdpa:9.1f} tok/s   flashgen {ours:9.1f} tok/s   "
              f"{statistics.median(ratios):5.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})"
              f"   tokens agree: {bool(same.all()) and a.shape == b.shape}"
              f" (all rows up to position {first - args.prompt} of {args.new})")
        if cache == "dynamic":
            agreement(a, args, dtype)


def agreement(seq: torch.Tensor, args: argparse.Namespace, dtype: torch.dtype) -> None:
    """Teacher-forced logits along sdpa's tokens: flashgen's and sdpa's against an fp32 sdpa
    model's (bf16 greedy tokens of random weights part on near ties, so tokens alone say
    little), and how often their top choices agree."""
    found = {}
    for attn, kind in (("sdpa", dtype), ("flashgen", dtype), ("sdpa", torch.float32)):
        model = build(attn, args, kind)
        found[(attn, kind)] = forced_logits(model, seq, args.prompt)
        del model
    exact = found[("sdpa", torch.float32)]
    for attn in ("sdpa", "flashgen"):
        got = found[(attn, dtype)]
        top = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
        print(f"  teacher-forced {attn:8s} {args.dtype}: max |logit - fp32 sdpa| "
              f"{(got - exact).abs().max().item():.4f}, top-1 agreement {top:.1%}")


if __name__ == "__main__":
    main()
