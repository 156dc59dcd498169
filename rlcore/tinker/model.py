"""One model trained through the Tinker API: the module (built as `train.py` builds its policy: LoRA or
full, sharded under torchrun), its AdamW, its rollout engine, and its weight versions.

Every rank of the world runs the same training operations in the same order (`rlcore.tinker.ops`):
`forward_backward` splits the datums over the ranks (each rank a consecutive share, so groups stay whole), each rank
runs the same number of micro-batches (a rank short of datums runs a zero-weighted one, since an FSDP
forward is a collective), FSDP sums the gradients, and the per-datum log-probs and the loss sum are
gathered on rank 0. Gradients accumulate over calls until `optim_step`, as in Tinker.

The engine samples from its own copy of the weights (pushed by `save_weights_for_sampler`), so training
can go on while a sampler of the saved version is used; `version` counts the optimizer steps applied
and `engine_version` is the version the engine holds.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlcore.data.prompts import pad_token_id
from rlcore.dist.checkpoint import load_checkpoint, save_checkpoint
from rlcore.models.specs import EngineSpec, ModelSpec, SpecError
from rlcore.step.update import build_optimizer, grad_norm
from rlcore.tinker.errors import UserError
from rlcore.tinker.limits import Deadline, Limits, check_rank
from rlcore.tinker.losses import check_inputs, loss_of
from rlcore.tinker.names import check_base_model, checked, under
from rlcore.tinker.rows import datum_rows, packed_inputs, right_aligned, row_inputs, row_logprobs, sequence_of
from rlcore.tinker.wire import Datum

LOGITS_BYTES = 2**30
"""The automatic micro-batch: at most this many bytes of fp32 logits (tokens x vocabulary x 4): 1 GiB is ~5K
tokens of SmolLM2's 49K vocabulary, ~1.8K of Qwen2.5's 152K, the whole batch of a built-in model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """What the server builds every model with (its command-line flags)."""

    workdir: Path
    """Saved states, sampler weights and tokenizer directories."""
    full_finetune: bool = False
    """Train every parameter whatever LoRA rank a client asks for (rank 0 asks for it per model)."""
    dtype: str = "float32"
    """Parameter dtype."""
    seed: int = 0
    """Seed of random initialisation (built-in models, LoRA adapters) and of unseeded sampling."""
    micro_batch_tokens: int = 0
    """Tokens (datum lengths summed) per forward/backward pass on a rank; 0: as many as keep the micro-batch's
    fp32 logits within LOGITS_BYTES (a small vocabulary: the whole share in one pass). A datum longer than
    the budget runs alone."""
    lora_alpha: float = 32.0
    """LoRA scale numerator (the update is B A alpha / rank), as --model.lora-alpha."""
    limits: Limits = dataclasses.field(default_factory=Limits)
    """What one client may ask of the server (`rlcore.tinker.limits`)."""


def model_specs(base_model: str, lora_rank: int, options: ServeOptions) -> tuple[ModelSpec, EngineSpec]:
    """What a model of the server and its engine are built from (as train.py builds its policy and native engine):
    the base, LoRA of `lora_rank` (none with `full_finetune`), the server's dtype, alpha and seed."""
    rank = 0 if options.full_finetune else lora_rank
    model = ModelSpec(path=base_model, dtype=options.dtype, seed=options.seed, lora_rank=rank,
                      lora_alpha=options.lora_alpha)  # fmt: skip
    return model, EngineSpec(kind="native", seed=options.seed)


