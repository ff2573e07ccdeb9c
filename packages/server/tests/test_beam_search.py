"""``LLM.beam_search`` against a reference beam search over transformers' log-probabilities
(float32), written here from the algorithm's statement (vLLM's): every beam's 2 * width most
likely next tokens are candidates; those ending in EOS are set aside, the width most likely others
live on; the answer is the width best of both by cum_logprob / length ** length_penalty."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.beam_search import BeamSearchParams
from ember_server.engine.llm import LLM

PROMPTS = ["The quick brown fox", "def main(argv):"]


def reference_beam_search(model, prompt_ids, width, max_tokens, length_penalty, eos):
    live = [(list(prompt_ids), 0.0)]
    ended = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, total in live:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            values, ids = logits.log_softmax(-1).topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist()):
                if token in eos:
                    ended.append(([*tokens, token], total + value, True))
                else:
                    candidates.append(([*tokens, token], total + value))
        candidates.sort(key=lambda c: -c[1])
        live = candidates[:width]
        if not live:
            break
    everything = ended + [(tokens, total, False) for tokens, total in live]

    def score(entry):
        tokens, total, finished = entry
        return total / ((len(tokens) - finished) ** length_penalty)

    return sorted(everything, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(model=str(tiny_model("llama")), dtype="float32", max_model_len=128)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(("width", "length_penalty"), [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beam_search_equals_the_reference_over_transformers(llm, tiny_model, width, length_penalty):
    path = str(tiny_model("llama"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    outputs = llm.beam_search(PROMPTS, params)
    eos = {tokenizer.eos_token_id}
    for prompt, output in zip(PROMPTS, outputs):
        prompt_ids = tokenizer(prompt).input_ids
        expected = reference_beam_search(model, prompt_ids, width, 5, length_penalty, eos)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _, _ in expected]
        for sequence, (tokens, total, _) in zip(output.sequences, expected):
            assert sequence.cum_logprob == pytest.approx(total, abs=1e-4)
            assert sequence.text == tokenizer.decode(tokens[len(prompt_ids) :])
    if width == 1:  # one beam is greedy decoding
        greedy_params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        greedy = llm.generate(PROMPTS, greedy_params, use_tqdm=False)
        for output, expected in zip(outputs, greedy):
            generated = output.sequences[0].tokens[len(expected.prompt_token_ids) :]
            assert generated == expected.outputs[0].token_ids


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 11}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_params_name_their_field(fields, name):
    with pytest.raises(ValueError, match=f"BeamSearchParams.{name}"):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 3, **fields})


def test_use_beam_search_over_http_equals_the_offline_search(llm, tiny_model):
    import httpx
    from server_thread import ServerThread

    from ember_server.engine.engine_args import EngineArgs

    params = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=0.5)
    expected = llm.beam_search(PROMPTS, params)
    args = EngineArgs(model=str(tiny_model("llama")), dtype="float32", max_model_len=128)
    body = {"prompt": PROMPTS, "max_tokens": 4, "n": 3, "length_penalty": 0.5}
    with ServerThread(args) as server:
        url = f"{server.base_url}/v1/completions"
        result = httpx.post(url, json={**body, "use_beam_search": True}, timeout=60).json()
        refused = [
            httpx.post(url, json={**body, "use_beam_search": True, **extra}, timeout=60)
            for extra in ({"stream": True}, {"n": 11}, {"logprobs": 1})
        ]
    texts = [c["text"] for c in sorted(result["choices"], key=lambda c: c["index"])]
    assert texts == [s.text for output in expected for s in output.sequences]
    prompt_lens = [len(llm.get_tokenizer()(p).input_ids) for p in PROMPTS]
    generated = [len(s.tokens) - n for o, n in zip(expected, prompt_lens) for s in o.sequences]
    assert result["usage"]["completion_tokens"] == sum(generated)
    assert [r.status_code for r in refused] == [400, 400, 400]
    assert [r.json()["error"]["param"] for r in refused][1] == "n"
