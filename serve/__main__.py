"""python -m serve --model DIR [--adapter NAME=DIR ...] [--host 127.0.0.1] [--port 8000] ...

Serves a model directory over OpenAI's HTTP API (`serve.server`): loads it, compiles every
step shape of the engine (printed), then answers on http://HOST:PORT/v1 until SIGTERM or
Ctrl-C, which stop admitting (new requests get 503, /health too), finish the requests in
flight and exit 0 (a second signal exits at once).

    python -m serve --model runs/default/model
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "default", "prompt": "the dog sees a cat .", "max_tokens": 16}'

--adapter NAME=DIR (repeatable): a PEFT LoRA adapter of the model, served as the model
NAME (GET /v1/models lists it); requests naming different adapters share each step.

--mesh tensor=N[,expert=M]: the parameters split over N (x M) devices as sharded decoding
splits them (`models.axes.param_shardings`): heads, MLP and vocabulary over `tensor`, the
page pool by kv heads likewise, experts over `expert`; a model larger than one device
serves unchanged.

--quantize int8|int4: every attention, MLP and expert projection quantized as it is loaded
(`models.quantize`; after --mesh places the float weights, each kernel on its shards).

--target-lang CODE, --source-lang CODE: a translation model's languages by the codes its
tokenizer names (NLLB-200's spa_Latn, M2M-100's es, mBART-50's es_XX), for every request:
the target's token forced as the first of max_tokens, the source's around each prompt as
the tokenizer's src_lang puts it (as `python -m decode` takes them).

--api-key KEY (or the SERVE_API_KEY environment variable): every endpoint but /health
needs `Authorization: Bearer KEY`. Binding another host than loopback without one warns.

Exit status: 0 after a graceful stop; 2 for a mistake in the flags or the model directory
(one `error:` line on stderr); 1 for an internal error (with its traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import socket
import sys
import threading
import time
import traceback

import models
from decode import cli_request
from decode.source import add_quantize_flag
from models.cache_int8 import KV_CACHE_DTYPES
from models.errors import UserError

INTERNAL = "internal error (a bug in jax-transformer-zoo or a library it uses)"
ENGINE_FLAGS = ("max_slots", "page_size", "num_pages", "max_tokens_per_step", "prefill_chunk",
                "max_queue", "decode_steps", "kv_cache_dtype")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _adapter(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR")
    return name, path


def _mesh(text: str) -> dict[str, int]:
    sizes = {}
    for part in text.split(","):
        axis, sep, size = part.partition("=")
        if not sep or axis not in ("tensor", "expert") or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give tensor=N and optionally expert=M (sizes >= 1)")
        sizes[axis] = int(size)
    return sizes


def placed(pre, sizes: dict[str, int]):
    """`pre` with its parameters split over a (data 1, fsdp 1, tensor, expert) mesh of the
    first tensor x expert devices.

    Raises:
        UserError: more devices than there are, or kv heads the tensor axis does not divide.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from models.axes import AXES, EXPERT_AXIS, param_shardings
    tensor, expert = sizes.get("tensor", 1), sizes.get("expert", 1)
    devices = jax.devices()
    if tensor * expert > len(devices):
        raise UserError(f"--mesh needs {tensor * expert} devices; there are {len(devices)}")
    if pre.config.num_kv_heads % tensor:
        raise UserError(f"num_kv_heads={pre.config.num_kv_heads} does not divide over the "
                        f"tensor axis of {tensor} devices")
    grid = np.array(devices[:tensor * expert]).reshape(1, 1, tensor, expert)
    mesh = Mesh(grid, (*AXES, EXPERT_AXIS))
    return dataclasses.replace(pre, params=jax.device_put(
        pre.params, param_shardings(pre.model, mesh)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serve", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--model", required=True, help="a model directory (Hugging Face layout)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   type=_adapter, help="a PEFT LoRA adapter of the model, served as NAME "
                   "(repeatable)")
    p.add_argument("--mesh", type=_mesh, default=None, metavar="tensor=N[,expert=M]",
                   help="split the parameters (and the page pool) over N (x M) devices")
    add_quantize_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the `model` clients give (default: the directory's name; "
                        "RUN for a run's RUN/model)")
    p.add_argument("--api-key", default=os.environ.get("SERVE_API_KEY"), metavar="KEY",
                   help="require `Authorization: Bearer KEY` (default: $SERVE_API_KEY)")
    p.add_argument("--max-body-bytes", type=_positive_int, default=None,
                   help="refuse larger request bodies (413; default 32 MiB)")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="SECONDS",
                   help="on SIGTERM, wait at most this long for requests in flight")
    engine = p.add_argument_group("engine (default: serve.Engine's)")
    engine.add_argument("--max-slots", type=_positive_int, help="requests decoded at once")
    engine.add_argument("--page-size", type=_positive_int, help="tokens per KV-cache page")
    engine.add_argument("--num-pages", type=_positive_int, help="pages in the pool")
    engine.add_argument("--max-tokens-per-step", type=_positive_int,
                        help="the tokens one step reads (its budget)")
    engine.add_argument("--prefill-chunk", type=_positive_int,
                        help="the longest piece of a prompt prefilled in one step")
    engine.add_argument("--decode-steps", type=_positive_int,
                        help="tokens a decode call makes per request while none waits")
    engine.add_argument("--max-queue", type=_positive_int,
                        help="waiting requests before new ones get 429")
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                        help="the page pool's keys and values: auto (the model's dtype) or "
                             "int8 (a scale per token per kv head; about a quarter of "
                             "float32's bytes)")
    cli_request.add_language_flags(p)
    p.add_argument("--verbose", action="store_true", help="tracebacks with errors")
    return p


