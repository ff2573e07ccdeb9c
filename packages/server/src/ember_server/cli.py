"""The ``ember`` command: ``ember serve``, ``ember generate``, ``ember run-batch``, ``ember proxy``
and ``ember bench``.

Without a model, every command uses Ember's built-in demo model: a tiny Llama (about 5 MB) with
random weights and a real byte-level BPE tokenizer, written offline on first use by
``ember_server.demo_model``. It exercises the whole stack but its text is gibberish.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from ember_server.demo_model import DEMO_MODEL_NAME, demo_model_path
from ember_server.engine_args import EngineArgs
from ember_server.openai.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger("ember")


def resolve_model(args: argparse.Namespace) -> None:
    """Set ``args.model`` from the positional MODEL or ``--model``, else to the demo model."""
    tag = getattr(args, "model_tag", None)
    if tag and args.model and tag != args.model:
        raise SystemExit(f"ember: error: MODEL ({tag}) and --model ({args.model}) differ")
    model = tag or args.model
    if model:
        args.model = model
        return
    args.model = demo_model_path()
    if args.served_model_name is None:
        args.served_model_name = DEMO_MODEL_NAME
    logger.warning(
        "No model given: using Ember's built-in demo model '%s', a tiny Llama with RANDOM weights "
        "and a real tokenizer, written offline to %s. Its output is gibberish; pass a model "
        "folder (ember serve /path/to/model) to serve a real model.",
        args.served_model_name,
        args.model,
    )


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Hugging Face model folder; default: the built-in demo model.",
    )
    EngineArgs.add_cli_args(parser)


def _serve(args: argparse.Namespace) -> int:
    from ember_server.openai.api_server import run_server

    asyncio.run(
        run_server(
            EngineArgs.from_cli_args(args),
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            log_level=args.uvicorn_log_level,
            tool_call_parser=args.tool_call_parser,
        )
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    import dataclasses

    from ember_scheduler.sampling_params import SamplingParams
    from ember_server.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    prompts = args.prompt or ["Hello, my name is"]
    if args.chat:
        outputs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        print(f"prompt: {prompt!r}\noutput: {output.outputs[0].text!r}\n")
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    from ember_server.run_batch import run_batch

    for path, mode in ((args.input, "r"), (args.output, "a")):
        try:
            open(path, mode).close()  # fail now, not after the engine started or the batch ran
        except OSError as exc:
            raise SystemExit(
                f"ember run-batch: error: cannot open {path}: {exc.strerror}"
            ) from None
    failed = asyncio.run(run_batch(EngineArgs.from_cli_args(args), args.input, args.output))
    if failed:
        logger.warning("%d request(s) failed; their errors are in %s", failed, args.output)
    return 0


def _proxy(args: argparse.Namespace) -> int:
    from ember_server.pd_proxy import run_proxy

    for name in ("prefill", "decode"):
        if not getattr(args, name).startswith(("http://", "https://")):
            raise SystemExit(f"ember proxy: error: --{name} must be an http:// URL")
    asyncio.run(run_proxy(args.prefill, args.decode, args.host, args.port))
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="Ember LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="Run the OpenAI-compatible HTTP server.")
    _add_model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    serve.add_argument("--port", type=int, default=8000, help="Port to bind (default 8000).")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("EMBER_API_KEY"),
        help="Require 'Authorization: Bearer KEY' (default: $EMBER_API_KEY; none).",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        help='Parse tool calls out of the text of requests with tools and tool_choice "auto".',
    )
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    serve.set_defaults(handler=_serve, needs_model=True)

    generate = commands.add_parser("generate", help="Generate text offline for a few prompts.")
    _add_model_arg(generate)
    generate.add_argument("--prompt", action="append", help="A prompt (repeat for several).")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--chat", action="store_true", help="Send each prompt as a user message.")
    generate.set_defaults(handler=_generate, needs_model=True)

    run_batch = commands.add_parser(
        "run-batch", help="Run an OpenAI batch file (JSONL) offline and write the results."
    )
    _add_model_arg(run_batch)
    run_batch.add_argument("-i", "--input", required=True, help="Batch requests (JSONL).")
    run_batch.add_argument("-o", "--output", required=True, help="Where to write the results.")
    run_batch.set_defaults(handler=_run_batch, needs_model=True)

    proxy = commands.add_parser(
        "proxy", help="Prefill/decode disaggregation: route each request to two servers."
    )
    proxy.add_argument("--prefill", required=True, help="Base URL of the kv_producer server.")
    proxy.add_argument("--decode", required=True, help="Base URL of the kv_consumer server.")
    proxy.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    proxy.add_argument("--port", type=int, default=8000, help="Port to bind (default 8000).")
    proxy.set_defaults(handler=_proxy, needs_model=False)

    from ember_server.bench import latency, throughput
    from ember_server.bench import serve as bench_serve

    bench = commands.add_parser("bench", help="Benchmarks: throughput, latency, serve.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, module, needs_model in (
        ("throughput", throughput, True),
        ("latency", latency, True),
        ("serve", bench_serve, False),
    ):
        sub = benches.add_parser(name, help=module.__doc__.splitlines()[0])
        if needs_model:
            _add_model_arg(sub)
        module.add_cli_args(sub)
        sub.set_defaults(handler=module.main, needs_model=needs_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    args = make_parser().parse_args(argv)
    if args.needs_model:
        resolve_model(args)
    return args.handler(args)
