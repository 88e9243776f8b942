"""A small transformers GPT-2 with eager attention (random weights, from a config), for `qkvtrace advise`.

    qkvtrace advise examples/gpt2_eager.py:build
"""

from __future__ import annotations

from typing import Any


def build() -> tuple[Any, Any]:
    import torch
    import transformers

    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8, n_positions=256, vocab_size=1000,
                                     attn_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1))
    return model, (ids,)
