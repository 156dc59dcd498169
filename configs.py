"""Typed, frozen configuration of rlcore runs (read by tyro in train.py).

The full set of presets (grpo, dapo, drgrpo, gspo, rloo, reinforce_pp, remax, ppo, sft) arrives with
the trainer; this module already fixes the house rules: `@dataclass(frozen=True, kw_only=True)`, a
docstring under every field, `Literal` choices, validation that names the flag and the fix.
"""
