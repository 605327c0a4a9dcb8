"""Max logit difference and greedy agreement of every PEFT/GGUF fixture against the
transformers + peft reference, on both test models (needs no torch).

    python tools/fidelity_report.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_adapter_fidelity import PEFT, logits_and_greedy  # noqa: E402

from runtime import Engine, LoraSource, SessionConfig  # noqa: E402

CASES = [
    ("base", "base", []),
    ("qkvo_r4 (PEFT)", "qkvo_r4", [LoraSource(path=PEFT / "qkvo_r4")]),
    ("qv_r8_rslora (PEFT)", "qv_r8_rslora", [LoraSource(path=PEFT / "qv_r8_rslora")]),
    ("rank_pattern (PEFT)", "rank_pattern", [LoraSource(path=PEFT / "rank_pattern")]),
    ("layers_1_only (PEFT)", "layers_1_only", [LoraSource(path=PEFT / "layers_1_only")]),
    ("qkvo_r4 at scale 0.5", "qkvo_r4_scale_0.5", [LoraSource(path=PEFT / "qkvo_r4", scale=0.5)]),
    ("blend 0.7 qkvo_r4 + 0.3 qkvo_r4_b", "blend_cat_qkvo_r4_0.7_qkvo_r4_b_0.3",
     [LoraSource(path=PEFT / "qkvo_r4", scale=0.7), LoraSource(path=PEFT / "qkvo_r4_b", scale=0.3)]),
    ("blend_cat (PEFT-saved blend)", "blend_cat", [LoraSource(path=PEFT / "blend_cat")]),
    ("qkvo_r4.gguf (f32)", "qkvo_r4", [LoraSource(path=PEFT / "qkvo_r4.gguf")]),
    ("qkvo_r4_f16.gguf", "qkvo_r4_f16_gguf", [LoraSource(path=PEFT / "qkvo_r4_f16.gguf")]),
]


def main() -> None:
    with np.load(PEFT / "reference.npz") as data:
        reference = {key: data[key] for key in data.files}
    print("| fixture | model | max abs logit diff | greedy tokens equal |\n|---|---|---:|---|")
    for layout in ("default", "transposed"):
        with Engine(PEFT.parent / f"gqa_{layout}.tflite") as engine:
            for label, key, sources in CASES:
                with engine.create_session(SessionConfig(loras=sources)) as session:
                    logits, greedy = logits_and_greedy(session, reference)
                diff = np.abs(logits - reference[f"{key}/logits"]).max()
                print(f"| {label} | {layout} | {diff:.2e} | {greedy == reference[f'{key}/greedy'].tolist()} |")


if __name__ == "__main__":
    main()
