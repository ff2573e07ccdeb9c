"""The worker tests' small engine settings, shared by the executor, distributed and
speculative-decoding tests: float32, a 128-token context, 4 sequences of 64 batched tokens, KV
blocks of 4 slots in a 1 MiB budget (a tiny model's cache then spans many blocks), one torch
thread."""

BLOCK_SIZE = 4
SMALL_SETTINGS = dict(
    dtype="float32",
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    block_size=BLOCK_SIZE,
    kv_cache_memory=1 << 20,
    num_threads=1,
)
