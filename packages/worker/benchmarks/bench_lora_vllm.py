"""vLLM's side of ``bench_lora.py``, run by it with a vLLM venv's interpreter (``--vllm-python``):
decode tokens/s of the same batches, adapters and sampling with vLLM's LoRA, printed as one JSON
line after ``RESULT_MARKER``. Imports nothing of Ember (that venv has only vLLM).

Decode tokens/s is the batch's tokens after the first over the time a run takes beyond a run of
one token (its prefill), prefix caching off, the best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import time

RESULT_MARKER = "bench-lora-vllm: "
PROMPT_LEN = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--adapters", required=True, help="a JSON list of PEFT folders")
    parser.add_argument("--counts", required=True, help="adapters per batch, comma separated")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--output", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--lora", type=int, choices=(0, 1), required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    paths = json.loads(args.adapters)
    lora_settings = (
        dict(enable_lora=True, max_loras=len(paths), max_lora_rank=args.rank,
             max_cpu_loras=len(paths))
        if args.lora
        else {}
    )  # fmt: skip
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=256,
        max_num_seqs=args.batch,
        kv_cache_memory_bytes=256 << 20,  # Ember's KV cache in bench_lora.py
        enable_prefix_caching=False,
        **lora_settings,
    )
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(PROMPT_LEN)]}
        for i in range(args.batch)
    ]

    def seconds(loras, tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return time.perf_counter() - start

    batches = {"base, lora on" if args.lora else "base": None}
    if args.lora:
        for k in (int(c) for c in args.counts.split(",")):
            batches[f"{k} adapters"] = [
                LoRARequest(f"a{i % k}", i % k + 1, paths[i % k]) for i in range(args.batch)
            ]
    best = dict.fromkeys(batches, 0.0)
    seconds(None, 2)  # warm-up
    for _ in range(args.rounds):
        for name, loras in batches.items():
            decode = seconds(loras, args.output) - seconds(loras, 1)
            best[name] = max(best[name], args.batch * (args.output - 1) / max(decode, 1e-9))
    print(RESULT_MARKER + json.dumps(best), flush=True)


if __name__ == "__main__":
    main()
