"""The Tinker API served by rlcore: research loops written against the `tinker` SDK (forward_backward,
optim_step, sample, save_weights_for_sampler, save_state / load_state) run locally on any rlcore model.

    python -m rlcore.tinker --port 8000          # torchrun --nproc-per-node 2 -m rlcore.tinker ... alike
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_loop.py

Parts: `losses` (Tinker's losses on rlcore's pure ones), `wire` (the SDK's protobuf bodies), `rows`
(datums as model inputs), `model` (one trained model and its engine), `sampling`, `ops` (operations and
the worker), `futures`, `server` (the endpoints), `serve` (flags and process). Needs the `tinker` extra.
"""
