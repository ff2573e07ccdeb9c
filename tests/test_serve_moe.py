"""``ember serve`` on mixture-of-experts checkpoints through the OpenAI client: DeepSeek-V2
(latent attention, grouped routing) over two ranks with ``--enable-expert-parallel``, and Mixtral
on one (slow session). Completions (with logprobs), chat and streamed chat answer as the offline
API does, whose tokens the parity suites hold to transformers'. The expert-parallel server logs
the experts' load (``--expert-load-log-interval``) from its worker ranks."""

from __future__ import annotations

import openai
import pytest

from ember import LLM, SamplingParams
from ember_testing.serve_process import ServeProcess
from ember_testing.tiny_models import tiny_model_path

FLAGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--max-num-seqs",
    "4",
    "--kv-cache-memory",
    "8MiB",
]
PROMPTS = ["def parse(self, text):", "import os\nimport sys\n"]
CASES = {
    "deepseek_v2-tp2-ep": (
        "deepseek_v2",
        ["-tp", "2", "--enable-expert-parallel", "--expert-load-log-interval", "4"],
    ),
    "mixtral": ("mixtral", []),
}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("deepseek_v2-tp2-ep"),
        pytest.param("mixtral", marks=pytest.mark.slow),
    ],
)
def served(request, tmp_path_factory):
    arch, flags = CASES[request.param]
    path = str(tiny_model_path(arch))
    with ServeProcess([path, *FLAGS, *flags], tmp_path_factory.mktemp("serve")) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        yield path, client, server


def offline(path: str, prompts: list[str], max_tokens: int) -> list[str]:
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=4, kv_cache_memory=8 * 1024**2)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def check_openai_answers_match_offline(path: str, client: openai.OpenAI) -> None:
    """Completions (with logprobs), chat and streamed chat answer as the offline API does."""
    [model] = [m.id for m in client.models.list().data]
    completions = [
        client.completions.create(
            model=model, prompt=p, max_tokens=12, temperature=0.0, logprobs=2
        ).choices[0]
        for p in PROMPTS
    ]
    assert [c.text for c in completions] == offline(path, PROMPTS, 12)
    assert all(len(c.logprobs.token_logprobs) == 12 for c in completions)
    messages = [{"role": "user", "content": "Say something about Python."}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0.0
    )
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0.0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert chat.choices[0].message.content == streamed
    assert chat.usage.completion_tokens == 10


def test_completions_and_chat_match_the_offline_api(served):
    path, client, server = served
    check_openai_answers_match_offline(path, client)
    if "--expert-load-log-interval" in CASES[arch_case(path)][1]:
        # Every 4 steps rank 0 logs the load summed over both ranks (each routed only its slice).
        lines = [x for x in server.log.read_text().splitlines() if "expert load over 4 steps" in x]
        assert lines and all("balancedness" in x for x in lines), server.log.read_text()[-3000:]


def arch_case(path: str) -> str:
    """The CASES key whose model ``path`` is."""
    return next(k for k, (arch, _) in CASES.items() if str(tiny_model_path(arch)) == path)
