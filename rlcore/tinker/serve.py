"""The server's flags and its process: distributed setup, rank 0's HTTP server on uvicorn behind
`rlcore.serving.guard` (Host, content type, body size, key), the other ranks following
(`rlcore.tinker.ops.follow`). Without --api-key the server binds loopback addresses only: it then serves
this machine, whose web pages the Host and content-type checks keep out."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Literal

from rlcore.dist.memory import return_freed_memory
from rlcore.dist.mesh import close_distributed, init_distributed
from rlcore.dist.peers import EXIT_PEER_LOST
from rlcore.dist.placement import place
from rlcore.dist.rendezvous import WorldNotFormed
from rlcore.tinker.limits import Limits
from rlcore.tinker.model import ServeOptions
from rlcore.tinker.ops import TinkerModels, follow


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeArgs:
    """Serve the Tinker API over rlcore: TINKER_BASE_URL=http://HOST:PORT and TINKER_API_KEY (the --api-key, or
    any key starting with tml- when the server has none) point the tinker SDK at it."""

    port: int = 8000
    """Port to listen on (0: a free one; the ready line names it)."""
    host: str = "127.0.0.1"
    """Address to bind (the default serves this machine only); an address other than a loopback one needs
    --api-key."""
    workdir: str = "tinker-runs"
    """Where saved states, sampler weights and tokenizer directories go (a restarted server finds its
    states here by their tinker:// paths)."""
    full_finetune: bool = False
    """Train every parameter whatever LoRA rank the client asks for (a client asks for it with rank=0)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trained models."""
    seed: int = 0
    """Seed of random initialisation (built-in models, LoRA adapters) and of unseeded sampling."""
    micro_batch_tokens: int = 0
    """Tokens per forward/backward pass on a rank (gradients accumulate over the passes); 0: as many as keep
    the pass's fp32 logits within 1 GiB (about 5K tokens of a 49K vocabulary)."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: the update is B A alpha / rank."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda:<local rank> where CUDA is available, else cpu."""
    freed_memory: Literal["keep", "trim", "unmap"] = "keep"
    """As train.py's --trainer.freed-memory; trim gives the freed memory back after each operation."""
    rollout_ranks: int = 0
    """Split placement under torchrun: ranks 0..N-1 hold the engine (rank 0 samples), the others train; 0:
    colocated (every rank trains, rank 0 samples)."""
    api_key: str | None = None
    """Every request must carry this key in X-API-Key (the SDK sends TINKER_API_KEY there; it starts with
    tml-); None: no key, and only a loopback --host."""
    api_key_file: str | None = None
    """A file whose first line is the key (as --api-key, kept out of the process list)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names served besides the bound address, localhost and 127.0.0.1 (a request sent to another name
    is refused: DNS rebinding)."""
    model_roots: tuple[str, ...] = ()
    """Directories a client's base_model may load from as a local path (a directory or GGUF file under
    one); none: built-in models and hub ids (org/name) only."""
    max_body_mb: int = 64
    """Largest request body in MiB (the SDK splits a forward_backward into bodies of about 5 MB)."""
    max_samples: int = 256
    """Largest num_samples of one sample request."""
    max_lora_rank: int = 256
    """Largest LoRA rank a training client may ask for."""
    max_models: int = 16
    """Training clients the server holds at once (each holds its weights, optimizer and engine)."""
    max_sampling_sessions: int = 1024
    """Sampling sessions kept; past it the oldest is forgotten (its next request fails in one line)."""
    max_futures: int = 10000
    """Request results kept (past it the oldest finished one is dropped) and requests waiting to run."""
    op_timeout_s: float = 600.0
    """Seconds one operation may run: forward_backward stops between micro-batches (clearing the gradients
    accumulated since the last optim_step) and sampling between decode steps, failing that operation alone."""


def _options(args: ServeArgs) -> ServeOptions:
    limits = Limits(max_samples=args.max_samples, max_lora_rank=args.max_lora_rank, max_models=args.max_models,
                    max_sampling_sessions=args.max_sampling_sessions, max_futures=args.max_futures,
                    op_timeout_s=args.op_timeout_s, model_roots=tuple(Path(r).resolve() for r in args.model_roots))  # fmt: skip
    return ServeOptions(workdir=Path(args.workdir).resolve(), full_finetune=args.full_finetune, dtype=args.dtype,
                        seed=args.seed, micro_batch_tokens=args.micro_batch_tokens, lora_alpha=args.lora_alpha,
                        limits=limits)  # fmt: skip


def api_key(args: ServeArgs) -> str | None:
    """The key every request must carry (--api-key or the first line of --api-key-file), or None; a ValueError
    for a key the SDK cannot send or a --host that serves other machines without one."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("--api-key and --api-key-file: give one")
    key = args.api_key
    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text().partition("\n")[0].strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it ({e.strerror})") from None
    if key is not None and (not key.startswith("tml-") or len(key) < 8):
        raise ValueError("--api-key: the tinker SDK sends only keys starting with tml-; use one such as tml-<32 "
                         "random characters>")  # fmt: skip
    if key is None and not _loopback(args.host):
        raise ValueError(f"--host {args.host} serves other machines: pass --api-key (or --api-key-file) so that "
                         "only the key's holders can drive the server")  # fmt: skip
    return key


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _bad_limit(args: ServeArgs) -> str | None:
    limits = {"--max-body-mb": args.max_body_mb, "--max-samples": args.max_samples, "--max-lora-rank": args.max_lora_rank,
              "--max-models": args.max_models, "--max-sampling-sessions": args.max_sampling_sessions,
              "--max-futures": args.max_futures, "--op-timeout-s": args.op_timeout_s}  # fmt: skip
    for flag, value in limits.items():
        if not value > 0:
            return f"{flag} {value}: give a positive bound"
    missing = [r for r in args.model_roots if not Path(r).is_dir()]
    return f"--model-roots {missing[0]}: not a directory" if missing else None


def serve(args: ServeArgs) -> int:
    """Run the server until it is stopped (every rank calls it); the exit code."""
    if args.micro_batch_tokens < 0:
        print("error: --micro-batch-tokens must be 0 (automatic) or a number of tokens", file=sys.stderr)
        return 2
    try:
        key = api_key(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if (bad := _bad_limit(args)) is not None:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    return_freed_memory(args.freed_memory)
    try:
        info = init_distributed(args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except WorldNotFormed as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_PEER_LOST
    try:
        placement = place(info, split=args.rollout_ranks > 0, rollout_ranks=max(args.rollout_ranks, 1))
    except ValueError as e:
        print(f"error: --rollout-ranks {args.rollout_ranks}: {e}", file=sys.stderr)
        close_distributed()
        return 2
    served = TinkerModels(_options(args), placement)
    try:
        if info.rank != 0:
            follow(served)
            return 0
        return _serve_http(args, served, key)
    finally:
        close_distributed()


def _guarded(app, args: ServeArgs, key: str | None):
    """`app` behind the checks of `rlcore.serving.guard`, refusals as `{"detail": message}` (what the SDK shows)."""
    from rlcore.serving.guard import Guard, GuardFlags, Key, guarded, local_hosts

    guard = Guard(hosts=local_hosts(args.host, args.allowed_hosts), content_types=CONTENT_TYPES,
                  max_body_bytes=args.max_body_mb << 20, key=Key(header="X-API-Key", value=key) if key else None,
                  flags=GuardFlags(hosts="--allowed-hosts", body="--max-body-mb", key="--api-key"))  # fmt: skip
    return guarded(app, guard, refuse=lambda status, message: {"detail": message})


CONTENT_TYPES = frozenset({"application/json", "application/x-protobuf"})
"""The bodies the SDK sends: JSON, and protobuf to /forward_backward (a text/plain or form post is a 415)."""


def _serve_http(args: ServeArgs, served: TinkerModels, key: str | None) -> int:
    import uvicorn

    from rlcore.models.policy import BUILTIN_MODELS, BUILTIN_PREFIX
    from rlcore.tinker.server import Api, create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"error: --host {args.host} --port {args.port}: cannot listen ({e.strerror}); pick another port, "
              "or 0 for a free one", file=sys.stderr)  # fmt: skip
        return 2
    port = sock.getsockname()[1]
    api = Api(served, [BUILTIN_PREFIX + name for name in BUILTIN_MODELS])
    config = uvicorn.Config(_guarded(create_app(api), args, key), log_config=None, access_log=False, lifespan="off", timeout_keep_alive=75)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rlcore-tinker-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    if not thread.is_alive():
        print("error: the HTTP server did not start", file=sys.stderr)
        return 1
    who = ("TINKER_API_KEY=<the --api-key>" if key else
           "any TINKER_API_KEY starting with tml-; no --api-key: this machine only")  # fmt: skip
    print(f"rlcore.tinker: serving the Tinker API at http://{args.host}:{port} "
          f"(TINKER_BASE_URL=http://{args.host}:{port}, {who})", flush=True)  # fmt: skip
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        server.should_exit = True
        thread.join(10)
    finally:
        api.worker.stop()
    return 0
