"""Attention health over a training run: ``python examples/attention_health.py`` writes health.jsonl.

One attention layer is trained with Adam at a high learning rate to copy the
first token to every position: it learns to look only at that token, so its
largest pre-softmax logit grows and its attention entropy falls. Every 5th
step the trace measures both, per head. Then ``qkvtrace summarize health.jsonl``
shows them per module, first -> last, with an alert at the step they crossed
a threshold. The numbers differ a little from run to run (random weights and inputs).
"""

import torch
from torch import nn

import qkvtrace

mha = nn.MultiheadAttention(16, 4, batch_first=True)
opt = torch.optim.Adam(mha.parameters(), lr=0.2)

x = torch.randn(4, 8, 16)  # one batch, seen again every step

with qkvtrace.trace(mha, keep="changes", health_every=5, stream_to="health.jsonl") as t:
    for _ in range(100):
        out, _ = mha(x, x, x, need_weights=False)
        loss = (out - x[:, :1]).square().mean()  # every position should copy token 0
        loss.backward()
        opt.step()
        opt.zero_grad()
        t.step()

for r in (t.health[0], t.health[-1]):
    top = max(h.max_logit for h in r.heads)
    low = min(h.entropy_mean for h in r.heads)
    print(f"step {r.step}: max logit {top:.1f}, entropy {low:.2f} nats")
