"""The training run as a short story: build → loop → close. Used by train.py.

    cfg = defaults.resolve(cfg)                                    # the model kind's defaults, once
    state, handles, algorithm, plan = build(cfg)
    state = checkpoints.resume(state, handles, cfg.resume)         # --resume auto|none|PATH
    state, metrics = train_step(state, handles, algorithm, plan)  # one step, a new TrainState

`TrainState` (rlcore.state) is everything a step changes; `Handles` are what a step uses but does not
change (the engine, the reward scorer, the datasets, the logger, the mesh, the frozen reference);
`Algorithm` (rlcore.algorithm) is the run's pure callables and `StepPlan` (rlcore.plan) the numbers
around them, both bound once from the config (`rlcore.trainer.algorithm.bind`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from configs import Config
from rlcore.algorithm import Algorithm
from rlcore.config import defaults
from rlcore.dist import memory
from rlcore.dist.mesh import close_distributed, group_rank, group_size, leave_in_order
from rlcore.dist.peers import EXIT_PEER_LOST, lost_peer
from rlcore.dist.rendezvous import WorldNotFormed
from rlcore.models.build import save_final
from rlcore.plan import StepPlan
from rlcore.rewards.pool import RewardError
from rlcore.state import TrainState
from rlcore.step import split
from rlcore.step.collect import step_seed
from rlcore.step.handles import Handles
from rlcore.step.learn import TrainingDiverged, check_bad_updates
from rlcore.step.phases import (
    StepProfiler,
    Watchdog,
    at_step,
    phase,
    profile_steps,
    watching,
)
from rlcore.step.train_step import train_step
from rlcore.step.transport import Colocated
from rlcore.step.weights import engine_holds
from rlcore.trainer import checkpoints, signals
from rlcore.trainer.build import USER_ERRORS, build
from rlcore.trainer.errors import StopRun, reason
from rlcore.trainer.health import ExactnessLost, check_exact, check_health
from rlcore.trainer.logger import read_metrics
from rlcore.trainer.plots import plot_curves

__all__ = ["Handles", "TrainingDiverged", "build", "run", "step_seed", "train_step"]


def run(cfg: Config) -> int:
    """Train to the end; user errors print one line and return 2, a diverged run 3. The fields `cfg` leaves
    to the model's kind are resolved here, once (`rlcore.config.defaults`): the run uses the new config."""
    memory.return_freed_memory(cfg.trainer.freed_memory)  # freed tensors go back to the kernel
    defaulted = defaults.defaulted(cfg)
    cfg = defaults.resolve(cfg, defaulted)
    started = _start(cfg, defaulted)
    if isinstance(started, int):
        return started
    state, h, algorithm, plan = started
    checkpoint_dir = h.out_dir / "checkpoints"
    preemption = signals.Preemption(grace_s=cfg.trainer.preempt_grace_s, at_once=h.placement.split,
                                    newest=lambda: checkpoints.newest(checkpoint_dir))  # fmt: skip
    control = Control(cfg=cfg, preemption=preemption)
    finished = False
    try:
        with preemption.handling():
            state = loop(state, h, algorithm, plan, control)
        h.hooks.dump(
            state,
            rank=h.dist.rank,
            data=lambda: h.train_ds.cursor_state(state.cursor),
            holds=lambda: engine_holds(state.actor.model, h.engine),
        )  # test-only (RLCORE_TEST_DUMP_STATE)
        finished = True
    except (StopRun, RewardError, TrainingDiverged, ExactnessLost, signals.Preempted, signals.Terminated,
            RuntimeError, KeyboardInterrupt) as e:  # fmt: skip
        code = _stopped(e, h, control.step, checkpoint_dir)
        if code is None:
            raise
        return code
    finally:
        _close(h, finished=finished)
    return 0


def _start(cfg: Config, defaulted: dict) -> tuple[TrainState, Handles, Algorithm, StepPlan] | int:
    """The built run, or the exit code of a start that failed (its one line printed)."""
    try:
        return build(cfg, defaulted)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        close_distributed()
        return 2
    except WorldNotFormed as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_PEER_LOST
    except KeyboardInterrupt:
        print("interrupted while starting; nothing was trained", file=sys.stderr)
        close_distributed()
        return signals.EXIT_INTERRUPTED


def _stopped(e: BaseException, h: Handles, step: int, checkpoint_dir: Path) -> int | None:
    """The exit code of a run the loop stopped with `e` at `step` (its line printed); None: not ours."""
    if isinstance(e, (StopRun, RewardError)):  # the user's to fix (disk, a checkpoint, a reward function)
        where = f"step {step}: " if isinstance(e, RewardError) else ""  # (stopped before the update)
        print(f"error: {where}{e}", file=sys.stderr, flush=True)
        return 2
    if isinstance(e, (TrainingDiverged, ExactnessLost)):
        print(f"error: {e}", file=sys.stderr)
        return 3
    if isinstance(e, signals.Preempted):
        print(str(e), file=sys.stderr, flush=True)
        return signals.EXIT_PREEMPTED
    if isinstance(e, signals.Terminated):
        print(f"{e} at step {step} (split placement stops at once); the newest checkpoint is "
              f"{checkpoints.newest(checkpoint_dir)}; continue with --resume auto", file=sys.stderr, flush=True)  # fmt: skip
        return signals.EXIT_PREEMPTED
    if isinstance(e, KeyboardInterrupt):
        return _interrupted(h, step, checkpoint_dir)
    line = lost_peer(e)  # a collective failed: a rank that died takes the others with it
    if line is None:
        return None
    where = f"step {step}: " if step else ""  # (a split rollout rank counts no steps)
    print(f"error: {where}{line}", file=sys.stderr, flush=True)
    return EXIT_PEER_LOST


