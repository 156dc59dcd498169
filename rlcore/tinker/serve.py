"""The server's flags and its process: distributed setup, rank 0's HTTP server on uvicorn, the other
ranks following (`rlcore.tinker.ops.follow`)."""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Literal

from rlcore.dist.mesh import close_distributed, init_distributed
from rlcore.dist.placement import place
from rlcore.tinker.model import ServeOptions
from rlcore.tinker.ops import Served, follow
from rlcore.trainer.memory import return_freed_memory


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeArgs:
    """Serve the Tinker API over rlcore: TINKER_BASE_URL=http://HOST:PORT and any TINKER_API_KEY starting
    with tml- point the tinker SDK at it."""

    port: int = 8000
    """Port to listen on (0: a free one; the ready line names it)."""
    host: str = "127.0.0.1"
    """Address to bind (the default serves this machine only)."""
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


def _options(args: ServeArgs) -> ServeOptions:
    return ServeOptions(workdir=Path(args.workdir).resolve(), full_finetune=args.full_finetune, dtype=args.dtype,
                        seed=args.seed, micro_batch_tokens=args.micro_batch_tokens, lora_alpha=args.lora_alpha)  # fmt: skip


def serve(args: ServeArgs) -> int:
    """Run the server until it is stopped (every rank calls it); the exit code."""
    if args.micro_batch_tokens < 0:
        print("error: --micro-batch-tokens must be 0 (automatic) or a number of tokens", file=sys.stderr)
        return 2
    return_freed_memory(args.freed_memory)
    try:
        info = init_distributed(args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        placement = place(info, split=args.rollout_ranks > 0, rollout_ranks=max(args.rollout_ranks, 1))
    except ValueError as e:
        print(f"error: --rollout-ranks {args.rollout_ranks}: {e}", file=sys.stderr)
        close_distributed()
        return 2
    served = Served(_options(args), placement)
    try:
        if info.rank != 0:
            follow(served)
            return 0
        return _serve_http(args, served)
    finally:
        close_distributed()


def _serve_http(args: ServeArgs, served: Served) -> int:
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
    config = uvicorn.Config(create_app(api), log_config=None, access_log=False, lifespan="off", timeout_keep_alive=75)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rlcore-tinker-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    if not thread.is_alive():
        print("error: the HTTP server did not start", file=sys.stderr)
        return 1
    print(f"rlcore.tinker: serving the Tinker API at http://{args.host}:{port} "
          f"(TINKER_BASE_URL=http://{args.host}:{port}, any TINKER_API_KEY starting with tml-)", flush=True)  # fmt: skip
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        server.should_exit = True
        thread.join(10)
    finally:
        api.worker.stop()
    return 0
