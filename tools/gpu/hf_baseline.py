"""HF transformers baselines for spec-bench --random_weights: the same model shapes with
random weights (LlamaConfig -> LlamaForCausalLM, nothing downloaded), random token-id prompts,
greedy decoding, in two flavours:

  eager     model.generate with the default dynamic cache
  compiled  static KV cache + the decode step through torch.compile(mode="reduce-overhead")
            (CUDA graphs), the recipe of HF's "LLM inference optimization" guide: generate's
            own compile_config from transformers 4.48 on, model.forward wrapped before
            (each record's "compile" says which)

For each (mode, batch size) it prints one JSON record: tokens/s after the first token, ms per
decode step, time to first token. Needs only torch and transformers, and runs offline.

    python tools/gpu/hf_baseline.py --shape llama2-7b --device cuda --batch_sizes 1,16
    python tools/gpu/hf_baseline.py --shape tiny --device cpu --modes eager   # smoke test
"""
import argparse
import json
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

# The HF configs of the checkpoints spec-bench's --random_weights names (same table as
# src/bench/shapes.rs): hidden, layers, heads, kv heads, intermediate, vocab, rope_theta,
# rms_norm_eps, tied, max_position_embeddings.
SHAPES = {
    "llama2-7b": (4096, 32, 32, 32, 11008, 32000, 10000.0, 1e-5, False, 4096),
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256, 500000.0, 1e-5, False, 8192),
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, 100000.0, 1e-5, True, 8192),
    "tiny": (64, 2, 4, 2, 128, 256, 10000.0, 1e-5, False, 2048),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def config_for(shape):
    h, l, nh, nkv, i, v, theta, eps, tied, max_pos = SHAPES[shape]
    return LlamaConfig(
        hidden_size=h,
        num_hidden_layers=l,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        intermediate_size=i,
        vocab_size=v,
        rope_theta=theta,
        rms_norm_eps=eps,
        tie_word_embeddings=tied,
        max_position_embeddings=max_pos,
        # No special ids: every request runs to max_new_tokens, as in spec-bench.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, ids, new_tokens, device, **kw):
    sync(device)
    t = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )
    sync(device)
    return time.perf_counter() - t, out


def compile_step(model):
    """Static KV cache + the decode step through torch.compile(mode="reduce-overhead").

    transformers 4.48 and later compile the decode step inside generate() once the cache is
    static (GenerationConfig.compile_config; its default is this recipe), and wrapping
    model.forward on top breaks there: the wrapped graphs' replays overwrite the static
    cache's tensors that the previous replay returned, which newer torch refuses. Older
    versions need the wrap, as HF's guide for them shows.
    """
    model.generation_config.cache_implementation = "static"
    try:
        from transformers.generation.configuration_utils import CompileConfig
    except ImportError:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        return "wrapped forward"
    model.generation_config.compile_config = CompileConfig(
        fullgraph=True, dynamic=False, backend="inductor", mode="reduce-overhead"
    )
    return "generate's own compile_config"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--batch_sizes", default="1,16")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_json")
    a = p.parse_args()
    batches = [int(b) for b in a.batch_sizes.split(",") if b.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("eager", "compiled"):
            sys.exit(f"hf_baseline.py: error: unknown mode '{m}': expected eager or compiled")
    if a.max_new_tokens < 2:
        sys.exit("hf_baseline.py: error: --max_new_tokens must be at least 2")

    device = torch.device(a.device)
    dtype = DTYPES[a.dtype]
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    # Initialised directly on the device in the target dtype: a 7B model never exists in f32
    # on the host.
    torch.set_default_dtype(dtype)
    with device:
        model = LlamaForCausalLM(config_for(a.shape))
    torch.set_default_dtype(torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    sync(device)
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(a.seed)
    records = []
    for mode in modes:
        how = "none"
        if mode == "compiled":
            how = compile_step(model)
        for b in batches:
            ids = torch.randint(0, vocab, (b, a.prompt_len), generator=gen).to(device)
            with torch.inference_mode():
                # Warm-up: compilation (and CUDA-graph capture) for this batch size, cuBLAS
                # handles, the allocator. Two full-length runs, as the guide advises.
                c0 = time.perf_counter()
                for _ in range(2 if mode == "compiled" else 1):
                    timed_generate(model, ids, a.max_new_tokens, device)
                warm_s = time.perf_counter() - c0
                first_s, _ = timed_generate(model, ids, 1, device)
                total_s, out = timed_generate(model, ids, a.max_new_tokens, device)
            new = out.shape[1] - a.prompt_len
            decode_s = max(total_s - first_s, 1e-9)
            rec = {
                "shape": a.shape,
                "mode": mode,
                "batch_size": b,
                "dtype": a.dtype,
                "device": a.device,
                "device_name": torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else "cpu",
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "compile": how,
                "prompt_len": a.prompt_len,
                "new_tokens": new,
                # After each sequence's first token, as spec-bench counts.
                "tokens_per_s": b * (new - 1) / decode_s,
                "ms_per_step": decode_s / (new - 1) * 1e3,
                "time_to_first_token_ms": first_s * 1e3,
                "total_s": total_s,
                "warmup_s": warm_s,
                "load_s": load_s,
            }
            print(json.dumps(rec), flush=True)
            records.append(rec)
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(records, f, indent=2)


if __name__ == "__main__":
    main()
