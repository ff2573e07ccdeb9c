"""The ``ember`` command: ``ember serve``, ``ember generate``, ``ember run-batch``, ``ember proxy``,
``ember bench`` and ``ember collect-env``.

Without a model, every command uses Ember's built-in demo model: a tiny Llama (about 5 MB) with
random weights and a real byte-level BPE tokenizer, written offline on first use by
``ember_server.cli.demo_model``. It exercises the whole stack but its text is gibberish.

A user's mistake is one line on stderr (``ember: error: ...``) and a non-zero exit: 2 for what
was typed (a flag, a model folder, a setting the engine refuses), 1 for the environment (a port in
use). The traceback comes only with ``--log-level debug`` (or ``EMBER_LOGGING_LEVEL=debug``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import signal
import sys
import traceback

from ember_server.cli.demo_model import DEMO_MODEL_NAME, demo_model_path
from ember_server.cli.event_loop import run_event_loop
from ember_server.engine.engine_args import EngineArgs, parse_bytes
from ember_server.engine.lora_args import add_lora_modules_arg
from ember_server.openai.reasoning import REASONING_PARSERS
from ember_server.openai.tool_calls import TOOL_CALL_PARSERS
from ember_worker.logs import configure_logging

logger = logging.getLogger("ember")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
USAGE_ERROR = 2  # argparse's status for a bad command line
ENVIRONMENT_ERROR = 1


class UsageError(Exception):
    """A mistake in the command line itself."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage block), exit 2."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def resolve_model(args: argparse.Namespace) -> None:
    """Set ``args.model`` from the positional MODEL or ``--model``, else to the demo model.

    For ``ember generate``, a positional argument next to ``--model`` is a prompt. A model that
    is not a folder holding a ``config.json`` is a ``UsageError``.
    """
    tag = getattr(args, "model_tag", None)
    if tag and args.model and tag != args.model:
        if not getattr(args, "positional_prompt", False):
            raise UsageError(f"MODEL ({tag}) and --model ({args.model}) differ")
        args.prompt = [tag, *(args.prompt or [])]
        tag = None
    model = tag or args.model
    if model:
        _check_model_folder(model, prompt_hint=getattr(args, "positional_prompt", False))
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


def _check_model_folder(model: str, prompt_hint: bool) -> None:
    folder = pathlib.Path(model)
    hint = ""
    if prompt_hint:
        hint = f"; to pass a prompt, use --prompt {model!r} (or --model MODEL {model!r})"
    if not folder.is_dir():
        raise UsageError(f"model folder {model!r} does not exist{hint}")
    if not (folder / "config.json").is_file():
        raise UsageError(f"{model!r} is not a Hugging Face model folder (no config.json){hint}")


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Hugging Face model folder; default: the built-in demo model.",
    )
    EngineArgs.add_cli_args(parser)


class _StoppedDuringStartUp(Exception):
    """A SIGTERM or SIGINT that came before the server's event loop took the signals over."""


def _stop_start_up(signum: int, frame) -> None:
    raise _StoppedDuringStartUp(signal.Signals(signum).name)


def _serve(args: argparse.Namespace) -> int:
    from ember_server.engine.core_client import launch_engines
    from ember_server.openai.listener import bind_socket

    engine_args = EngineArgs.from_cli_args(args)
    listener = bind_socket(args.host, args.port)  # a port in use fails before anything starts
    engines = []
    # Until run_server handles the signals, either one stops the start-up cleanly, as it does.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_start_up)
    try:
        # The engine cores start first: the API server's own imports (FastAPI, the routes) then
        # run beside their start-up instead of before it.
        engines = launch_engines(engine_args)
        from ember_server.openai.api_server import run_server

        return run_event_loop(
            run_server(
                engine_args,
                listener,
                engines,
                api_key=args.api_key,
                log_level=args.uvicorn_log_level,
                tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser,
                shutdown_timeout=args.shutdown_timeout,
                max_body_size=args.max_request_body_size,
                lora_modules=dict(args.lora_modules or ()),
            )
        )
    except _StoppedDuringStartUp as stop:
        logger.info("%s during start-up: stopping", stop)
        return 0
    finally:  # run_server stops them; this covers a start-up stopped before it ran
        listener.close()
        for engine in engines:
            engine.abandon()


