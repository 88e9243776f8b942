"""Default input budgets (docs/tutorial.md#limits). No PyTorch import: the CLI reads them at start-up."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_ATTENTION_MB", "DEFAULT_MAX_MAP_MB", "DEFAULT_MAX_MAP_TOKENS", "DEFAULT_MAX_TOKENS"]

#: Tokens (batch x sequence) accepted by default.
DEFAULT_MAX_TOKENS = 65_536
#: Estimated attention memory (MB) accepted by default.
DEFAULT_MAX_ATTENTION_MB = 4_096.0
#: Longest query or key side of an attention map computed by default (``trace(..., attention_maps=True)``).
DEFAULT_MAX_MAP_TOKENS = 1024
#: Memory all the attention maps of one trace may hold by default (MB, float32 on the CPU).
DEFAULT_MAX_MAP_MB = 256.0