def _interrupted(h: Handles, step: int, checkpoint_dir: Path) -> int:
    signals.exit_at_once_on_sigint()
    if h.placement.writes:
        checkpoints.discard_partial(checkpoint_dir)
    print(f"interrupted at step {step}; the newest checkpoint is {checkpoints.newest(checkpoint_dir)}; "
          "continue with --resume auto", file=sys.stderr, flush=True)  # fmt: skip
    return signals.EXIT_INTERRUPTED


def _close(h: Handles, *, finished: bool = False) -> None:
    """The reward pool, the logger, the engines (vLLM: their processes and groups), the process group
    (after a clean finish, first every rank in the order torchrun's launchers need: `leave_in_order`,
    while the world's group is whole: an in-process vLLM engine's close tears it down)."""
    if finished:
        leave_in_order()
    if h.scorer is not None:
        h.scorer.close()
    h.logger.close()
    if h.engine is not None:
        h.engine.close()
    if h.judge is not None:
        h.judge.engine.close()
    close_distributed()


# ---------------------------------------------------------------- loop


@dataclasses.dataclass
class Control:
    """What the shell holds while the loop runs, and nothing else does: the config, the preemption flag
    (its one owner), and the step in progress that the shell's error lines name (0 before the first)."""

    cfg: Config
    preemption: signals.Preemption
    step: int = 0


def loop(state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan, control: Control) -> TrainState:
    """The training loop; on a rollout rank of split placement, the rollout loop that feeds it. Both run
    under the hang watchdog (--trainer.hang-timeout-s), from the checkpoint --resume names."""
    cfg = control.cfg
    with watching(_watchdog(cfg)):
        state = checkpoints.resume(state, h, cfg.resume)
        if not h.placement.trains:
            validate = Colocated().validation  # the engine is this rank's
            return split.rollout_loop(
                state,
                h,
                algorithm,
                plan,
                lambda step: validate(h, plan, step),
                lambda s: checkpoints.save(s, h, keep_last=plan.schedule.keep_last),
            )
        return _train_loop(state, h, algorithm, plan, control)


def _watchdog(cfg: Config) -> Watchdog | None:
    if cfg.trainer.hang_timeout_s <= 0:
        return None
    return Watchdog(cfg.trainer.hang_timeout_s, rank=group_rank(), world=group_size())


def _train_loop(
    state: TrainState, h: Handles, algorithm: Algorithm, plan: StepPlan, control: Control
) -> TrainState:
    cfg, schedule, transport = control.cfg, plan.schedule, h.transport
    # the engine starts from the policy's weights (restored ones after a resume): not a new version
    transport.push(state.actor.model, h, plan, step=state.step, version=state.policy_version)
    if state.step == 0 and schedule.val_due(0):
        with phase("validation"):
            h.logger.log(0, transport.validation(h, plan, 0))
    h.logger.begin(state.step)
    profiler = StepProfiler(profile_steps(cfg.trainer.profile_steps), h.out_dir, group_rank())
    last_finite = {}
    while state.step < schedule.steps:
        control.step = state.step + 1
        at_step(control.step)
        profiler.before(control.step)
        state, metrics = train_step(state, h, algorithm, plan)
        step = state.step
        update = {k: v for k, v in metrics.items() if k.startswith("actor/")}
        last_finite = check_bad_updates(
            state.bad_updates, step, update, last_finite, limit=cfg.trainer.max_bad_updates
        )
        if cfg.rollout.exact:
            check_exact(metrics, step=step)
        health, checked, warnings = check_health(state.health, metrics, step=step, engine=cfg.rollout.engine,
                                                 dtype=defaults.compute_dtype(cfg), max_tokens=plan.horizon)  # fmt: skip
        state, metrics = dataclasses.replace(state, health=health), metrics | checked
        if h.placement.writes:
            for line in warnings:
                print(line, file=sys.stderr, flush=True)
        if schedule.val_due(step):
            with phase("validation"):
                metrics |= transport.validation(h, plan, step)
        profiler.after(step)
        h.logger.log(step, metrics)
        saved = schedule.save_due(step)
        if saved:
            with phase("checkpoint"):
                checkpoints.save(state, h, keep_last=schedule.keep_last)
        if not transport.stops_at_once and control.preemption.requested():  # every rank alike: a reduced flag
            _preempted(state, h, plan, saved=saved)
    transport.finish(h)
    _finish(state, h, cfg)
    return state


def _preempted(state: TrainState, h: Handles, plan: StepPlan, *, saved: bool) -> None:
    """A preemption signal reached some rank: the finished step's checkpoint (unless just written), then
    `Preempted` (exit 143)."""
    if not saved:
        with phase("checkpoint"):
            checkpoints.save(state, h, keep_last=plan.schedule.keep_last)
    raise signals.Preempted(state.step, h.out_dir / "checkpoints" / f"step_{state.step}")


def _finish(state: TrainState, h: Handles, cfg: Config) -> None:
    """out_dir/final (the HF directory) and curves.png; a full disk here is one line, exit 2."""
    from safetensors import SafetensorError

    try:
        save_final(
            state.actor.model, h.tokenizer, h.out_dir, group=h.placement.trainers, base=cfg.model.path
        )
        if h.placement.writes:
            records = read_metrics(h.out_dir / "metrics.jsonl")
            plot_curves(records, h.out_dir / "curves.png", title=f"{cfg.preset}: {cfg.model.path}")
    except (OSError, SafetensorError) as e:
        raise StopRun(
            f"cannot write the final model or curves under {h.out_dir} ({reason(e)}); free disk space, then "
            f"rerun with --resume auto (training is done; checkpoints, if any, are intact)"
        ) from None
