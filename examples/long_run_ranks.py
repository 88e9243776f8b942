"""A long run of a two-rank job: ``torchrun --nproc-per-node 2 examples/long_run_ranks.py``.

Each rank streams its own file (``run.jsonl`` becomes ``run.rank0.jsonl``,
``run.rank1.jsonl``). Rank 1 starts getting padded batches at step 30 (its
data differ); ``qkvtrace merge run.rank0.jsonl run.rank1.jsonl`` finds it.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import qkvtrace

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True))
x = torch.randn(2, 6, 16)
padding = torch.zeros(2, 6, dtype=torch.bool)
padding[:, -2:] = True

with qkvtrace.trace(model, keep="changes", stream_to="run.jsonl") as t:
    for step in range(50):
        mask = padding if rank == 1 and step >= 30 else None
        model(x, src_key_padding_mask=mask).sum().backward()
        t.step()
dist.destroy_process_group()
