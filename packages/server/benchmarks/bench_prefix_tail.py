"""Prefix hits that end inside a KV block, against whole-block hits only (vLLM's behaviour).

With prefix caching Ember copies the KV of a finished request's last, partly filled block (or of
a cached whole block) into a later request that starts the same way, so a prompt asked again
computes one token; with whole-block hits only it recomputes the tokens after its last whole
block (12 of 1,500 here). In process (``LLM``), float32, the issue-12 models: a 1,500-token
prompt answered once, then asked again, median time to first token of the second over 20
prompts, with partial hits off (``KVCacheManager.reuse_partial_blocks``) and on in the same run.

    python packages/server/benchmarks/bench_prefix_tail.py
"""

from __future__ import annotations

import random
import statistics
import time

from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.llm import LLM
from ember_testing.tiny_models import tiny_model_path

MODELS = {
    "hidden 256, 4 layers": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2),
    "hidden 512, 8 layers": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                 num_attention_heads=8, num_key_value_heads=2),
}  # fmt: skip
PROMPT_TOKENS = 1500
REPEATS = 20


def first_token_ms(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return 1e3 * (time.perf_counter() - start)


def asked_again_ms(llm: LLM, rng: random.Random, reuse: bool) -> float:
    llm.engine_core.kv_cache_manager.reuse_partial_blocks = reuse
    times = []
    for _ in range(REPEATS):
        prompt = [rng.randrange(16, 1000) for _ in range(PROMPT_TOKENS)]
        first_token_ms(llm, prompt)
        times.append(first_token_ms(llm, prompt))
    return statistics.median(times)


def main() -> None:
    for name, config in MODELS.items():
        model = tiny_model_path("llama", vocab_size=8192, max_position_embeddings=2048, **config)
        llm = LLM(str(model), max_model_len=2048, kv_cache_memory=1 << 30)
        rng = random.Random(0)
        asked_again_ms(llm, rng, True)  # warm-up
        whole, partial = asked_again_ms(llm, rng, False), asked_again_ms(llm, rng, True)
        print(
            f"{name}: a {PROMPT_TOKENS}-token prompt asked again, TTFT with whole-block hits "
            f"{whole:.2f} ms, with partial blocks {partial:.2f} ms ({whole / partial:.2f}x)"
        )
        llm.shutdown()


if __name__ == "__main__":
    main()