def with_languages(pre, args):
    """`pre` with --source-lang's tokenizer and --target-lang's forced first token (its
    generation defaults', which the server applies to every request)."""
    tokenizer, gen = cli_request.with_languages(args, pre.tokenizer, pre.generation,
                                                pre.config)
    return dataclasses.replace(pre, tokenizer=tokenizer, generation=gen)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use fails at once."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is outside [0, 65535]")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _default_name(path: str) -> str:
    """The directory's name; a training run's export (RUN/model) is named after the run."""
    path = os.path.abspath(path)
    name = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) if name == "model" else name


def run(args) -> None:
    import uvicorn

    from models.chat import ChatTemplate
    from serve import server
    from serve.engine import Engine
    from serve.metrics import Metrics
    sock = _listen(args.host, args.port)
    if args.api_key is None and not ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
        print(f"warning: --host {args.host} is reachable from other machines and no --api-key "
              "is set: anyone there can use this server", file=sys.stderr)
    pre = models.load(args.model)
    if pre.tokenizer is None:
        raise UserError(f"{args.model} has no tokenizer files: the server takes and gives text")
    pre = with_languages(pre, args)
    if args.mesh:
        pre = placed(pre, args.mesh)
    if args.quantize:             # after placing: each kernel is quantized on its shards
        pre = models.quantize(pre, args.quantize, group=args.quantize_group)
    template = ChatTemplate.from_directory(args.model)
    options = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    adapters = {}
    for name, path in args.adapter:
        if name in adapters:
            raise UserError(f"--adapter {name}= is given twice")
        adapters[name] = models.read_adapter(path, args.model)
    engine = Engine(pre, metrics=Metrics(), adapters=adapters or None, **options)
    engine.start()
    name = args.served_model_name or _default_name(args.model)
    print(f"compiled {engine.compiled_shapes} step shapes; serving {name!r} at "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    state = server.ServerState()
    limit = {} if args.max_body_bytes is None else {"max_body_bytes": args.max_body_bytes}
    application = server.app(engine, model_name=name, api_key=args.api_key,
                             chat_template=template, state=state, **limit)
    config = uvicorn.Config(application, log_level="warning", lifespan="off")
    draining = threading.Event()

    def drain():      # new requests get 503 while the engine and the responses finish
        state.stopping = True
        engine.stop(drain=True, timeout=args.drain_timeout)
        end = time.monotonic() + (args.drain_timeout or float("inf"))
        while state.active and time.monotonic() < end:
            time.sleep(0.02)
        uv.should_exit = True

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):       # SIGTERM, SIGINT: drain; a second: exit
            if draining.is_set():
                return super().handle_exit(sig, frame)
            draining.set()
            threading.Thread(target=drain, daemon=True).start()

    uv = Server(config)
    try:
        uv.run(sockets=[sock])
    finally:
        if not draining.is_set():
            engine.stop(drain=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    models.use_compile_cache()
    try:
        run(args)
    except Exception as e:
        user = isinstance(e, (UserError, OSError))
        if not user or args.verbose:
            traceback.print_exc()
        print(f"error: {e}" if user else f"error: {INTERNAL}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2 if user else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
