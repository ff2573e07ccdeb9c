"""The offline API as a vLLM user meets it: ``from ember import LLM, SamplingParams``."""

import torch
from transformers import AutoModelForCausalLM

from ember import LLM, SamplingParams

PROMPTS = ["def parse(self, text):", "Grüße aus Köln, 日本語"]


def test_greedy_matches_transformers_on_every_architecture(tiny_model_any):
    llm = LLM(str(tiny_model_any), dtype="float32", kv_cache_memory=4 * 1024**2, max_model_len=128)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_any, dtype=torch.float32)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt == prompt
        assert output.prompt_token_ids == tokenizer(prompt).input_ids
        completion = output.outputs[0]
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([output.prompt_token_ids]), max_new_tokens=8, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(output.prompt_token_ids) :].tolist()  # fmt: skip
        assert completion.token_ids == expected
        assert completion.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert completion.finish_reason == "length"
        assert completion.logprobs is None


def test_ember_reexports_the_server_public_names():
    """The meta-package's names are the server's own objects, its list the server's list."""
    import ember
    import ember_server

    assert ember.LLM is ember_server.LLM is LLM
    assert ember.SamplingParams is ember_server.SamplingParams is SamplingParams
    assert ember.AsyncLLM is ember_server.AsyncLLM
    assert set(ember.__all__) <= set(ember_server.__all__)
