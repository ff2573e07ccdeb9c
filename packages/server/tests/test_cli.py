"""The ``ember`` command line: flags, defaults and model resolution (no engine is started)."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from ember_server.cli.demo_model import DEMO_MODEL_NAME, demo_model_path
from ember_server.cli.main import UsageError, make_parser, resolve_model
from ember_server.engine.engine_args import EngineArgs
from ember_server.openai.listener import bind_socket


def _parse(*argv: str):
    return make_parser().parse_args(list(argv))


def test_serve_defaults_bind_localhost():
    args = _parse("serve")
    assert (args.host, args.port, args.model_tag, args.model) == ("127.0.0.1", 8000, None, None)
    assert args.needs_model


def test_serve_takes_vllm_flags_into_engine_args(tiny_model):
    model = str(tiny_model("llama"))
    args = _parse(
        "serve",
        model,
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--api-key",
        "k",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "1024",
        "--block-size",
        "32",
        "--kv-cache-memory",
        "64MiB",
        "--no-enable-prefix-caching",
        "--served-model-name",
        "mine",
        "--seed",
        "7",
    )
    resolve_model(args)
    engine_args = EngineArgs.from_cli_args(args)
    assert (args.host, args.port, args.api_key) == ("0.0.0.0", 9001, "k")
    assert engine_args == EngineArgs(
        model=model,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        block_size=32,
        kv_cache_memory=64 * 1024**2,
        enable_prefix_caching=False,
        served_model_name="mine",
        seed=7,
    )


def test_model_flag_and_positional_must_agree(tiny_model):
    args = _parse("serve", "--model", str(tiny_model("llama")))
    resolve_model(args)
    assert args.model == str(tiny_model("llama"))
    args = _parse("serve", "/a", "--model", "/b")
    with pytest.raises(UsageError, match="differ"):
        resolve_model(args)


def test_no_model_means_the_demo_model(caplog):
    args = _parse("serve")
    with caplog.at_level("WARNING", logger="ember"):
        resolve_model(args)
    assert args.model == demo_model_path()
    assert args.served_model_name == DEMO_MODEL_NAME
    assert "RANDOM weights" in caplog.text and args.model in caplog.text
    folder = pathlib.Path(args.model)
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert 1e6 < size < 20e6  # "a few MB"


def test_a_written_demo_model_is_found_without_importing_transformers():
    # A start with the demo model must not spend seconds importing transformers to name a
    # folder it wrote before (the engine core's start waits behind it).
    path = demo_model_path()
    code = (
        "import sys; from ember_server.cli.demo_model import demo_model_path; "
        f"assert demo_model_path() == {path!r}; assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_serve_parser_flags_name_every_parser(capsys):
    args = _parse("serve", "--tool-call-parser", "qwen3_xml", "--reasoning-parser", "deepseek_r1")
    assert (args.tool_call_parser, args.reasoning_parser) == ("qwen3_xml", "deepseek_r1")
    for parser in ("hermes", "llama3_json", "mistral"):
        assert _parse("serve", "--tool-call-parser", parser).tool_call_parser == parser
    assert _parse("serve", "--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        _parse("serve", "--reasoning-parser", "nope")
    assert "deepseek_r1" in capsys.readouterr().err


def test_bad_flag_values_are_rejected(capsys):
    with pytest.raises(SystemExit):
        _parse("serve", "--dtype", "int3")
    with pytest.raises(SystemExit):
        _parse("serve", "--port", "eighty")
    assert "invalid" in capsys.readouterr().err


def test_bench_subcommands():
    args = _parse("bench", "serve", "--concurrency", "1", "4", "--output-json", "x.json")
    assert (args.concurrency, args.output_json, args.needs_model) == ([1, 4], "x.json", False)
    assert args.base_url == "http://127.0.0.1:8000"
    args = _parse("bench", "throughput", "/m", "--num-prompts", "3", "--max-num-seqs", "4")
    assert (args.model_tag, args.num_prompts, args.max_num_seqs) == ("/m", 3, 4)
    args = _parse("bench", "latency", "--batch-size", "2", "--num-iters", "1")
    assert (args.batch_size, args.num_iters, args.needs_model) == (2, 1, True)
    with pytest.raises(SystemExit):
        _parse("bench", "nothing")


def test_generate_flags():
    args = _parse("generate", "--prompt", "a", "--prompt", "b", "--max-tokens", "4", "--chat")
    assert (args.prompt, args.max_tokens, args.chat) == (["a", "b"], 4, True)


def test_module_entry_point_prints_help():
    done = subprocess.run(
        [sys.executable, "-m", "ember_server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert all(word in done.stdout for word in ("serve", "generate", "bench"))


def test_generate_prints_completions(tiny_model, capsys):
    from ember_server.cli.main import main

    model = str(tiny_model("llama"))
    argv = [
        "generate",
        model,
        "--prompt",
        "def f(x):",
        "--max-tokens",
        "3",
        "--max-model-len",
        "64",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prompt: 'def f(x):'" in out and "output: " in out


def test_bench_throughput_and_latency_write_json(tiny_model, tmp_path, capsys):
    from ember_server.cli.main import main

    model = str(tiny_model("llama"))
    engine = [model, "--max-model-len", "64", "--kv-cache-memory", "1MiB"]
    workload = ["--input-len", "4", "--output-len", "3"]
    out_json = tmp_path / "throughput.json"
    argv = ["bench", "throughput", *engine, "--num-prompts", "3", *workload]
    assert main([*argv, "--output-json", str(out_json)]) == 0
    results = json.loads(out_json.read_text())
    assert results["num_requests"] == 3 and results["output_throughput"] > 0
    assert "output tokens/s" in capsys.readouterr().out

    out_json = tmp_path / "latency.json"
    argv = ["bench", "latency", *engine, "--batch-size", "2", "--num-iters", "2", *workload]
    assert main([*argv, "--output-json", str(out_json)]) == 0
    results = json.loads(out_json.read_text())
    assert len(results["latencies_s"]) == 2 and results["latency"]["p99_ms"] > 0


def test_generate_takes_the_prompt_positionally_next_to_model(tiny_model, capsys):
    from ember_server.cli.main import main

    argv = ["generate", "--model", str(tiny_model("llama")), "def f(x):", "--max-tokens", "3",
            "--max-model-len", "64"]  # fmt: skip
    assert main(argv) == 0
    assert "prompt: 'def f(x):'" in capsys.readouterr().out


def _ember(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember_server", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    """The error line of a failed command, checking it is the only line and has no traceback."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("ember"), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve", "/no/such/model"], "model folder '/no/such/model' does not exist"),
        (["serve", "--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
        (["serve", "--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
        (["generate", "some text"], "to pass a prompt, use --prompt 'some text'"),
    ],
)
def test_command_line_mistakes_are_one_line_and_exit_2(argv, expected):
    done = _ember(*argv)
    assert done.returncode == 2
    assert expected in _one_error_line(done)


def test_setting_the_engine_refuses_is_one_line_and_exit_2(tiny_model):
    done = _ember("serve", str(tiny_model("llama")), "--max-model-len", "0")
    assert done.returncode == 2
    assert "max_model_len must be a positive integer" in _one_error_line(done)


def test_kv_memory_too_small_is_one_line_and_exit_2(tiny_model):
    model = str(tiny_model("llama"))
    done = _ember("serve", model, "--kv-cache-memory", "100", "--log-level", "warning")
    assert done.returncode == 2
    assert "kv_cache_memory of 100 bytes holds no KV block" in _one_error_line(done)


def test_port_in_use_is_reported_before_the_model_loads(tiny_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _ember("serve", str(tiny_model("llama")), "--port", str(port))
    assert done.returncode == 1
    line = _one_error_line(done)
    assert f"127.0.0.1:{port}" in line and "in use" in line
    assert "engine core" not in done.stdout + done.stderr  # no engine was started


def test_served_connections_send_small_writes_at_once():
    """Nagle's algorithm is off on every connection the server accepts: with it on, each response
    on a kept-alive connection (the openai client's) waited 40 ms for the client's delayed ACK."""

    async def accept_one() -> int:
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await loop.create_server(Probe, sock=bind_socket("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accept_one()) != 0


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_debug_log_level_shows_the_traceback(how):
    if how == "flag":
        done = _ember("serve", "/no/such/model", "--log-level", "debug")
    else:
        done = _ember("serve", "/no/such/model", env={"EMBER_LOGGING_LEVEL": "debug"})
    assert done.returncode == 2
    assert "Traceback" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("ember: error: model folder")


def test_the_api_server_process_never_imports_torch():
    """The API server tokenizes, streams and routes; torch is the engine core process's. Importing
    it cost the API server 2-3 s of a 2-core machine's start-up, beside the engine's own import."""
    code = (
        "import sys, ember_server.cli.main, ember_server.openai.api_server, ember_server.engine.async_llm; "
        "ember_server.cli.main.make_parser().parse_args(['serve', '--speculative-config', "
        '\'{"method": "ngram", "num_speculative_tokens": 2}\']); '
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_public_names_load_on_first_use():
    """``import ember_server`` costs nothing; its public names load with the module behind each,
    the API server's without torch."""
    code = (
        "import sys, ember_server; assert 'torch' not in sys.modules; "
        "from ember_server import AsyncLLM, EngineArgs, SamplingParams; "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "from ember_server.engine.llm import LLM; assert ember_server.LLM is LLM; "
        "assert AsyncLLM.__module__ == 'ember_server.engine.async_llm'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
