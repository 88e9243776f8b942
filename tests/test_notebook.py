"""``examples/attention-tour.ipynb`` executed top to bottom by a real Jupyter kernel (``nbclient``).

Skipped, with the reason, where nbclient, nbformat or ipykernel is missing
(the README's test command installs them).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _mha_reasons import reason_under
from torch import nn

from qkvtrace.analyses.demos import demo_encoder

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install nbformat)")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install nbclient)")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install ipykernel)")

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "attention-tour.ipynb"

pytestmark = pytest.mark.notebook


def test_the_attention_tour_runs_and_shows_what_it_says(tmp_path: Path) -> None:
    """Witness: the demo encoder's own MultiheadAttention modules and PyTorch's source (its training reason).

    The notebook runs without an error; its first trace displays as an HTML
    table of one row per attention module of the encoder; the reason it prints
    is PyTorch's; the gradient routes display with their picture.
    """
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
                            ).execute()  # fmt: skip
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    encoder, _ = demo_encoder()
    expected = [n for n, m in encoder.named_modules() if isinstance(m, nn.MultiheadAttention)]
    assert re.findall(r'<tr data-call="call-\d+" data-index="\d+" data-module="([^"]+)"', html[0]) == expected
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert repr(reason_under("self.training")) in text
    assert any("How the loss reaches W_Q, W_K, W_V" in h and "<svg" in h for h in html)
    assert any('class="map"' in h for h in html)
