"""min_tokens end to end: the sampler masks EOS and stop token ids until min_tokens outputs exist.

The model is made to want EOS at once: the request's EOS id is set to the token greedy decoding
produces first. Transformers' ``generate`` with ``min_new_tokens`` (which masks EOS the same way)
is the reference: the engine must emit exactly its tokens, EOS never before min_tokens outputs and
as the last token after.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_parity import hf_model, make_engine, parity_prompts

from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = "llama"
MAX_TOKENS = 40


@functools.cache
def prompt_and_forced_eos() -> tuple[list[int], int]:
    prompt = parity_prompts()[4]
    return prompt, hf_generate(tuple(prompt), None, 0)[0]


@functools.cache
def hf_generate(prompt: tuple[int, ...], eos_token_id: int | None, min_tokens: int) -> list[int]:
    """Greedy tokens from transformers, stopping at ``eos_token_id`` once ``min_tokens`` exist."""
    stop = {}
    if eos_token_id is not None:
        stop = {"eos_token_id": eos_token_id, "min_new_tokens": min_tokens}
    with torch.no_grad():
        out = hf_model(ARCH).generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **stop,
        )
    return out[0, len(prompt) :].tolist()


def generate(requests: dict[str, tuple[SamplingParams, int | None]]) -> dict[str, tuple]:
    """Run the requests (params, eos id) together in one engine that chunks the prompt; returns
    (tokens, finish reason, stop reason) per request."""
    prompt, _ = prompt_and_forced_eos()
    # The 24-token budget splits the prompt: mid-prefill rows are masked too.
    assert len(prompt) > 24
    core = make_engine(ARCH, max_num_batched_tokens=24)
    for req_id, (params, eos) in requests.items():
        core.add_request(EngineCoreRequest(req_id, prompt, params, eos_token_id=eos))
    results = {req_id: ([], None, None) for req_id in requests}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens, _, _ = results[out.request_id]
            tokens += out.new_token_ids
            results[out.request_id] = (tokens, str(out.finish_reason), out.stop_reason)
    return results


def test_eos_and_stop_ids_are_never_sampled_before_min_tokens():
    prompt, eos = prompt_and_forced_eos()
    greedy = hf_generate(tuple(prompt), None, 0)
    masked = {m: hf_generate(tuple(prompt), eos, m) for m in (3, 6)}
    # The reference really exercises the mask: EOS is the model's first choice, and again at
    # output 6 (which min_tokens=3 accepts and min_tokens=6 masks); both stop at EOS later.
    assert greedy[0] == eos
    assert masked[3] == [*masked[6][:5], eos]
    assert masked[6][5] != eos and masked[6][-1] == eos and len(masked[6]) < MAX_TOKENS
    for m, tokens in masked.items():
        assert eos not in tokens[:-1] and len(tokens) > m

    params = functools.partial(SamplingParams, temperature=0.0, max_tokens=MAX_TOKENS)
    results = generate(
        {
            "min3": (params(min_tokens=3), eos),
            "min6": (params(min_tokens=6), eos),
            "stop_id": (params(min_tokens=6, stop_token_ids=[eos]), None),
            "no_min": (params(), eos),
            "ignore_eos": (params(min_tokens=6, max_tokens=8, ignore_eos=True), eos),
        }
    )
    assert results["min3"] == (masked[3], "stop", None)
    assert results["min6"] == (masked[6], "stop", None)
    assert results["stop_id"] == (masked[6], "stop", eos)  # a stop id is masked the same way
    assert results["no_min"] == ([eos], "stop", None)
    # ignore_eos: EOS is an ordinary token, sampled as the model's first choice.
    assert results["ignore_eos"] == (greedy[:8], "length", None)