def _generate(args: argparse.Namespace) -> int:
    import dataclasses

    from ember_scheduler.sampling_params import SamplingParams
    from ember_server.engine.llm import LLM

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
    from ember_server.cli.run_batch import run_batch

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
    from ember_server.cli.pd_proxy import run_proxy

    for name in ("prefill", "decode"):
        if not getattr(args, name).startswith(("http://", "https://")):
            raise SystemExit(f"ember proxy: error: --{name} must be an http:// URL")
    run_event_loop(run_proxy(args.prefill, args.decode, args.host, args.port))
    return 0


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _positive_bytes(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a byte count such as 4194304 or 4MiB, got {text!r}"
        )
    return value


def _collect_env(_args: argparse.Namespace) -> int:
    from ember_server.cli.collect_env import main as collect_env_main

    return collect_env_main()


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ember", description="Ember LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=os.environ.get("EMBER_LOGGING_LEVEL", "info").lower(),
        help="Log level of ember (default: $EMBER_LOGGING_LEVEL or info); "
        "'debug' also prints the traceback of an error.",
    )

    def command(subparsers, name: str, help: str) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, help=help, parents=[common])

    serve = command(commands, "serve", "Run the OpenAI-compatible HTTP server.")
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
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="Split the model's <think>...</think> thinking into reasoning_content (chat).",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=None,
        help="Seconds that requests in flight get to finish after SIGTERM or Ctrl-C before they "
        "fail with a 503 (default 25: below Kubernetes' 30 s before SIGKILL).",
    )
    serve.add_argument(
        "--max-request-body-size",
        type=_positive_bytes,
        default=None,
        help="Largest request body, e.g. 4MiB; larger ones get a 413 (default: 64 bytes per "
        "token of max-model-len, at least 1MiB).",
    )
    add_lora_modules_arg(serve)
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    serve.set_defaults(handler=_serve, needs_model=True)

    generate = command(commands, "generate", "Generate text offline for a few prompts.")
    _add_model_arg(generate)
    generate.add_argument("--prompt", action="append", help="A prompt (repeat for several).")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--chat", action="store_true", help="Send each prompt as a user message.")
    generate.set_defaults(handler=_generate, needs_model=True, positional_prompt=True)

    run_batch = command(
        commands, "run-batch", "Run an OpenAI batch file (JSONL) offline and write the results."
    )
    _add_model_arg(run_batch)
    run_batch.add_argument("-i", "--input", required=True, help="Batch requests (JSONL).")
    run_batch.add_argument("-o", "--output", required=True, help="Where to write the results.")
    run_batch.set_defaults(handler=_run_batch, needs_model=True)

    proxy = command(
        commands, "proxy", "Prefill/decode disaggregation: route each request to two servers."
    )
    proxy.add_argument("--prefill", required=True, help="Base URL of the kv_producer server.")
    proxy.add_argument("--decode", required=True, help="Base URL of the kv_consumer server.")
    proxy.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    proxy.add_argument("--port", type=int, default=8000, help="Port to bind (default 8000).")
    proxy.set_defaults(handler=_proxy, needs_model=False)

    from ember_server.cli.bench import latency, throughput
    from ember_server.cli.bench import serve as bench_serve

    bench = commands.add_parser("bench", help="Benchmarks: throughput, latency, serve.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, module, needs_model in (
        ("throughput", throughput, True),
        ("latency", latency, True),
        ("serve", bench_serve, False),
    ):
        sub = command(benches, name, module.__doc__.splitlines()[0])
        if needs_model:
            _add_model_arg(sub)
        module.add_cli_args(sub)
        sub.set_defaults(handler=module.main, needs_model=needs_model)

    collect = command(commands, "collect-env", "Print the environment for a bug report.")
    collect.set_defaults(handler=_collect_env, needs_model=False)
    return parser


def _exit_status(exc: BaseException) -> int | None:
    """The exit status of a user's mistake; None for anything else (a bug: its traceback shows)."""
    from ember_server.engine.core_client import EngineStartupError

    if isinstance(exc, EngineStartupError):
        return USAGE_ERROR if exc.bad_settings else ENVIRONMENT_ERROR
    if isinstance(exc, (UsageError, ValueError)):
        return USAGE_ERROR
    if isinstance(exc, OSError):
        return ENVIRONMENT_ERROR
    return None


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    configure_logging(args.log_level)  # engine cores and worker ranks inherit the level
    try:
        if args.needs_model:
            resolve_model(args)
        return args.handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        status = _exit_status(exc)
        if status is None:
            raise
        if args.log_level == "debug":
            traceback.print_exc()
            if getattr(exc, "engine_traceback", None):
                print(f"engine core traceback:\n{exc.engine_traceback}", file=sys.stderr)
        print(f"ember: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return status
