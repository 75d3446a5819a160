"""Forward+backward throughput of nanolight's Llama vs transformers' LlamaForCausalLM.

    python scripts/bench_model.py --preset smollm-tiny --seq-len 256 --batch-size 4 --steps 10
    python scripts/bench_model.py --set hidden_size=256 intermediate_size=768   # a wider tiny model
    python scripts/bench_model.py --set hidden_size=320 num_attention_heads=5 num_key_value_heads=1 \
        vocab_size=6000 tie_word_embeddings=false   # multi-query, 5 heads, untied, another vocabulary

Both models get the same config and the same weights (nanolight's init, converted with the
checkpoint weight map), and their losses are checked to agree before timing. Steps alternate
between the two models so that clock or thermal drift hits both alike; the median step time
of each is reported as tokens/s, with the ratio nanolight / transformers (> 1: nanolight faster),
from wall time and from this process's CPU time (steadier on a shared machine: other processes'
load stretches the wall clock, not the work this process does), and as the median of the ratios
of back-to-back steps (a burst of load hits both steps of a pair).
A benchmark, not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from nanolight.models.hf_adapter import nanolight_to_hf_state_dict
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nanolight.models.hf_adapter import nanolight_to_hf_state_dict
from nanolight.models import LlamaConfig, LlamaForCausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def overrides(pairs: list[str]) -> dict[str, int | float | bool]:
    """`key=value` config overrides (numbers or true/false), e.g. hidden_size=256
    tie_word_embeddings=false."""
    out: dict[str, int | float | bool] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        else:
            out[key] = float(value) if "." in value or "e" in value else int(value)
    return out


def build_models(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    import transformers

    config = LlamaConfig.preset(args.preset, attn_implementation=args.attn, **overrides(args.set))
    torch.manual_seed(0)
    ours = LlamaForCausalLM(config).to(device=device, dtype=DTYPES[args.dtype]).train()
    hf_config = transformers.LlamaConfig(**config.to_hf_dict(), use_cache=False)
    hf_config._attn_implementation = args.attn
    theirs = transformers.LlamaForCausalLM(hf_config).to(device=device, dtype=DTYPES[args.dtype]).train()
    sd = nanolight_to_hf_state_dict(config, ours.state_dict())
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return ours, theirs


def step(model: torch.nn.Module, ids: torch.Tensor, is_hf: bool) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss if is_hf else model(ids, labels=ids)
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm-tiny")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="LlamaConfig overrides")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--attn", choices=["sdpa", "eager", "flash_attention_2"], default="sdpa")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    ours, theirs = build_models(args, device)
    vocab = ours.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with torch.no_grad():
        a, b = ours(ids, labels=ids).item(), theirs(input_ids=ids, labels=ids).loss.item()
    print(f"loss check: nanolight {a:.6f}  transformers {b:.6f}")

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"nanolight": [], "transformers": []}
    cpu: dict[str, list[float]] = {"nanolight": [], "transformers": []}
    for i in range(args.warmup + args.steps):
        for name, model in (("nanolight", ours), ("transformers", theirs)):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            step(model, ids, is_hf=name == "transformers")
            sync()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    tokens = args.batch_size * args.seq_len
    tps = {name: tokens / statistics.median(ts) for name, ts in times.items()}
    cpu_tps = {name: tokens / statistics.median(ts) for name, ts in cpu.items()}
    threads = torch.get_num_threads() if device.type == "cpu" else "-"
    print(
        f"preset={args.preset} {' '.join(args.set)} B={args.batch_size} T={args.seq_len} dtype={args.dtype} attn={args.attn} "
        f"device={device} threads={threads} steps={args.steps} (median of alternating fwd+bwd steps)"
    )
    for name, value in tps.items():
        print(f"  {name:<13} {value:>12,.0f} tokens/s   ({cpu_tps[name]:,.0f} per CPU-second)")
    paired = statistics.median(b / a for a, b in zip(times["nanolight"], times["transformers"], strict=True))
    print(
        f"  ratio nanolight/transformers: {tps['nanolight'] / tps['transformers']:.3f} wall, "
        f"{cpu_tps['nanolight'] / cpu_tps['transformers']:.3f} CPU time, "
        f"{paired:.3f} median of back-to-back pairs"
    )


if __name__ == "__main__":
    main()
