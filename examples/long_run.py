"""A long run traced with bounded memory: ``python examples/long_run.py`` writes run.jsonl.

Steps 0-119 train, 120-199 evaluate; from step 150 the batches carry padding.
Then ``qkvtrace summarize run.jsonl`` says when attention changed.
"""

import torch
from torch import nn

import qkvtrace

torch.manual_seed(0)
mha = nn.MultiheadAttention(16, 4, batch_first=True)
x = torch.randn(2, 6, 16)
padding = torch.zeros(2, 6, dtype=torch.bool)
padding[:, -2:] = True

with qkvtrace.trace(mha, keep="changes", stream_to="run.jsonl") as t:
    for step in range(200):
        mha.train(step < 120)
        with torch.set_grad_enabled(step < 120):
            for _ in range(10):
                mha(x, x, x, need_weights=False, key_padding_mask=padding if step >= 150 else None)
        t.step()
print(f"{len(t.calls)} records kept for {sum(c['calls'] for c in t.summary()['modules']['']['combinations'])} calls")
