"""TARGET forms for library models: hf:, timm:, torchvision: — offline, tiny models saved to a temporary folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkvtrace.analyses.target import load_target
from qkvtrace.base.errors import TargetError

HERE = Path(__file__).resolve().parent
#: never reach the network: the hub refuses at once instead of trying
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def qkv(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore", **OFFLINE, **env}
    return subprocess.run([sys.executable, "-m", "qkvtrace", *args], capture_output=True, text=True, env=full,
                          cwd=cwd or HERE.parent, timeout=300)  # fmt: skip


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny BERT saved with its weights, and the same config alone."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=40)  # fmt: skip
    torch.manual_seed(3)
    model = transformers.BertForMaskedLM(config)
    model.save_pretrained(root / "weights")
    config.save_pretrained(root / "config-only")
    return {"weights": root / "weights", "config": root / "config-only", "root": root}


def test_hf_folder_loads_the_saved_weights(bert: dict[str, Path], tmp_path: Path) -> None:
    """Witness: the saved weights read back by transformers itself; the layer count of the config built here."""
    transformers = pytest.importorskip("transformers")
    # --backward: with gradients on, the Q/K/V rows are derived from the call's graph (no graph, no rows)
    proc = qkv("trace", f"hf:{bert['weights']}", "--backward", "--columns", "weights", "--json",
               str(tmp_path / "t.json"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    calls = json.loads((tmp_path / "t.json").read_text())["calls"]
    assert [c["module"] for c in calls] == [f"bert.encoder.layer.{i}.attention.self" for i in range(2)]
    # independent: the saved weights, read back by transformers itself
    saved = transformers.BertForMaskedLM.from_pretrained(bert["weights"])
    for i, call in enumerate(calls):
        q = saved.bert.encoder.layer[i].attention.self.query.weight
        assert call["qkv"]["q"]["weight_norm"] == pytest.approx(float(q.detach().norm()), rel=1e-6)
    assert "bert.encoder.layer.1.attention.self" in proc.stdout


def test_hf_random_init_needs_only_the_config(bert: dict[str, Path], tmp_path: Path) -> None:
    """Witness: the config built by the test, and transformers building its architecture from it here with
    PyTorch's RNG set to 0 (the fixed random weights the page promises); the RNG state read before and after."""
    transformers = pytest.importorskip("transformers")
    assert not any(p.suffix in (".safetensors", ".bin") for p in bert["config"].iterdir())
    out = tmp_path / "t.json"
    proc = qkv("trace", f"hf:{bert['config']}", "--random-init", "--backward", "--input-shape", "3,11", "--json",
               str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    calls = json.loads(out.read_text())["calls"]
    assert len(calls) == 2 and {c["path"] for c in calls} == {"sdpa"}
    assert all(c["inputs"]["query_shape"][0] == 3 and 11 in c["inputs"]["query_shape"] for c in calls), calls
    # seeded: the same random model in every process, and the global random state left alone
    state = torch.random.get_rng_state()
    again = load_target(f"hf:{bert['config']}", random_init=True).model
    assert torch.equal(torch.random.get_rng_state(), state)
    config = transformers.AutoConfig.from_pretrained(bert["config"])
    (arch,) = config.architectures
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = getattr(transformers, arch)(config)
    for model in (again, built):  # in this process, and in the command's
        q = model.bert.encoder.layer[0].attention.self.query.weight
        assert calls[0]["qkv"]["q"]["weight_norm"] == pytest.approx(float(q.detach().norm()), rel=1e-6)
    without = qkv("trace", f"hf:{bert['config']}")
    one_line_error(without, "no weights", "--random-init")


def test_hf_inputs_come_from_the_config(bert: dict[str, Path]) -> None:
    """Witness: the config built by the test (vocab_size=97, max_position_embeddings=40)."""
    pytest.importorskip("transformers")
    loaded = load_target(f"hf:{bert['config']}", random_init=True)
    (ids,), kwargs = loaded.make_inputs(4, 9)
    assert ids.shape == (4, 9) and ids.dtype == torch.int64 and kwargs == {}
    assert 0 <= int(ids.min()) and int(ids.max()) < 97  # below the config's vocab_size
    with pytest.raises(Exception, match="max_position_embeddings=40"):
        loaded.make_inputs(1, 41)


def test_hf_vision_model_gets_images_of_the_config_size(tmp_path: Path) -> None:
    """Witness: the config built by the test (24-pixel images, 8-pixel patches, one layer), worked out here."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=24, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=4, intermediate_size=64)  # fmt: skip
    config.save_pretrained(tmp_path / "vit")
    loaded = load_target(f"hf:{tmp_path / 'vit'}", random_init=True)
    (pixels,), _ = loaded.make_inputs(2, 16)
    assert pixels.shape == (2, 3, 24, 24)
    proc = qkv("trace", f"hf:{tmp_path / 'vit'}", "--random-init", "--json", str(tmp_path / "t.json"))
    assert proc.returncode == 0, proc.stderr
    calls = json.loads((tmp_path / "t.json").read_text())["calls"]
    assert len(calls) == 1 and calls[0]["module"].endswith("attention")
    assert 10 in calls[0]["inputs"]["query_shape"]  # (24/8)² patches + [CLS] = 10 tokens


@pytest.mark.parametrize(
    ("target", "needles"),
    [
        ("hf:./no-such-folder", ["does not exist"]),
        ("hf:no-such-org/no-such-model-xyz", ["local cache", "hf download no-such-org/no-such-model-xyz"]),
        ("hf:", ["names no model"]),
        ("demo:mha --random-init", ["--random-init is for hf: targets"]),
    ],
)
def test_hf_bad_targets(target: str, needles: list[str]) -> None:
    """Witness: the target built by the test, and the message the test expects."""
    pytest.importorskip("transformers")
    one_line_error(qkv("trace", *target.split()), *needles)


def test_hf_folder_without_config(tmp_path: Path) -> None:
    """Witness: the empty folder the test made, and the message the test expects."""
    pytest.importorskip("transformers")
    (tmp_path / "empty").mkdir()
    one_line_error(qkv("trace", f"hf:{tmp_path / 'empty'}", "--random-init"), "no config.json")


@pytest.mark.parametrize(("prefix", "library", "extra"),
                         [("hf", "transformers", "hf"), ("timm", "timm", "timm"),
                          ("torchvision", "torchvision", "torchvision")])  # fmt: skip
def test_missing_library_is_one_clear_line(tmp_path: Path, prefix: str, library: str, extra: str) -> None:
    """A library that cannot be imported (absent, or built for another torch) is named, with what to install.

    Witness: the blocking package the test wrote on PYTHONPATH, and the message the test expects."""
    blocked = tmp_path / library
    blocked.mkdir()
    (blocked / "__init__.py").write_text(f"raise ImportError('{library} is blocked for this test')\n")
    proc = qkv("trace", f"{prefix}:some_model", PYTHONPATH=str(tmp_path))
    one_line_error(proc, f"needs the {library} library", f'pip install "qkvtrace[{extra}]"')


def _importable(name: str) -> str | None:
    """Why ``name`` cannot be used here, or None when it imports."""
    proc = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=120)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


def test_timm_model_random_weights(tmp_path: Path) -> None:
    """Witness: the named architecture's published shape (12 blocks, 224-pixel images in 16-pixel patches)."""
    why = _importable("timm")
    if why:
        pytest.skip(f"timm cannot be imported beside this torch ({why}); the error path is tested above")
    proc = qkv("trace", "timm:vit_tiny_patch16_224", "--input-shape", "1,1", "--json", str(tmp_path / "t.json"))
    assert proc.returncode == 0, proc.stderr
    calls = json.loads((tmp_path / "t.json").read_text())["calls"]
    assert len(calls) == 12 and all(197 in c["inputs"]["query_shape"] for c in calls)  # 14² patches + [CLS]


def test_torchvision_model_random_weights(tmp_path: Path) -> None:
    """Witness: the named architecture's published shape (12 encoder layers of ``nn.MultiheadAttention``)."""
    why = _importable("torchvision")
    if why:
        pytest.skip(f"torchvision cannot be imported beside this torch ({why}); the error path is tested above")
    proc = qkv("trace", "torchvision:vit_b_16", "--input-shape", "1,1", "--json", str(tmp_path / "t.json"))
    assert proc.returncode == 0, proc.stderr
    calls = json.loads((tmp_path / "t.json").read_text())["calls"]
    assert len(calls) == 12 and {c["module_type"] for c in calls} == {"MultiheadAttention"}


def test_unknown_library_model_names(tmp_path: Path) -> None:
    """Witness: the model name the test makes up, expected in the message."""
    for library in ("timm", "torchvision"):
        if _importable(library) is None:
            proc = qkv("trace", f"{library}:no_such_model_xyz")
            one_line_error(proc, "no_such_model_xyz")


def test_load_target_errors_are_target_errors() -> None:
    """Witness: the target built by the test, and the exception type and message the test expects."""
    with pytest.raises(TargetError, match="names no model"):
        load_target("timm:")


class _Patches(torch.nn.Module):
    """A small image model: 4x4 patches, one self-attention over them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Conv2d(3, 16, 4, stride=4)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)  # (B, patches, 16)
        return self.attn(tokens, tokens, tokens)[0]


def test_library_glue_with_stand_in_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    """What qkvtrace itself does for timm:/torchvision: — the arguments it passes (random weights), the input
    size it reads, its message for an unknown name — checked with stand-ins where the libraries cannot be
    imported beside this torch. The real libraries are traced above when they can be.

    Witness: the stand-ins the test wrote, which record what they are asked; the RNG state read before and after."""
    import types

    asked: list[tuple[str, object]] = []

    def create_model(name: str, pretrained: bool) -> torch.nn.Module:
        asked.append((name, pretrained))
        if name != "patches":
            raise RuntimeError(f"Unknown model ({name})")
        model = _Patches()
        model.pretrained_cfg = {"input_size": (3, 20, 12)}  # type: ignore[assignment]
        return model

    def get_model(name: str, weights: object) -> torch.nn.Module:
        asked.append((name, weights))
        if name != "patches":
            raise ValueError(f"Unknown model {name}")
        return _Patches()

    monkeypatch.setitem(sys.modules, "timm", types.SimpleNamespace(create_model=create_model))
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(models=types.SimpleNamespace(
        get_model=get_model)))  # fmt: skip
    state = torch.random.get_rng_state()
    timm_model = load_target("timm:patches")
    (pixels,), kwargs = timm_model.make_inputs(2, 99)
    assert pixels.shape == (2, 3, 20, 12) and kwargs == {}  # the model's input_size; the length is not used
    vision = load_target("torchvision:patches")
    assert vision.make_inputs(1, 1)[0][0].shape == (1, 3, 224, 224)  # torchvision's default image size
    assert asked == [("patches", False), ("patches", None)]  # random weights: nothing to download
    assert torch.equal(torch.random.get_rng_state(), state)
    again = load_target("timm:patches").model
    assert torch.equal(again.attn.in_proj_weight, timm_model.model.attn.in_proj_weight)  # seeded
    with pytest.raises(TargetError, match=re.escape("Unknown model (nope); list names with timm.list_models()")):
        load_target("timm:nope")
    unknown = re.escape("Unknown model nope; list names with torchvision.models.list_models()")
    with pytest.raises(TargetError, match=unknown):
        load_target("torchvision:nope")
