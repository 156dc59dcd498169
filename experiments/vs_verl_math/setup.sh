#!/usr/bin/env bash
# A virtual environment with verl 0.9.1 and the few packages `verl.trainer.ppo.core_algos` needs at
# import time, for experiments/vs_verl_math/compare.py (issue 9).
#
#     bash experiments/vs_verl_math/setup.sh                 # -> /work/scratch-verl/venv
#     bash experiments/vs_verl_math/setup.sh /tmp/verl-venv  # or any path
#
# verl is installed with --no-deps: its full dependency list (vLLM, datasets, wandb, peft, ...) is not
# needed for the math. Importing core_algos runs verl/__init__.py, which imports verl.protocol, which
# imports ray, tensordict and transformers; core_algos itself needs omegaconf and codetiming (through
# verl.utils). Those are installed for real (nothing is stubbed); ray is the large one (~240 MB).
# transformers is pinned to verl's own range (>=5.5.3,<5.11, !=5.6.0).
# pip then reports the verl requirements left out (accelerate, datasets, ...): expected.
# rlcore is not installed here: compare.py puts the repository root on sys.path and imports only
# rlcore.pure, which needs torch alone.
set -euo pipefail
VENV="${1:-/work/scratch-verl/venv}"
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q torch==2.13.0 numpy
"$PIP" install -q --no-deps verl==0.9.1
"$PIP" install -q packaging omegaconf codetiming ray "tensordict>=0.8,<=0.10.0,!=0.9.0" \
    "transformers>=5.5.3,<5.11,!=5.6.0"
"$VENV/bin/python" -c "import verl.trainer.ppo.core_algos, importlib.metadata as m; print('verl', m.version('verl'), 'torch', m.version('torch'), 'ray', m.version('ray'), 'transformers', m.version('transformers'))"
