"""lm-evaluation-harness against a live ``ember serve`` through its ``local-completions`` model:
a loglikelihood (multiple-choice) task and a generate-until task from task files this test
writes (its data in local JSON lines: nothing is downloaded). The same tasks run through
lm-eval's transformers model (``hf``, float32) are the reference: loglikelihoods within 1e-4,
greedy generations equal.

lm-eval is installed by the server's ``eval`` dependency group, which ``nox -s slow`` adds for the
server (its import is inside the test: the default suite runs without it).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin"], 0),
    ("def add(a, b):\n    return", [" a + b", " a - b"], 0),
    ("One, two, three,", [" four", " five", " six", " seven"], 0),
    ("import numpy as", [" np", " pd"], 0),
]
PROMPTS = ["Once upon a time", "The quick brown fox", "def main():"]


def _write_tasks(folder) -> None:
    mc = folder / "mc.jsonl"
    mc.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    gen = folder / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in PROMPTS))
    (folder / "ember_mc.yaml").write_text(
        f"""task: ember_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
    )
    (folder / "ember_gen.yaml").write_text(
        f"""task: ember_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
    )


def _samples(model: str, model_args: dict, folder) -> dict[str, list]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["ember_mc", "ember_gen"],
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
        batch_size=1,
    )
    return results["samples"]


def test_lm_eval_local_completions_matches_transformers(tiny_model, tmp_path, monkeypatch):
    from ember_testing.serve_process import ServeProcess

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write_tasks(tasks)
    model = str(tiny_model("llama"))
    flags = [model, "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256"]
    with ServeProcess(flags, tmp_path) as server:
        served = _samples(
            "local-completions",
            {
                "model": MODEL,
                "base_url": f"{server.base_url}/v1/completions",
                "tokenizer": model,
                "tokenizer_backend": "huggingface",
                "add_bos_token": True,  # as the reference's tokenizer does by default
                "num_concurrent": 1,
                "max_retries": 1,
            },
            tasks,
        )
    hf_args = {"pretrained": model, "dtype": "float32", "device": "cpu", "add_bos_token": True}
    reference = _samples("hf", hf_args, tasks)

    mc, mc_reference = served["ember_mc"], reference["ember_mc"]
    assert len(mc) == len(QUESTIONS)
    for sample, expected in zip(mc, mc_reference):
        lls = [resp[0][0] for resp in sample["resps"]]
        expected_lls = [resp[0][0] for resp in expected["resps"]]
        assert len(lls) == len(expected_lls)
        assert lls == pytest.approx(expected_lls, abs=1e-4)
        assert [r[0][1] for r in sample["resps"]] == [r[0][1] for r in expected["resps"]]
    gen, gen_reference = served["ember_gen"], reference["ember_gen"]
    assert len(gen) == len(PROMPTS)
    assert [s["resps"] for s in gen] == [s["resps"] for s in gen_reference]
    assert all(s["resps"][0][0] for s in gen)  # something was generated
