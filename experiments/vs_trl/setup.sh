#!/usr/bin/env bash
# The TRL side of experiments/vs_trl (issue 9): its own virtual environment with CPU torch and TRL.
#
#     bash experiments/vs_trl/setup.sh                  # -> /work/scratch-trl/venv
#     bash experiments/vs_trl/setup.sh /tmp/trl-venv    # or any path (pass it to run.py --trl-python)
#
# trl==1.16.0 (what `pip install trl` gave on 2026-11-29) brings transformers 5.24.0, accelerate 1.15.0
# and datasets 5.2.0. rlcore is not installed here: the TRL launcher (trl_train.py) imports only
# experiments/vs_trl/reward.py, which imports rlcore from the checkout for reasoning-gym rows only.
# rlcore runs from the repository's own .venv.
set -euo pipefail
VENV="${1:-/work/scratch-trl/venv}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q trl==1.16.0
# The real-model mode (run.py --model smollm2) scores reasoning-gym rows through rlcore.data.reasoning_gym.
"$VENV/bin/pip" install -q reasoning-gym==0.1.25 orjson
"$VENV/bin/python" -c "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in ('trl', 'torch', 'transformers', 'accelerate', 'datasets')), sep=', ')"
