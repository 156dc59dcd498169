"""A demonstration environment for `--rollout.env`: reverse the digits, with one retry after a miss.

    python train.py --rollout.env examples/envs/reverse_retry.py:ReverseRetry --rollout.max-turns 2 \
        --data.train-files rows.jsonl ...          (examples/env_demo.py writes the rows and runs it)

The row's prompt (`reverse 40213`) is the first user turn; `reset` adds nothing. A right answer on the
first turn scores 1 and ends the episode; a miss gets the observation "wrong, again" (a user turn
rendered by the chat template) and a second try, scored 0.5 x its positional credit. The episode's
score is the sum of the step rewards, so it rises as the policy gets the first try right.
"""

from __future__ import annotations

from rlcore.data.tasks import positional_credit

RETRY = "wrong, again"
"""The observation after a missed first try."""


class ReverseRetry:
    """Text in, text out, gymnasium's reset/step signatures; one instance per sample."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self.truth = str(options["row"]["ground_truth"])
        self.tries = 0
        return "", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.tries += 1
        answer = action.strip()
        if answer == self.truth:
            return "", 1.0 if self.tries == 1 else 0.5, True, False, {}
        if self.tries == 1:
            return RETRY, 0.0, False, False, {}
        return "", 0.5 * positional_credit(answer, self.truth), True, False, {}
