"""``export --dora-ranks`` end to end (needs the ``export`` extra): a tiny Llama exported with a
DoRA slot runs a PEFT DoRA adapter as float64 transformers + peft does, in the prefill, the
attention-window decode and the whole-cache decode; Gemma 3's own decoder is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("litert_torch")

import checkpoints  # noqa: E402
from runtime import Engine, SessionConfig  # noqa: E402
from runtime.errors import UnimplementedError  # noqa: E402
from runtime.util.signature_names import DORA, LoraSlot  # noqa: E402

pytestmark = pytest.mark.export

PROMPT_LEN, TOKENS = 6, 24  # decode at positions 6-23: in the 16 window, then past it
TOKEN_IDS = [int(t) for t in np.random.default_rng(4).integers(5, checkpoints.VOCAB, TOKENS)]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("dora")
    source = checkpoints.write_llama_directory(work / "llama", tokenizer=False)
    model = work / "tiny.tflite"
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "export", str(source), "--out", str(model), "--lora-ranks", "4",
         "--dora-ranks", "4", "--kv-length", "64", "--prefill-lengths", "8", "--attention-windows", "16",
         "--jobs", "1"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return source, model


def test_a_dora_adapter_matches_float64_peft_in_every_signature_kind(exported, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    source, model = exported
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64).eval()
    with torch.no_grad():
        plain = base(torch.tensor([TOKEN_IDS])).logits[0].numpy()[PROMPT_LEN - 1:]
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=True))
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:  # ||W||_row from peft, spread per channel
                parameter.mul_(1 + 0.3 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
            elif "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(torch.tensor([TOKEN_IDS])).logits[0].numpy()[PROMPT_LEN - 1:]
    peft_model.float().save_pretrained(tmp_path / "dora")
    with Engine(model) as engine:
        assert LoraSlot(4, DORA) in engine.spec.slots
        assert engine.spec.windows(LoraSlot(4, DORA)) == (16,)
        with engine.create_session(SessionConfig(lora_path=tmp_path / "dora")) as session:
            rows = [session.run_prefill(TOKEN_IDS[:PROMPT_LEN])]
            rows += [session.run_decode(token) for token in TOKEN_IDS[PROMPT_LEN:]]
    got = np.stack(rows)
    assert np.max(np.abs(got - expected)) <= 1e-4
    assert np.max(np.abs(expected - plain)) > 0.1  # the adapter matters


def test_a_decoder_of_its_own_has_no_dora_slots() -> None:
    from runtime.export.dora import check_dora

    with pytest.raises(UnimplementedError, match="--dora-ranks is not available for Linear"):
        check_dora(torch.nn.Linear(2, 2))
