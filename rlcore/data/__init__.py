"""Prompt data: verl-format rows from parquet / jsonl, chat-template rendering, left-padded Batches.

from rlcore.data import PromptDataset
ds = PromptDataset.from_files(["train.parquet"], tokenizer, max_prompt_length=512, seed=0)
prompts = ds.next_batch(32)      # Batch: input_ids, attention_mask, position_ids,
                                 #        uid, data_source, ground_truth, extra_info, raw_prompt
"""

from rlcore.data.dataset import Cursor, PromptDataset, epoch_seed
from rlcore.data.prompts import (
    encode_prompt,
    encode_rows,
    left_pad,
    make_prompt_batch,
    pad_token_id,
    prompt_batch,
    render_prompt,
)
from rlcore.data.rows import DataError, Row, read_rows, row_from_dict

__all__ = [
    "Cursor",
    "DataError",
    "PromptDataset",
    "Row",
    "encode_prompt",
    "encode_rows",
    "epoch_seed",
    "left_pad",
    "make_prompt_batch",
    "pad_token_id",
    "prompt_batch",
    "read_rows",
    "render_prompt",
    "row_from_dict",
]
