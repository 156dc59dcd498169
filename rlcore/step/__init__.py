"""The library's steps: rollout, score, log-prob, advantage, update and critic (`steps`, `update`, `critic`),
one step's learning and collection (`learn`, `collect`), the placement seam (`transport`, `split`), the weight
push (`weights`) and `train_step`. They take built objects (`Handles`) and plans (`StepPlan`), never a Config."""
