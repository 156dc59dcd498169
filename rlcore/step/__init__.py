"""The library's steps: rollout, score, log-prob, advantage, update and critic (`steps`, `update`, `critic`),
one step's learning as a chain of stages and the collection (`learn`, `stages`, `collect`), the optimizer
states from specs (`optim`), the placement seam (`transport`, `split`), the weight push into an engine
(`weights`) and `train_step`. They take built objects (`Handles`) and plans (`StepPlan`), never a Config."""
