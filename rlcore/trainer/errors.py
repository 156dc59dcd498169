"""The one exception the run shell turns into a user-facing stop: one `error:` line, exit code 2."""


class StopRun(Exception):
    """Something the user must fix outside the config (a full disk, an unusable checkpoint); the message
    names the culprit and the fix. `run()` prints it as one line and returns 2; the loop's `finally`
    still closes the reward pool, the logger and the engine."""
