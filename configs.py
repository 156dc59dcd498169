"""Typed, frozen configuration of an rlcore run, read by tyro in train.py.

    python train.py                                  # the embedded default: grpo on builtin:reverse
    python train.py dapo --rollout.n 16 --optim.lr 5e-4
    python train.py --help                           # the presets
    python train.py dapo --help                      # every flag, with the dapo preset's values

Each field's docstring is its `--help` text. Configs are frozen: derived values come from functions
of the config, never written back. A field left None whose default depends on the model (the learning
rates, --rollout.max-tokens, the dapo preset's overlong buffer) is filled once at start-up by
`rlcore.config.defaults.resolve`, into a new config: a built-in model keeps the values of its tasks, a
pretrained one gets values that fit it; the run prints each such value first and config.json records
them. This module is the schema and the presets only and imports nothing from rlcore: the checks run in
one pre-flight pass (`rlcore.config.preflight.validate(cfg, world_size)`, on the resolved config) before
any model is built, each next to what it checks, and raise `ConfigError` naming the flag, the value and
the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A user error in the configuration: one line naming the flag, the value and the fix."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = "builtin:tiny-reverse"
    """A Hugging Face model directory, a hub id, a GGUF file, or builtin:<name>: tiny, small (random init),
    tiny-reverse (warm-started on reverse: the default), tiny-calc (on calc, calls the calculator), tiny-moe
    (a mixture of experts), tiny-vl (a vision-language model, warm-started on shapes)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the trained model (FSDP2 keeps fp32 master weights with bf16 compute on GPU)."""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trainer's matmuls and attention in its forward passes (old/reference log-probs, values,
    updates) through torch.autocast; weights, gradients, the optimizer and the log-prob math keep
    --model.dtype; the rollout is not affected. Measured on a 2-core CPU (experiments/README.md, "bf16
    compute"): bfloat16 gave 1.16x faster updates on builtin:small (6 layers, 256 wide) and 0.70x (slower)
    on the 0.4M-parameter tiny-reverse, with the same reward curve."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (saves memory, costs time)."""
    selective_checkpointing: bool = False
    """Recompute each decoder layer's cheap work (norms, RoPE, the MLP's activation, softmax, views) in the
    backward pass, keeping its products' and attention's outputs: the same gradients bit for bit, half the
    saved activations (SmolLM2-135M: 4,764 against 9,568 values per token and layer), a forward and
    backward about 4% slower. --algo.max-tokens-per-micro-batch's default budget then holds 1.7x the
    tokens (SmolLM2 GRPO: steps 8% faster, the peak 5% higher); giving the tokens instead lowers the peak
    (8%). Refused with LoRA and for families not shown to support it. --model.activation-checkpointing
    wins when both are given. docs/memory.md."""
    lora_rank: int = 0
    """LoRA adapter rank (0: off, full fine-tuning). With LoRA only the adapters train (peft), the
    reference is the base model with the adapter disabled, checkpoints hold the adapter, and final/ is
    the merged model with final/adapter/ the peft adapter."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: the update is B A * alpha / rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch's input."""
    lora_targets: tuple[str, ...] = ()
    """Module names to adapt (e.g. q_proj v_proj), and on a mixture of experts its fused expert tensors
    (experts.gate_up_proj experts.down_proj: one adapter pair per expert); empty: every linear layer of
    attention and MLP, and the expert tensors."""
    freeze_vision: bool = False
    """A vision-language policy: keep its vision tower (patch embedding, blocks, merger) frozen, so only the
    language model trains (with LoRA the whole base is frozen anyway; LoRA adapts the language model only)."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_files: tuple[str, ...] = ("builtin:reverse",)
    """Parquet/jsonl files in verl's row format, or builtin:<task>: reverse, sort, add, countdown, calc
    (multi-turn: the calculator tool), shapes (images: a vision-language model)."""
    val_files: tuple[str, ...] | None = None
    """Validation files (same formats); empty turns validation off. None: follows the training data. Generated
    tasks (builtin:, reasoning_gym:) validate on their own held-out rows; files of yours turn validation off
    (said in one line at start), since only you know which of your rows are held out."""
    batch_size: int = 32
    """Prompts per step (each sampled rollout.n times)."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are dropped (counted: the start-up `data:` line and the
    data/*_dropped metrics) or rejected, per --data.overlong. 512 as verl's default."""
    overlong: Literal["drop", "error"] = "drop"
    """What to do with a prompt longer than --data.max-prompt-length."""
    answer_format: Literal["tag", "boxed", "raw", "last"] = "tag"
    """reasoning_gym: sources: how the answer is asked for and extracted, unless the source says answer=:
    tag (the last <answer>...</answer>, reasoning-gym's convention), boxed (the last \\boxed{}), raw
    (the whole response, stripped), last (the last number in the response: numeric tasks, small models)."""
    builtin_train_size: int = 5000
    """Rows generated for a builtin: training task."""
    builtin_val_size: int = 128
    """Rows generated for a builtin: validation task."""


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    engine: Literal["native", "vllm"] = "native"
    """Generation engine: the native KV-cache sampler (CPU and GPU) or vLLM colocated in-process."""
    n: int = 8
    """Samples per prompt (the group size of grpo/rloo/...)."""
    max_tokens: int | None = None
    """Most new tokens per response. None: the model kind's default (rlcore.config.defaults, printed at
    start): 12 for a built-in model, 512 for a pretrained one (a directory, a hub id, a GGUF file; verl's
    default response length, TRL's is 256)."""
    temperature: float = 1.0
    """Sampling temperature (the log-probs are taken under the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 keeps all tokens)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 keeps all)."""
    val_n: int = 4
    """Samples per validation prompt for pass@k (k = val_n); greedy validation is always run too."""
    gpu_memory_utilization: float = 0.5
    """vLLM only: share of GPU memory its KV cache may take."""
    sync_bucket_mb: float = 256.0
    """Weight sync: MiB of full weights gathered (and moved to the engine's device) at a time. Only
    memory: a push is always one update of the engine, whatever the bucketing."""
    max_turns: int = 1
    """Most model turns per sample. 1 (without --rollout.env / --rollout.tools): single-turn. > 1 alone:
    the multi-turn agent loop (rlcore.rollout.agent.loop) with the built-in tools (calculator, python). Tool
    results and observations are in the response but not trained on; max-tokens bounds the whole
    response, observations included."""
    env: str | None = None
    """A gymnasium-API text environment, path/to/file.py:ClassName (rlcore.rollout.agent.env): one instance per
    sample, reset with the row, stepped with each model turn; the score is the sum of its step rewards
    (plus the reward function's where the data_source has one, or with --reward.custom)."""
    env_timeout_s: float = 60.0
    """Deadline of one environment reset / step and of one tool call; past it the episode (env) ends with
    --reward.failure-score, counted in agent/env_timeouts (a tool: an error observation)."""
    tools: str | None = None
    """A Python file whose public functions are the tools (schemas from their signatures and docstrings),
    offered through the chat template and called in --rollout.tool-format (a template without a tool
    role, like the built-in models': the <tool>NAME: ARG</tool> format)."""
    tool_format: str = "hermes"
    """How the model writes tool calls: a key of rlcore.rollout.agent.chat.TOOL_CALL_FORMATS (hermes:
    <tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Qwen2.5/Qwen3 and Hermes)."""

    agent: str | None = None
    """An agent written against the openai client, path/to/file.py:function (`async def run(client, row)`,
    rlcore.gateway.agents): run n times per prompt against an OpenAI-compatible endpoint in front of the
    engine, its calls recorded token for token and trained on. It returns its reward (a number, a dict with
    `reward`), or None for the row's reward function."""
    agent_concurrency: int = 64
    """Most agent episodes running at once (their requests are batched into the engine together)."""
    agent_timeout_s: float = 300.0
    """Deadline of one agent episode; past it (or when it raises) the episode scores
    --reward.failure-score and counts in agent/failures."""

    @property
    def multi_turn(self) -> bool:
        """Whether the rollout is the agent loop."""
        return self.max_turns > 1 or self.env is not None or self.tools is not None

    exact: bool = False
    """Bitwise on-policy (rlcore.models.exact): the native engine's sampling log-probs and every trainer
    forward of a sequence are equal bit for bit, whatever the batch, padding, micro-batching or KV cache
    (rollout/logprob_diff_max is 0.0, checked every step). Any transformers causal LM with rotary
    positions: dense and mixture-of-experts models (with routes recorded or replayed), vision-language
    models, LoRA, FSDP2, split placement, fp32 or --model.dtype bfloat16; the Hugging Face decode step
    instead of the lean one. Before the model samples, a pre-flight check measures which row layout of
    its products keeps each row's bits on this CPU (rlcore.models.exact_check), or refuses in one line.
    Not with tp / sp / ep, vLLM, the agent loop, --rollout.compile or autocast. With it --algo.bypass
    drops the old-log-prob pass at no cost in exactness."""
    lora_merged_copy: bool = True
    """LoRA with the native engine in one process: sample from a plain copy of the base into which each push
    merges the adapters (one more copy of the weights, a faster rollout: docs/memory.md).
    --rollout.no-lora-merged-copy samples the trained module itself, adapters unmerged (the lean step adds
    the rank-r products): no copy, no push."""
    compile: bool = False
    """native only: torch.compile the lean decode step (Llama-family models; CPU inductor). The first
    rollout compiles for about a minute on 2 cores; the steps after are faster (experiments/README.md,
    bench_rollout). Off: the same step in eager mode."""


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    custom: str | None = None
    """A verl-style reward function as path/to/file.py:function (replaces the built-in dispatch)."""
    num_workers: int = 0
    """Reward processes (0 scores in the trainer's process, without timeouts)."""
    timeout_s: float = 10.0
    """Per-sample reward timeout (with --reward.num-workers > 0)."""
    failure_score: float = 0.0
    """Score given to a sample whose reward function raised or timed out."""
    max_error_rate: float = 0.5
    """Abort when a larger share of one step's samples failed to score."""
    overlong_buffer_length: int | None = 0
    """DAPO soft overlong penalty: buffer length in tokens before --rollout.max-tokens (0 = off). None
    (the dapo preset): the model kind's default, 4 tokens for a built-in model, 20% of --rollout.max-tokens
    for a pretrained one (DAPO's 4096 of 20480)."""
    overlong_penalty_factor: float = 1.0
    """DAPO soft overlong penalty: the largest penalty."""
    math_verifier: Literal["verl", "math-verify"] = "verl"
    """How the built-in table checks math answers. verl: verl's rules per data_source, so a verl
    recipe's curves are comparable — the MATH sets score the last \\boxed{} after string normalisation
    (1 / 0; an unboxed answer scores 0), math_dapo / math / aime* the last "Answer:" line after the
    Minerva normalisation (1 / -1), numina_* PRIME's answer after "answer:" / the last box / the last
    "=" by the PRM800K grader and numeric rules (1 / 0; unboxed counts). math-verify: every math
    data_source (not geometry3k, whose reward also scores the format) by symbolic equivalence of any
    final answer, boxed or not (1 / 0)."""
    judge: str | None = None
    """A generative judge (rlcore.rewards.judge): a language model (any --model.path form) that reads each
    prompt and response through --reward.judge-template and writes a verdict, which --reward.judge-parser
    turns into the score (an unreadable verdict scores --reward.failure-score and is counted). None: off."""
    judge_template: str | None = None
    """The judge's prompt, a text file with {prompt}, {response} and optionally {ground_truth} (None: the
    built-in reference-answer check, read by the score parser)."""
    judge_parser: str = "score"
    """How a verdict becomes a number: score (the last "score: N"), boxed (the last \\boxed{N}), yes_no
    (yes 1, no 0), or path/to/file.py:function (text -> float, None when it cannot read it)."""
    judge_sources: tuple[str, ...] = ()
    """The data sources the judge scores (empty: every one); the others keep their rule rewards."""
    judge_engine: Literal["native", "vllm"] = "native"
    """The judge's own engine, in the rollout ranks' processes: native, or vLLM (the judge's directory)."""
    judge_max_tokens: int = 32
    """The longest verdict in tokens."""
    judge_temperature: float = 0.0
    """The judge's sampling temperature (0: greedy; above 0 seeded by --trainer.seed and the requests)."""


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    objective: Literal["rl", "sft"] = "rl"
    """rl: rollouts, rewards, advantages, policy updates. sft: supervised steps on the rows' ground
    truths (teacher-forced; the sft preset), validated like rl."""
    adv_estimator: str = "grpo"
    """Advantage estimator: a key of rlcore.pure.advantages.ESTIMATORS (gae, grpo, rloo, opo, gpg,
    reinforce_pp, reinforce_pp_baseline, remax, grpo_passk, none (zeros: with --algo.teacher, its signal
    alone), or one a script added). Its parameters say what it reads: group_ids (n >= 2), values (a critic is trained), baseline_rewards (a greedy
    rollout); keyword parameters named like an --algo flag get that flag's value."""
    norm_by_std: bool = True
    """grpo: divide by the group's std (False is Dr.GRPO)."""
    gamma: float = 1.0
    """Discount (gae, reinforce_pp)."""
    lam: float = 1.0
    """GAE lambda."""
    policy_loss: str = "ppo_clip"
    """Policy loss: a key of rlcore.pure.losses.POLICY_LOSSES (ppo_clip (vanilla), gspo, cispo, gpg,
    sapo, geo_mean, clip_cov, kl_cov, or one a script added); flags bound by name as for estimators."""
    loss_agg: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become one number (normalised by global counts)."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (DAPO's clip-higher uses 0.28)."""
    clip_c: float = 3.0
    """Dual-clip bound for negative advantages."""
    kl_coef: float = 0.0
    """KL penalty in the reward (0 = off; needs a reference model)."""
    kl_kind: str = "k1"
    """Estimator of the KL in the reward: k1, abs, k2, k3, and verl's names for them, kl (k1), mse (k2),
    low_var_kl (k3); each also with a + suffix (k1+, low_var_kl+, ...: the value of the estimator, the
    gradient of k2)."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """KL-in-reward coefficient controller."""
    kl_target: float = 0.1
    """Adaptive controller: target KL."""
    kl_horizon: float = 10000.0
    """Adaptive controller: horizon."""
    use_kl_loss: bool = False
    """Add the KL to the reference as a loss term (GRPO style) instead of (or besides) the reward."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_kind: str = "k3"
    """Estimator of the KL loss: the values of --algo.kl-kind (k1, abs, k2, k3; verl's kl, mse, low_var_kl;
    each with a + suffix)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (subtracted from the loss)."""
    mini_batch_size: int | None = None
    """Prompts per optimizer update (None: the whole step's batch, one update per epoch)."""
    ppo_epochs: int = 1
    """Passes over the step's batch."""
    micro_batch_size: int = 64
    """Samples per forward/backward (gradient accumulation inside a mini-batch)."""
    max_tokens_per_micro_batch: int | None = None
    """Token-budget dynamic batching: pack samples up to this many tokens (overrides micro_batch_size). None:
    a pretrained model gets the tokens whose saved activations and logits fit 2 GiB on a CPU, 25% of the
    GPU's free memory on a GPU, at its compute dtype's bytes (printed at start); a built-in model keeps rows."""
    share_prompts: bool = True
    """Compute each prompt once for all its samples in the log-prob, value and update forwards (packed
    sequences with a 4D mask; same log-probs and gradients to rounding), where a FLOP estimate says
    it is cheaper. sdpa and eager attention only; other implementations run unpacked."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more until the batch is full."""
    max_sampling_rounds: int = 3
    """DAPO dynamic sampling: most generation rounds per step."""
    tis_cap: float | None = None
    """Truncated importance sampling (TIS) on and its cap: weight tokens by min(p_trainer / p_rollout, cap),
    computed inside the update (an on-policy step keeps skipping the old-log-prob pass). None: off. The
    same weights as --algo.rollout-is token with --algo.rollout-is-cap, which instead recomputes the old
    log-probs first and logs rollout_corr/*; use one of the two."""
    rollout_is: Literal["token", "sequence", "geometric"] | None = None
    """Decoupled PPO: the ratio is against the recomputed old policy and each token's loss is weighted
    by the truncated importance weight old/rollout at this level (token; sequence: the product over
    the response; geometric: its geometric mean). None: off. Metrics rollout_corr/is_*."""
    rollout_is_cap: float = 2.0
    """Upper truncation of the --algo.rollout-is weights (no effect without --algo.rollout-is; the cap of
    --algo.tis-cap is its own value)."""
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    """Rejection: drop from the loss (and the advantages) the units whose old/rollout ratio leaves
    [--algo.rollout-rs-lower, --algo.rollout-rs-upper]; token level is IcePop's mask. None: off."""
    rollout_rs_upper: float = 2.0
    """Upper ratio bound of the rejection."""
    rollout_rs_lower: float | None = None
    """Lower ratio bound of the rejection (None: 1 / upper)."""
    rollout_veto: float | None = None
    """Drop every response holding a token whose old/rollout ratio is below this (None: off)."""
    router_replay: Literal["off", "record", "replay"] = "off"
    """Mixture-of-experts routing (rlcore.models.moe): record: the rollout records each token's experts
    and the update logs rollout/router_agreement with the trainer's own choice; replay (R3): every
    trainer forward (old log-probs, reference, update) routes each token to the recorded experts, gate
    weights from its own router over them. Native engine, single-turn rollouts."""
    router_aux_coef: float = 0.0
    """A mixture of experts' load-balancing loss (the Switch loss its model defines) added to the
    policy loss with this coefficient (0: only logged, router/aux_loss)."""
    bypass: bool = False
    """Use the rollout engine's log-probs as the old policy (no recompute pass): PPO's ratio then also
    corrects the rollout/trainer gap (verl's bypass mode)."""
    teacher: str | None = None
    """On-policy distillation: a frozen teacher (any --model.path form: builtin:<name>, a directory, a
    hub id, a GGUF file) scores every sampled token, and coef * (its log-prob - the policy's) joins each
    token's advantage (rlcore.pure.distill). It must share the policy's tokenizer. None: off."""
    teacher_coef: float = 1.0
    """The teacher term's weight in the advantages (the task's keep weight 1; `--algo.adv-estimator none`
    leaves the teacher's alone)."""
    teacher_clip: float | None = None
    """Clip each token's teacher term to [-clip, clip] nats (None: unclipped)."""


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float | None = None
    """Peak learning rate (AdamW). None: the model kind's default (rlcore.config.defaults, printed at
    start). A built-in model: 1e-3, or 5e-3 with --model.lora-rank (on the default task at rank 16, alpha
    32: 1e-2 peaked at val 0.90 and fell to 0.81, 5e-3 reached 0.998, 3e-3 0.987; experiments/README.md,
    "bench_lora: LoRA vs full fine-tuning"). A pretrained model (a directory, a hub id, a GGUF file): 1e-6
    (verl's and TRL's default), or 1e-5 with LoRA (LoRA's best learning rate is ~10x full fine-tuning's:
    Schulman et al. 2025, "LoRA Without Regret")."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon (added to the root of the second moment)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer updates."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """Cosine schedule floor, as a fraction of --optim.lr."""


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    path: str | None = None
    """Critic backbone (None: initialised from --model.path)."""
    lr: float | None = None
    """Critic learning rate. None: the model kind's default (rlcore.config.defaults): 1e-3 for a built-in
    model, 1e-5 for a pretrained one (verl's critic default)."""
    lr_warmup_steps: int = 0
    """Linear warm-up of the critic's learning rate over this many optimizer updates (as --optim.warmup-steps
    does for the actor's); it does not hold the actor back (that is --critic.critic-warmup). Formerly
    --critic.warmup-steps."""
    value_clip: float = 0.5
    """Clip of the value update around the rollout-time values."""
    grad_clip: float = 1.0
    """Clip the critic's gradient norm to this (0 = off)."""
    critic_warmup: int = 0
    """verl's critic_warmup: the first this many training steps update only the critic (the actor waits,
    so its advantages start from a fitted value function). Not --critic.lr-warmup-steps, which ramps the
    critic's learning rate."""
    lora_rank: int = 0
    """LoRA rank of the critic's backbone (0: off; alpha, dropout and targets as --model.lora-*): only the
    adapters and the value head train."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    steps: int = 30
    """Training steps (one rollout batch each)."""
    val_every: int = 10
    """Validate every this many steps (0 = off; also before the first step and at the end)."""
    save_every: int = 0
    """Checkpoint every this many steps (0 = off)."""
    keep_last: int = 2
    """Checkpoints kept (older ones are pruned)."""
    seed: int = 0
    """Seed of the model init, data order and sampling."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train (auto: cuda when available)."""
    max_bad_updates: int = 3
    """Abort after this many consecutive updates with a non-finite loss or gradient."""
    hang_timeout_s: float = 1800.0
    """The watchdog: when no phase of a step starts or ends for this long (a stuck collective, a phase
    that never returns), every rank prints its step, phase and stack and the run exits (code 4) with one
    line naming the rank that stalled; 0 turns it off."""
    rendezvous_timeout_s: float = 300.0
    """Under torchrun: how long the ranks of a world (the first, or one torchrun restarted after a lost
    rank) may take to all meet before each rank that came exits (code 5) with one line naming itself,
    the store's address and the likely cause, instead of waiting forever."""
    profile_steps: str = ""
    """A:B writes a torch.profiler Chrome trace of steps A to B per rank to out_dir/profile/ ("": off)."""
    freed_memory: Literal["keep", "trim", "unmap"] = "keep"
    """How memory the trainer frees goes back to the kernel (glibc). keep: glibc's default, the heap keeps
    freed blocks for reuse (the fastest; on SmolLM2-135M GRPO 2.9 GiB resident between phases). trim: each
    phase's end gives the free pages back (2.1 GiB between phases, 8-17% slower steps: the next phase
    faults them in again). unmap: blocks of 1 MiB or more are unmapped as soon as they are freed (the
    lowest peak, 7% below keep's, 16-24% slower steps). docs/memory.md."""
    memory_check: bool = True
    """Refuse, before any weights load, a CPU run whose estimated peak memory (the model's config, dtype,
    LoRA, checkpointing, micro-batch and rollout batch) exceeds what the process can have, in one line
    naming the flags that would fit; --trainer.no-memory-check runs anyway."""
    preempt_grace_s: float = 300.0
    """SIGTERM / SIGUSR1 (a scheduler's notice before the kill): the step in progress finishes, its
    checkpoint is written and the run exits 143 (resume with --resume auto); a step still running this
    many seconds after the signal is abandoned (exit 143 at once, the newest checkpoint intact).
    Colocated placement; under split placement the roles stop at once."""
    tp: int = 1
    """Tensor parallelism (torchrun, colocate): each decoder layer's attention heads and MLP columns split
    over this many neighbouring ranks (Llama family: llama, mistral, qwen2, qwen3), composed with FSDP2
    over the rest; the world is the mesh (dp_shard, sp, tp) and the tp x sp ranks of one dp_shard
    coordinate train one batch. An untied lm_head is split by vocabulary (vocab-parallel log-probs:
    no rank holds the full logits); embeddings and a tied lm_head stay whole. The engines sample from
    an unsharded copy (vLLM: full weights, as without tp)."""
    sp: int = 1
    """Ulysses sequence parallelism (torchrun, colocate): the log-prob, value and update forwards split
    each sequence's tokens over this many ranks, with an all-to-all around attention so that each rank
    attends over every token for heads / sp of the heads; the log-probs are gathered, so the loss and its
    global normalisers are unchanged. Token-budget micro-batches count whole sequences (each sp rank
    holds 1/sp of the tokens); shared-prompt packing is off under sp (its 4D mask spans a packed row)."""
    ep: int = 1
    """Expert parallelism (torchrun, a mixture of experts, with FSDP2): every MoE layer's experts split
    over groups of this many neighbouring ranks, each rank holding 1/ep of them; each rank routes its own
    tokens and an all-to-all carries them to the ranks holding their experts and back. The ep ranks stay
    data-parallel ranks (FSDP2 shards the rest of the model over all of them; with more than one group
    the expert shards are replicated across groups and their gradients summed). The engines sample from
    an unsharded copy. Not with tp / sp."""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    max_staleness: int = 0
    """K: the batch of step t is generated with policy version max(0, t - 1 - K) exactly (lag mode),
    so rollouts run up to K updates ahead of training; 0 is the synchronous algorithm. Each token
    carries its version (rollout_versions); the old log-probs are recomputed (K > 0 is off-policy:
    see --algo.rollout-is / --algo.rollout-rs for corrections)."""
    mode: Literal["lag", "stream"] = "lag"
    """lag: the batch of step t is generated with version max(0, t - 1 - K) exactly: deterministic for a
    seed and resumed exactly (the batches generated ahead are checkpointed). stream (split placement):
    each batch is generated with the newest weights that have reached the rollout rank (never more
    than K versions behind; rollout ranks wait only when K binds): fresher samples, but which version
    a batch gets depends on timing, so runs are not reproducible and a resumed run is not the
    uninterrupted one."""
    partial_rollout: bool = False
    """Stream mode: a push that arrives while a batch is being generated goes into the engine between decode
    steps, and the samples in flight continue with the new weights (rlcore.step.partial). The KV cache
    so far is not kept: the native engine prefills the prompt and the tokens so far again, vLLM recomputes
    them (its recompute preemption), so each token's log-prob is its own version's. Each token's
    `rollout_versions` names the weights that sampled it, and the staleness metrics count the oldest.
    Either engine, single- or multi-turn, with dynamic sampling and ReMax."""
    placement: Literal["colocate", "split"] = "colocate"
    """colocate: every rank generates, then every rank trains. split (torchrun): ranks [0, N) generate
    and score (--pipeline.rollout-ranks N), ranks [N, W) train (FSDP2 over them, reference and critic
    with them); with --pipeline.max-staleness K >= 1 both run at once. Validation and checkpoints are
    points where the roles wait for each other."""
    rollout_ranks: int = 1
    """N: how many ranks generate under split placement (the rest train)."""
    rollout_threads: int = 0
    """Split placement: torch CPU threads of each rollout rank (0: torch's default, OMP_NUM_THREADS).
    On CPU, decoding is overhead-bound (one thread is about as fast as two) while the update scales."""
    trainer_threads: int = 0
    """Split placement: torch CPU threads of each trainer rank (0: torch's default, OMP_NUM_THREADS)."""
    push: Literal["full", "delta"] = "full"
    """Split placement's weight push after every step. full: every tensor whole. delta (lag mode): per
    tensor the XOR of its bytes against the rollout ranks' copy, compressed, with a checksum of every
    tensor (one that disagrees anywhere sends everything whole). Costs a CPU copy of the pushed weights on
    the trainer leader and on each rollout rank, and encoding time; pays when the push's bytes dominate
    the pause between steps (many GB over a slow link) and few bits change per step (bf16 weights at
    small learning rates; fp32 weights change in nearly every element and compress less)."""


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    wandb: Literal["off", "offline", "online"] = "off"
    """Weights & Biases logging."""
    project: str = "rlcore"
    """W&B project."""
    progress: bool = True
    """Print a live progress line."""
    samples: int = 4
    """Each step's first K samples, decoded, to samples.jsonl (validation: val_samples.jsonl); 0: off."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """An rlcore run. Every field is a flag: --rollout.n 8, --algo.adv-estimator rloo, ..."""

    preset: str = "grpo"
    """The algorithm preset this config came from (informational)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    log: LogConfig = field(default_factory=LogConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    out_dir: str | None = None
    """Where the run writes (default runs/<preset>-<timestamp>)."""
    resume: str = "auto"
    """auto (newest complete checkpoint in --out-dir, if any), none, or a checkpoint directory."""


def _algo(**kw) -> Config:
    name = kw.pop("preset")
    return Config(preset=name, algo=AlgoConfig(**kw))


PRESETS: dict[str, tuple[str, Config]] = {
    "grpo": ("GRPO: group-normalised advantages, PPO clip (Shao et al. 2024)", _algo(preset="grpo")),
    "dapo": (
        "DAPO: clip-higher, token-mean, dynamic sampling, soft overlong penalty (Yu et al. 2025)",
        dataclasses.replace(
            _algo(preset="dapo", clip_high=0.28, dynamic_sampling=True),
            reward=RewardConfig(overlong_buffer_length=None),  # the model kind's (rlcore.config.defaults)
        ),
    ),
    "drgrpo": (
        "Dr.GRPO: no std normalisation, seq-mean-token-sum-norm (Liu et al. 2025)",
        _algo(preset="drgrpo", norm_by_std=False, loss_agg="seq-mean-token-sum-norm"),
    ),
    "gspo": (
        "GSPO: sequence-level ratios (Zheng et al. 2025)",
        _algo(preset="gspo", policy_loss="gspo", loss_agg="seq-mean-token-mean"),
    ),
    "rloo": (
        "RLOO: leave-one-out baseline (Ahmadian et al. 2024)",
        _algo(preset="rloo", adv_estimator="rloo"),
    ),
    "reinforce-pp": (
        "REINFORCE++ with a group baseline (Hu 2025)",
        _algo(preset="reinforce-pp", adv_estimator="reinforce_pp_baseline"),
    ),
    "remax": (
        "ReMax: greedy-rollout baseline (Li et al. 2023)",
        _algo(preset="remax", adv_estimator="remax"),
    ),
    "ppo": (
        "PPO with a critic and GAE (Schulman et al. 2017)",
        _algo(preset="ppo", adv_estimator="gae", lam=0.95),
    ),
    "distill": (
        "On-policy distillation: per-token reverse KL to --algo.teacher as the advantage (Agarwal et al. 2024; "
        "Thinking Machines 2025)",
        _algo(preset="distill", adv_estimator="none", teacher_coef=1.0),
    ),
    "sft": (
        "Supervised fine-tuning on prompt/response rows (warm starts): the gpg loss with unit advantages",
        _algo(preset="sft", objective="sft", policy_loss="gpg"),
    ),
}
