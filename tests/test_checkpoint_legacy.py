"""Checkpoints written before the core redesign (nanolight 0.1.0, tests/fixtures/legacy_v1/, made by
fixtures/make_legacy_checkpoints.py) still resume, on one device and at tp2, with the losses the
uninterrupted run had, once `scripts/upgrade_checkpoint.py` has converted them: the one-process one
from the format before the index, the tp2·pp2·dp2 ZeRO-1 one from format v1 (the MLP's gate_up rows
interleaved; now [gate | up]). The trainer reads one format: opening either unconverted says to run
the script. The script checks a ``checksums.json`` when there, and refuses a parameter order the
stored shapes contradict."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from make_legacy_checkpoints import OUT, LegacyLM, Losses, loader, trainer  # noqa: E402

from nanolight.checkpoint import CheckpointError  # noqa: E402
from nanolight.strategies import Parallel3DStrategy, SingleDeviceStrategy  # noqa: E402

EXPECTED = {int(k): v for k, v in json.loads((OUT / "losses.json").read_text()).items()}
SCRIPT = Path(__file__).parents[1] / "scripts" / "upgrade_checkpoint.py"
_spec = importlib.util.spec_from_file_location("upgrade_checkpoint", SCRIPT)
upgrade_checkpoint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(upgrade_checkpoint)


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both fixtures, converted by the script's command line (under <saved>/step-2)."""
    root = tmp_path_factory.mktemp("upgraded")
    for saved in ("single", "tp2_pp2_dp2_zero1"):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), str(OUT / saved / "step-2"), str(root / saved / "step-2")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    return root


def _saved(saved: str, upgraded: Path) -> str:
    return str(upgraded / saved / "step-2")


@pytest.mark.parametrize("saved", ["single", "tp2_pp2_dp2_zero1"])
def test_legacy_checkpoint_resumes_on_one_device(saved: str, upgraded: Path) -> None:
    record = Losses()
    t = trainer(SingleDeviceStrategy("cpu"), 4, [record])
    t.fit(LegacyLM(), train_dataloaders=loader(), ckpt_path=_saved(saved, upgraded))
    assert sorted(record.losses) == [3, 4]
    for step, loss in record.losses.items():
        assert loss == pytest.approx(EXPECTED[step], rel=1e-5), (step, loss, EXPECTED[step])


def _tp2(rank: int, world: int, saved: str) -> dict[int, float]:
    record = Losses()
    t = trainer(Parallel3DStrategy(tp=2), 4, [record])
    t.fit(LegacyLM(), train_dataloaders=loader(), ckpt_path=saved)
    return record.losses


@pytest.mark.parametrize("saved", ["single", "tp2_pp2_dp2_zero1"])
def test_legacy_checkpoint_resumes_at_tp2(saved: str, upgraded: Path) -> None:
    for losses in run_distributed(_tp2, 2, _saved(saved, upgraded), timeout=120):
        assert sorted(losses) == [3, 4]
        for step, loss in losses.items():
            assert loss == pytest.approx(EXPECTED[step], rel=1e-5), (step, loss, EXPECTED[step])


def test_legacy_weights_agree(upgraded: Path) -> None:
    """Both fixtures hold the same step-2 weights (one run, two layouts), read on one device once
    upgraded; gate_up's rows are [gate | up], the gate rows those stored first of each pair."""
    from safetensors.torch import load_file

    from nanolight.checkpoint import CheckpointReader

    single = CheckpointReader.open(upgraded / "single" / "step-2").model_state()
    sharded = CheckpointReader.open(upgraded / "tp2_pp2_dp2_zero1" / "step-2").model_state()
    stored = load_file(str(OUT / "single" / "step-2" / "model.safetensors"))  # 0.1: [g0, u0, g1, ...]
    gate_up = "model.model.layers.0.mlp.gate_up_proj.weight"
    assert torch.equal(single[gate_up], torch.cat((stored[gate_up][0::2], stored[gate_up][1::2])))
    assert single.keys() == sharded.keys()
    for key, value in single.items():
        # AdamW turns last-bit gradient differences (another summation order) into ~1e-5 steps of
        # a few elements at lr 1e-2, so the bound is on the tensor's norm
        rel = torch.linalg.vector_norm(sharded[key] - value) / torch.linalg.vector_norm(value)
        assert rel <= 2e-5, (key, float(rel))


