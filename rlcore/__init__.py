"""rlcore: reinforcement-learning post-training of language models.

`rlcore.pure` holds the math (pure functions on tensors); the rest of the package is the
impure shell around it (data, models, rollout engines, rewards, distribution).
"""

__version__ = "0.1.0"