class TrainedModel:
    """One trained model and its engine (module docstring)."""

    def __init__(self, model_id: str, base_model: str, lora_rank: int, options: ServeOptions, placement: Any) -> None:
        from rlcore.models.build import build_policy, load_tokenizer_of
        from rlcore.models.fields import takes_images
        from rlcore.models.policy import context_length

        check_rank(lora_rank, options.limits)
        check_base_model(base_model, options.limits.model_roots)
        self.model_id, self.base_model, self.options, self.placement = model_id, base_model, options, placement
        self.spec, self.engine_spec = model_specs(base_model, lora_rank, options)
        self.lora_rank = self.spec.lora_rank
        try:
            self.tokenizer = load_tokenizer_of(self.spec)
            self.model = build_policy(self.spec, placement) if placement.trains else None
            self.engine, self.relay = self._engine() if placement.generates else (None, None)
        except SpecError as e:
            raise UserError(f"base_model {base_model!r}: {e}") from None
        module = self.model if self.model is not None else self.engine.module
        if takes_images(module):
            raise UserError(f"base_model {base_model!r} is a vision-language model; this server trains text models")
        self.optimizer = build_optimizer(self.model, lr=0.0, betas=(0.9, 0.95), eps=1e-12) if self.model else None
        self.pad_id = pad_token_id(self.tokenizer)
        self.vocab = int(module.get_input_embeddings().num_embeddings)
        self.arch = type(module).__name__
        self.context = context_length(module, self.tokenizer)
        self.version = 0
        self.engine_version: int | None = None

    def _engine(self) -> tuple[Any, Any]:
        """(the engine over its own copy of the weights, and on a rollout rank of a LoRA policy the copy's
        relay for pushed adapters); a LoRA or sharded policy's engine has its own copy already."""
        from rlcore.dist.fsdp import model_mesh
        from rlcore.models.build import build_engine_copy
        from rlcore.rollout.build import build_engine
        from rlcore.step.weights import AdapterRelay

        local = self.placement.local
        if self.placement.role == "rollout":  # split: the copy the pushes land in
            copy = build_engine_copy(self.spec, local)
            relay = AdapterRelay(copy, bucket_bytes=self._bucket()) if self.lora_rank > 0 else None
            return build_engine(self.spec, self.engine_spec, copy, self.tokenizer, local), relay
        shares = self.lora_rank > 0 or model_mesh(self.model) is not None
        source = self.model if shares else build_engine_copy(self.spec, local)
        return build_engine(self.spec, self.engine_spec, source, self.tokenizer, local), None

    def _bucket(self) -> int:
        return self.engine_spec.bucket_bytes

    @property
    def device(self) -> torch.device:
        return self.placement.local.device

    # ------------------------------------------------------------------------------------ training

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, config: Mapping[str, float], *, forward_only: bool,
        deadline: Deadline,
    ) -> tuple[list[Tensor], dict[str, float]]:
        """(each datum's log-probs of its targets (N,), {"loss:sum": ...}) on rank 0 (other ranks: an empty
        list); the gradient of the loss sum is added to the parameters' unless `forward_only`. Past `deadline`
        it stops between micro-batches (`_stop`)."""
        loss, cfg = loss_of(loss_fn, config)
        for i, d in enumerate(data):
            check_inputs(loss_fn, loss, d.inputs, len(d.tokens), f"datum {i}")
            self._check_ids(d, i)
        world, rank = self.placement.local.world_size, self.placement.local.rank
        plans = micro_batches([len(d.tokens) for d in data], world, self._budget())
        logprobs: dict[int, Tensor] = {}
        total = torch.zeros((), dtype=torch.float64)
        steps = max(len(p) for p in plans)
        for k in range(steps):  # every rank runs as many (FSDP's forward is a collective)
            if k and self._expired(deadline):
                self._stop(deadline, k, steps, forward_only)
            idx = plans[rank][k] if k < len(plans[rank]) else []
            value, rows = self._micro(data, idx or [0], loss, cfg, forward_only, counts=bool(idx))
            if idx:
                total += value
                logprobs.update(zip(idx, rows, strict=True))
        return self._gathered(logprobs, total, len(data))

    def _micro(self, data: Sequence[Datum], idx: list[int], loss: Any, cfg: Mapping[str, float],
               forward_only: bool, *, counts: bool) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
        """One micro-batch: (its loss sum, its rows' log-probs). One that does not count (a rank short of
        datums runs datum 0 so its collectives meet the other ranks') adds nothing to the gradient."""
        picked = [data[i] for i in idx]
        inputs, mask = self._inputs(picked)
        lengths = [len(d.tokens) for d in picked]
        with torch.set_grad_enabled(not forward_only):
            lp = row_logprobs(self.model, inputs)  # (m, r)
            named = {k: _left_padded([d.inputs[k] for d in picked], mask.shape[1], self.device)
                     for k in picked[0].inputs if k != "target_tokens"}  # fmt: skip
            value = loss.fn(lp, named, cfg, mask)
            if not forward_only:
                (value if counts else value * 0.0).backward()
        return value.detach().double().cpu(), [r.detach().cpu() for r in right_aligned(lp.detach(), lengths)]

    def _expired(self, deadline: Deadline) -> bool:
        """Whether `deadline` passed, as every trainer rank sees it (the most expired rank decides for all, so
        no rank leaves a collective the others enter)."""
        passed = deadline.passed()
        if self.placement.local.world_size == 1:
            return passed
        flag = torch.tensor([1.0 if passed else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.placement.trainers)
        return bool(flag.item() > 0)

    def _stop(self, deadline: Deadline, k: int, steps: int, forward_only: bool) -> None:
        """Give up a forward_backward past its deadline: a half-accumulated gradient is cleared (with whatever
        earlier calls accumulated since the last optim_step), so no partial batch is ever applied."""
        if forward_only:
            raise UserError(deadline.message("forward", f"after {k} of {steps} micro-batches"))
        self.optimizer.zero_grad(set_to_none=True)
        raise UserError(deadline.message("forward_backward", f"after {k} of {steps} micro-batches; the gradients "
                                         "accumulated since the last optim_step were cleared (send them again)"))  # fmt: skip

    def _budget(self) -> int:
        if self.options.micro_batch_tokens > 0:
            return self.options.micro_batch_tokens
        return max(1, LOGITS_BYTES // (4 * self.vocab))

    def _inputs(self, picked: Sequence[Datum]) -> tuple[Any, Tensor]:
        """A micro-batch's model inputs and mask: prompt-packed where its datums share prompts and packing pays
        (`rlcore.tinker.rows`), else rows."""
        seqs = [sequence_of(d.tokens, d.inputs["target_tokens"].long()) for d in picked]
        if all(s is not None for s in seqs):
            packed = packed_inputs(self.model, seqs, self.pad_id, self.device)
            if packed is not None:
                return packed
        return row_inputs([datum_rows(d.tokens, d.inputs["target_tokens"].long()) for d in picked], self.pad_id,
                          self.device)  # fmt: skip

    def _check_ids(self, d: Datum, i: int) -> None:
        ids = torch.cat([d.tokens, d.inputs["target_tokens"].long()])
        if len(d.tokens) == 0:
            raise UserError(f"datum {i}: an empty model input")
        if len(d.tokens) > self.context:
            raise UserError(f"datum {i}: {len(d.tokens)} tokens do not fit the context of {self.base_model} "
                            f"({self.context} tokens); send a shorter datum")  # fmt: skip
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab:
            raise UserError(f"datum {i}: token ids must lie in [0, {self.vocab}) for {self.base_model} "
                            f"(got {int(ids.min())}..{int(ids.max())})")  # fmt: skip

    def _gathered(self, logprobs: dict[int, Tensor], total: Tensor, n: int) -> tuple[list[Tensor], dict[str, float]]:
        if self.placement.local.world_size == 1:
            return [logprobs[i] for i in range(n)], {"loss:sum": float(total)}
        parts: list[Any] = [None] * self.placement.local.world_size
        dist.all_gather_object(parts, (logprobs, float(total)), group=self.placement.trainers)  # None: the world
        merged = {i: t for part, _ in parts for i, t in part.items()}
        loss_sum = math.fsum(v for _, v in parts)
        rows = [merged[i] for i in range(n)] if self.placement.local.rank == 0 else []
        return rows, {"loss:sum": loss_sum}

    def optim_step(self, adam: Mapping[str, float]) -> dict[str, float]:
        """One AdamW step with the SDK's parameters, the gradients clipped to `grad_clip_norm` (0: off)
        first; a non-finite gradient norm skips the step (counted in `skipped`). Gradients are cleared."""
        for group in self.optimizer.param_groups:
            group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                         weight_decay=adam["weight_decay"])  # fmt: skip
        norm = grad_norm(self.model, adam["grad_clip_norm"])
        ok = bool(torch.isfinite(norm))
        if ok:
            self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "skipped": 0.0 if ok else 1.0}

    # ------------------------------------------------------------------------------------ states

    def state_dir(self, kind: str, name: str) -> Path:
        return under(self.options.workdir, checked(self.model_id, "model id"), kind, checked(name, "checkpoint name"))

    def save(self, kind: str, name: str) -> str:
        """Save the trained weights, AdamW's state and the engine's sampling stream under `kind`/`name`
        (every rank calls it; under split placement the trainer ranks write the model, rank 0 the stream);
        the tinker:// path that names it."""
        extra = {"base_model": self.base_model, "lora_rank": self.lora_rank, "version": self.version}
        tensors = {"engine_generator": self.engine.generator.get_state()} if self.engine is not None else None
        save_checkpoint(self.state_dir(kind, name), 0, self.model, self.optimizer, extra=extra, tensors=tensors,
                        dcp_group=self.placement.trainers)  # fmt: skip
        return f"tinker://{self.model_id}/{kind}/{name}"

    def load(self, directory: Path, *, optimizer: bool) -> None:
        """Load a state saved by `save` (every rank calls it); without `optimizer`, AdamW starts afresh."""
        extra = state_extra(directory)
        if (extra["base_model"], extra["lora_rank"]) != (self.base_model, self.lora_rank):
            raise UserError(f"the state {directory.parent.name} is of {extra['base_model']} (LoRA rank "
                            f"{extra['lora_rank']}), this model is {self.base_model} (rank {self.lora_rank})")  # fmt: skip
        _, tensors = load_checkpoint(directory / "step_0", self.model, self.optimizer, dcp_group=self.placement.trainers)
        if not optimizer and self.optimizer is not None:
            self.optimizer.state.clear()
        if "engine_generator" in tensors and self.engine is not None:
            self.engine.generator.set_state(tensors["engine_generator"])
        self.version = int(extra["version"])
        self.engine_version = None

    def push(self) -> int:
        """Copy the trained weights into the engine (every rank calls it; split: from the trainer ranks to
        the rollout ranks, `rlcore.tinker.split`); the version it now holds."""
        from rlcore.tinker import split

        changed = self.engine_version != self.version
        if self.placement.role == "rollout":
            self.version = self.engine_version = split.receive_push(self.engine, self.relay, self.placement)
            return self.version
        if self.placement.role == "trainer":
            split.push_to_rollouts(self.model, self.placement, version=self.version, changed=changed,
                                   bucket_bytes=self._bucket())  # fmt: skip
        elif changed:
            from rlcore.step.weights import push_weights

            push_weights(self.model, self.engine, bucket_bytes=self._bucket())
        self.engine_version = self.version
        return self.version

    def write_tokenizer(self) -> str:
        """A directory `AutoTokenizer.from_pretrained` loads offline (the SDK's `get_tokenizer`), written once."""
        directory = under(self.options.workdir, "tokenizers", _dir_name(self.base_model))
        if not (directory / "tokenizer_config.json").is_file():
            self.tokenizer.save_pretrained(directory)
        return str(directory.resolve())