@pytest.mark.parametrize("saved", ["single", "tp2_pp2_dp2_zero1"])
def test_an_old_checkpoint_names_the_script(saved: str) -> None:
    with pytest.raises(CheckpointError, match=r"convert it once with `python scripts/upgrade_checkpoint.py "):
        trainer(SingleDeviceStrategy("cpu"), 4).fit(
            LegacyLM(), train_dataloaders=loader(), ckpt_path=str(OUT / saved / "step-2")
        )


def _with_checksums(tmp_path: Path) -> Path:
    """The one-process fixture as the writer before the one format left it: plus checksums.json."""
    step = tmp_path / "step-2"
    shutil.copytree(OUT / "single" / "step-2", step)
    files = [step / name for name in ("model.safetensors", "optimizer.pt", "trainer_state.pt")]
    manifest = {
        f.name: {"size": f.stat().st_size, "crc32": f"{zlib.crc32(f.read_bytes()):08x}"} for f in files
    }
    (step / "checksums.json").write_text(json.dumps(manifest))
    return step


def test_the_upgrade_checks_checksums(tmp_path: Path) -> None:
    step = _with_checksums(tmp_path)
    upgrade_checkpoint.upgrade(step, tmp_path / "new")  # intact: converts
    assert (tmp_path / "new" / "index.json").is_file()

    data = (step / "optimizer.pt").read_bytes()  # one flipped bit, the size kept
    (step / "optimizer.pt").write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    with pytest.raises(CheckpointError, match=r"optimizer.pt is damaged: its checksum differs"):
        upgrade_checkpoint.upgrade(step, tmp_path / "bad")
    (step / "checksums.json").write_bytes(b"\xc7\xff not json")
    with pytest.raises(
        CheckpointError, match=r"checksums file .*checksums.json is unreadable: truncated or damaged"
    ):
        upgrade_checkpoint.upgrade(step, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_the_upgrade_refuses_an_order_the_shapes_contradict(tmp_path: Path) -> None:
    step = tmp_path / "step-2"
    shutil.copytree(OUT / "single" / "step-2", step)
    states = torch.load(step / "optimizer.pt", weights_only=True)
    states[0]["param_groups"][0]["params"].reverse()  # the matrices numbered last to first
    torch.save(states, step / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"no param group's next parameter has the shape of model"):
        upgrade_checkpoint.upgrade(step, tmp_path / "new")


def test_a_v1_model_directory_names_the_script_and_upgrades(tmp_path: Path) -> None:
    """A model directory of format v1 (config.json, model.safetensors with gate_up's rows
    interleaved per unit) is refused with the script's name; once upgraded it loads as the model
    it was saved from."""
    from safetensors.torch import load_file, save_file

    from nanolight.models import LlamaConfig, LlamaForCausalLM
    from nanolight.models.pretrained import load_pretrained, save_pretrained

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.preset("smollm-tiny", num_hidden_layers=2, vocab_size=256))
    save_pretrained(model, tmp_path / "v2")
    old = tmp_path / "v1"
    shutil.copytree(tmp_path / "v2", old)
    tensors = load_file(str(old / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("gate_up_proj.weight"):  # [gate | up] -> [g0, u0, g1, u1, ...]
            gate, up = t.chunk(2)
            tensors[name] = torch.stack((gate, up), dim=1).reshape(t.shape)
    save_file(tensors, str(old / "model.safetensors"))
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "format_version": 1}))
    with pytest.raises(CheckpointError, match=r"convert it once with `python scripts/upgrade_checkpoint.py "):
        load_pretrained(old)
    assert upgrade_checkpoint.main([str(old), str(tmp_path / "new")]) == 0
    loaded = load_pretrained(tmp_path / "new")
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model.eval()(ids))
