"""The verify step of speculative decoding: L tokens at L consecutive positions of one
session, returning the logits and the final hidden states (the lm_head's input, after the
final norm) at all L.

A verify signature is an ordinary multi-token step (the same forward a prefill with
logits runs, plain, attention LoRA or all-linear LoRA) whose final norm's output is also
returned, as ``hidden``: draft heads (:mod:`runtime.adapters.draft_heads`) turn the hidden
state of the last accepted position into the next drafts. The output is captured with a
forward hook on the decoder's ``final_norm`` while the step is traced, so every step
module of the exporter gets the output without a forward of its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HIDDEN = "hidden"  # the output's name: runtime.executor.model_spec reads it


class VerifyStep(nn.Module):
    """``step`` (a multi-token step returning ``logits`` at every position) with the final
    norm's output beside them as ``hidden`` ``[1, L, width]``."""

    def __init__(self, step: nn.Module, final_norm: nn.Module) -> None:
        super().__init__()
        self.step = step
        self.final_norm = final_norm

    def forward(self, **kwargs: Any) -> dict[str, Any]:
        captured: list[torch.Tensor] = []
        hook = self.final_norm.register_forward_hook(lambda _module, _args, output: captured.append(output))
        try:
            out = self.step(**kwargs)
        finally:
            hook.remove()
        if len(captured) != 1 or "logits" not in out:
            raise RuntimeError(f"the verify step ran the final norm {len(captured)} times and returned "
                               f"{sorted(out)}: expected once, with logits")
        return {**out, HIDDEN: captured[0]}