def micro_batches(lengths: Sequence[int], world: int, budget: int) -> list[list[list[int]]]:
    """Each rank's micro-batches of datum indices: rank r takes the r-th consecutive share (so a prompt's
    samples stay together), cut into runs of consecutive datums whose lengths sum to at most `budget` (a
    longer datum alone). Every rank computes every rank's plan alike, from the lengths alone."""
    per_rank = math.ceil(len(lengths) / world)
    plans = []
    for r in range(world):
        runs: list[list[int]] = []
        used = 0
        for i in range(r * per_rank, min(len(lengths), (r + 1) * per_rank)):
            if not runs or used + lengths[i] > budget:
                runs.append([])
                used = 0
            runs[-1].append(i)
            used += lengths[i]
        plans.append(runs)
    return plans


def _dir_name(base_model: str) -> str:
    """A base model's tokenizer directory name: one path part, never `.` or `..`."""
    return re.sub(r"^\.", "_", re.sub(r"[^A-Za-z0-9._-]", "_", base_model)[-128:])


def state_extra(directory: Path) -> dict[str, Any]:
    """The model facts saved with a state (base model, LoRA rank, version), or a UserError."""
    import json

    extra = directory / "step_0" / "extra.json"
    if not extra.is_file():
        raise UserError(f"no saved state at {directory.name!r} (save_state writes one; a server keeps them under "
                        "its --workdir)")  # fmt: skip
    return json.loads(extra.read_text())


def _left_padded(values: Sequence[Tensor], width: int, device: torch.device) -> Tensor:
    """(m, width) float32: each row's values right-aligned, 0 before them."""
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for i, v in enumerate(values):
        if len(v):
            out[i, width - len(v) :] = v.float()
    return out.to(device)
