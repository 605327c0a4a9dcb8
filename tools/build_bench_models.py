#!/usr/bin/env python3
"""Build the models the llama.cpp comparison benchmark runs on (the same weights twice).

Run with the ``export`` extra installed (``pip install -e '.[export]'``)::

    python3 tools/build_bench_models.py [--out-dir DIR] [--skip-tflite]

With fixed seeds this writes, under ``benchmarks/models/`` by default:

``hf/``
    A tiny Llama-architecture Hugging Face checkpoint (``LlamaForCausalLM``: hidden
    256, 4 layers, 8 heads of 32, 4 KV heads, intermediate 768, vocab 4096, untied
    lm_head, random weights), written with ``save_pretrained`` (``config.json``,
    ``model.safetensors``), plus a hand-made SentencePiece ``tokenizer.model`` (3
    specials, 256 byte pieces, ASCII pieces) because llama.cpp's converter insists on a
    vocabulary; its converter pads the vocab to 4096 with ``[PADn]`` tokens. Nothing
    here tokenizes text: benchmarks feed token ids.
``peft_r8_a/``, ``peft_r8_b/``, ``peft_r64/``
    PEFT LoRA adapters (``save_pretrained``) on q/k/v/o of every layer, ranks 8, 8 and
    64, ``lora_alpha = 2 * r`` (scale 2), random non-zero A and B, different seeds.
``bench_f32.tflite``, ``bench_int8.tflite``
    The HF checkpoint exported by ``runtime.export``, float32 and ``int8``
    (dynamic-range), prefill lengths 8 and 64, KV length 256, LoRA slots (q/k/v/o) of rank 8, 16
    and 64, default KV layout, no logits on prefill.
``reference_logits.npz``
    transformers' float32 logits (eager attention) for one fixed token sequence, at
    every position: ``tokens``, ``plain``, ``r8_a``, ``r8_b``, ``r64`` and
    ``blend_a07_b03`` (0.7 x delta of r8_a + 0.3 x delta of r8_b). The llama.cpp
    benchmark checks its own logits against these.
``MANIFEST.json``
    Config, versions, per-file sha256 and size, tflite signatures, and the
    verification results (max |diff| of tflite vs transformers logits).

The f32 ``.tflite`` is checked against transformers (plain decode, prefill then
decode, and the rank-8 LoRA signature fed with PEFT adapter A) before the int8 file is
made; the build stops if a difference exceeds ``TFLITE_ATOL``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import build_test_models as btm  # noqa: E402  (tools/ is not a package)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "benchmarks" / "models"

HF_DIR = "hf"
F32_FILE = "bench_f32.tflite"
INT8_FILE = "bench_int8.tflite"
REFERENCE_FILE = "reference_logits.npz"
MANIFEST_FILE = "MANIFEST.json"
PROJ = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}

# f32 tflite vs transformers, max |diff| of logits (logits spread over a few units).
TFLITE_ATOL = 1e-4


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Hyper-parameters of the benchmark model."""

    num_layers: int = 4
    hidden: int = 256
    num_heads: int = 8
    num_kv_groups: int = 4
    head_dim: int = 32
    intermediate: int = 768
    vocab: int = 4096
    kv_cache_max_len: int = 256
    prefill_seq_lens: tuple[int, ...] = (8, 64)
    lora_ranks: tuple[int, ...] = (8, 16, 64)
    # LoRA on q/k/v/o only (the adapters here): all-linear slots would double the signatures.
    lora_targets: str = "attention"
    # Batched decode signatures decode_batch{B}_lora_r8 (many sessions, one pass).
    batch_sizes: tuple[int, ...] = (2, 4, 8, 16)
    batch_lora_ranks: tuple[int, ...] = (8,)
    rms_eps: float = 1e-6
    rope_base: float = 10_000.0
    seed: int = 20_250_601
    # Projection and lm_head weights ~ N(0, weight_std); embeddings ~ N(0, 1); RMSNorm
    # weights 1 + 0.1 N(0, 1). Chosen so logits spread over a few units.
    weight_std: float = 0.08
    norm_std: float = 0.1
    # Tokens of the verification sequence (and of the reference logits).
    check_len: int = 16

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["prefill_seq_lens"] = list(self.prefill_seq_lens)
        out["lora_ranks"] = list(self.lora_ranks)
        return out


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """One PEFT adapter: directory name, rank, seed."""

    name: str
    rank: int
    seed: int
    # Target std of one entry of scale * B @ A, relative to the base weight std.
    relative_delta: float = 0.3

    @property
    def alpha(self) -> int:
        return 2 * self.rank


ADAPTERS = (
    AdapterSpec("peft_r8_a", 8, seed=101),
    AdapterSpec("peft_r8_b", 8, seed=202),
    AdapterSpec("peft_r64", 64, seed=303),
)


# --------------------------------------------------------------------------
# The Hugging Face checkpoint.
# --------------------------------------------------------------------------


def hf_config(cfg: BenchConfig) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_groups,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.kv_cache_max_len,
        rms_norm_eps=cfg.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )


def make_hf_state(cfg: BenchConfig, model_state: dict[str, Any]) -> dict[str, np.ndarray]:
    """Draws every weight with numpy from ``cfg.seed`` (numpy is the source of truth)."""
    rng = np.random.default_rng(cfg.seed)
    out: dict[str, np.ndarray] = {}
    for name in sorted(model_state):  # a fixed order, independent of torch internals
        shape = tuple(model_state[name].shape)
        if name.endswith("norm.weight"):
            value = 1.0 + cfg.norm_std * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            value = rng.standard_normal(shape)
        else:
            value = cfg.weight_std * rng.standard_normal(shape)
        out[name] = value.astype(np.float32)
    return out


def build_hf_model(cfg: BenchConfig) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(hf_config(cfg))
    state = model.state_dict()
    weights = make_hf_state(cfg, state)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    model.config._attn_implementation = "eager"
    return model.eval()


def write_sentencepiece_model(path: Path) -> int:
    """Writes a minimal SentencePiece model (BPE, byte fallback). Returns its size.

    llama.cpp's HF converter needs a vocabulary for a Llama model; this one has
    ``<unk>``, ``<s>``, ``</s>``, the 256 byte pieces and one piece per printable ASCII
    character (plus ``▁``); the converter pads up to the model's vocab size.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    piece_type = pb.ModelProto.SentencePiece

    def add(piece: str, kind: int, score: float = 0.0) -> None:
        p = m.pieces.add()
        p.piece, p.type, p.score = piece, kind, score

    add("<unk>", piece_type.UNKNOWN)
    add("<s>", piece_type.CONTROL)
    add("</s>", piece_type.CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", piece_type.BYTE)
    chars = ["\u2581"] + [chr(c) for c in range(33, 127)]
    for i, ch in enumerate(chars):
        add(ch, piece_type.NORMAL, -float(i + 1))
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(m.pieces)
    ts.byte_fallback = True
    ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = 0, 1, 2, -1
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = True
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    data = m.SerializeToString()
    path.write_bytes(data)
    return len(data)


def save_hf(model: Any, out_dir: Path) -> None:
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_sentencepiece_model(out_dir / "tokenizer.model")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": 256,
            },
            indent=2,
        )
        + "\n"
    )


# --------------------------------------------------------------------------
# PEFT adapters.
# --------------------------------------------------------------------------


def adapter_weights(
    cfg: BenchConfig, spec: AdapterSpec, base_state: dict[str, np.ndarray]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Random (A [r,in], B [out,r]) per module path, e.g. ``model.layers.0.self_attn.q_proj``.

    Entries of A and B share one std, chosen so that an entry of ``scale * B @ A`` has
    std ``relative_delta * weight_std``.
    """
    rng = np.random.default_rng(spec.seed)
    scale = spec.alpha / spec.rank
    std = np.sqrt(spec.relative_delta * cfg.weight_std / (scale * np.sqrt(spec.rank)))
    out = {}
    for layer in range(cfg.num_layers):
        for proj in ("q", "k", "v", "o"):
            module = f"model.layers.{layer}.self_attn.{PROJ[proj]}"
            out_dim, in_dim = base_state[module + ".weight"].shape
            a = (std * rng.standard_normal((spec.rank, in_dim))).astype(np.float32)
            b = (std * rng.standard_normal((out_dim, spec.rank))).astype(np.float32)
            out[module] = (a, b)
    return out


def save_peft_adapter(
    base_model: Any,
    spec: AdapterSpec,
    weights: dict[str, tuple[np.ndarray, np.ndarray]],
    out_dir: Path,
) -> Any:
    """Wraps a copy of the base in PEFT, sets A and B, saves; returns the PeftModel."""
    import torch
    from peft import LoraConfig, get_peft_model

    lora_cfg = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(PROJ.values()),
        lora_dropout=0.0,
        bias="none",
        use_rslora=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(copy.deepcopy(base_model), lora_cfg)
    # Relative to the repository root; the converters and the runtime are given the
    # base explicitly, this is for people reading the config.
    peft_model.peft_config["default"].base_model_name_or_path = "benchmarks/models/hf"
    named = dict(peft_model.named_modules())
    with torch.no_grad():
        for module, (a, b) in weights.items():
            layer = named[f"base_model.model.{module}"]
            layer.lora_A["default"].weight.copy_(torch.from_numpy(a))
            layer.lora_B["default"].weight.copy_(torch.from_numpy(b))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    # PEFT writes target_modules in set order (varies with PYTHONHASHSEED): sort it so
    # the file is rebuilt byte for byte.
    config_file = out_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))
    return peft_model.eval()


def merged_model(base_model: Any, deltas: list[tuple[float, AdapterSpec, dict]]) -> Any:
    """A copy of the base with ``sum(w * alpha/r * B @ A)`` added to each target weight."""
    import torch

    model = copy.deepcopy(base_model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for w, spec, weights in deltas:
            scale = w * spec.alpha / spec.rank
            for module, (a, b) in weights.items():
                delta = scale * (torch.from_numpy(b).double() @ torch.from_numpy(a).double())
                p = params[module + ".weight"]
                p.copy_((p.double() + delta).float())
    return model.eval()


def hf_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.from_numpy(tokens[None].astype(np.int64)), use_cache=False)
    return out.logits[0].float().numpy()


# --------------------------------------------------------------------------
# litert-torch conversion and checks.
# --------------------------------------------------------------------------


def export(cfg: BenchConfig, hf_dir: Path, out_file: Path, quantize: str) -> float:
    """Exports the HF checkpoint with ``runtime.export``; returns the seconds it took."""
    from runtime.export.exporter import export as export_checkpoint
    from runtime.export.settings import ExportSettings
    from runtime.export.source import inspect_source

    settings = ExportSettings(lora_ranks=cfg.lora_ranks, lora_targets=cfg.lora_targets, kv_length=cfg.kv_cache_max_len,
                              prefill_lengths=cfg.prefill_seq_lens, quantize=quantize, kv_layout="default",
                              batch_sizes=cfg.batch_sizes, batch_lora_ranks=cfg.batch_lora_ranks)
    report = export_checkpoint(inspect_source(hf_dir), settings, model_out=out_file)
    return sum(report.stage_seconds.values())


class TfliteDriver:
    """Runs a converted model step by step with the classic Interpreter (checks only)."""

    def __init__(self, path: Path, cfg: BenchConfig) -> None:
        from ai_edge_litert.interpreter import Interpreter

        self.cfg = cfg
        self.interp = Interpreter(model_path=str(path), num_threads=2)
        self.reset()

    def reset(self) -> None:
        c = self.cfg
        shape = (1, c.kv_cache_max_len, c.num_kv_groups, c.head_dim)
        self.kv = {
            f"kv_cache_{kind}_{i}": np.zeros(shape, np.float32)
            for i in range(c.num_layers)
            for kind in ("k", "v")
        }

    def _run(self, signature: str, tokens: np.ndarray, pos: np.ndarray, lora: dict | None):
        runner = self.interp.get_signature_runner(signature)
        out = runner(tokens=tokens, input_pos=pos, **self.kv, **(lora or {}))
        for name in self.kv:
            self.kv[name] = out[name]
        return out

    def decode(self, token: int, pos: int, lora: dict | None = None) -> np.ndarray:
        sig = "decode" if lora is None else f"decode_lora_r{self.rank(lora)}"
        out = self._run(
            sig, np.array([[token]], np.int32), np.array([pos], np.int32), lora
        )
        return out["logits"][0, 0]

    def prefill(self, tokens: np.ndarray, seq_len: int) -> None:
        padded = np.zeros((1, seq_len), np.int32)
        padded[0, : len(tokens)] = tokens
        self._run(f"prefill_{seq_len}", padded, np.arange(seq_len, dtype=np.int32), None)

    @staticmethod
    def rank(lora: dict) -> int:
        return int(lora["lora_atten_q_a_prime_weight_0"].shape[1])


def litert_lora_inputs(
    cfg: BenchConfig, spec: AdapterSpec, weights: dict, slot_rank: int
) -> dict[str, np.ndarray]:
    """PEFT A/B -> the graph's ``lora_atten_{q,k,v,o}_{a,b}_prime_weight_{L}`` inputs.

    ``a_prime = (scale * A).T`` ``[in, r]``, ``b_prime = B.T`` ``[r, out]``, zero-padded
    to the slot rank.
    """
    scale = spec.alpha / spec.rank
    out = {}
    for layer in range(cfg.num_layers):
        for proj in ("q", "k", "v", "o"):
            a, b = weights[f"model.layers.{layer}.self_attn.{PROJ[proj]}"]
            a_prime = np.zeros((a.shape[1], slot_rank), np.float32)
            b_prime = np.zeros((slot_rank, b.shape[0]), np.float32)
            a_prime[:, : spec.rank] = (scale * a).T
            b_prime[: spec.rank] = b.T
            out[f"lora_atten_{proj}_a_prime_weight_{layer}"] = a_prime
            out[f"lora_atten_{proj}_b_prime_weight_{layer}"] = b_prime
    return out


def check_tflite(
    path: Path,
    cfg: BenchConfig,
    tokens: np.ndarray,
    ref: dict[str, np.ndarray],
    lora_a: dict[str, np.ndarray],
) -> dict[str, Any]:
    """Max |diff| and argmax agreement of the tflite logits vs transformers'."""
    drv = TfliteDriver(path, cfg)
    n = len(tokens)
    results: dict[str, Any] = {}

    def record(name: str, got: np.ndarray, want: np.ndarray) -> None:
        results[name] = {
            "max_abs_diff": float(np.max(np.abs(got - want))),
            "argmax_agree": float(np.mean(got.argmax(-1) == want.argmax(-1))),
            "positions": int(got.shape[0]),
        }

    got = np.stack([drv.decode(int(t), i) for i, t in enumerate(tokens)])
    record("decode_plain", got, ref["plain"])

    drv.reset()
    split = cfg.prefill_seq_lens[0]
    drv.prefill(tokens[:split], split)
    got = np.stack([drv.decode(int(tokens[i]), i) for i in range(split, n)])
    record(f"prefill_{split}_then_decode", got, ref["plain"][split:])

    drv.reset()
    got = np.stack([drv.decode(int(t), i, lora_a) for i, t in enumerate(tokens)])
    record("decode_lora_r8_peft_r8_a", got, ref["r8_a"])
    return results


# --------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------


def build(out_dir: Path, cfg: BenchConfig, skip_tflite: bool = False) -> dict[str, Any]:
    import torch

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(2)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    base = build_hf_model(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    save_hf(base, out_dir / HF_DIR)
    base_state = {k: v.numpy() for k, v in base.state_dict().items()}
    print(f"hf checkpoint: {n_params} parameters", flush=True)

    adapter_w = {}
    peft_models = {}
    for spec in ADAPTERS:
        adapter_w[spec.name] = adapter_weights(cfg, spec, base_state)
        peft_models[spec.name] = save_peft_adapter(
            base, spec, adapter_w[spec.name], out_dir / spec.name
        )

    tokens = np.random.default_rng(cfg.seed + 1).integers(3, cfg.vocab, cfg.check_len)
    tokens = tokens.astype(np.int32)
    spec_of = {s.name: s for s in ADAPTERS}
    a, b, r64 = spec_of["peft_r8_a"], spec_of["peft_r8_b"], spec_of["peft_r64"]
    ref = {
        "tokens": tokens,
        "plain": hf_logits(base, tokens),
        "r8_a": hf_logits(merged_model(base, [(1.0, a, adapter_w[a.name])]), tokens),
        "r8_b": hf_logits(merged_model(base, [(1.0, b, adapter_w[b.name])]), tokens),
        "r64": hf_logits(merged_model(base, [(1.0, r64, adapter_w[r64.name])]), tokens),
        "blend_a07_b03": hf_logits(
            merged_model(base, [(0.7, a, adapter_w[a.name]), (0.3, b, adapter_w[b.name])]),
            tokens,
        ),
    }
    # The merged weights must agree with PEFT's own forward pass.
    peft_check = {
        name: float(np.max(np.abs(hf_logits(peft_models[name], tokens) - ref[key])))
        for name, key in (("peft_r8_a", "r8_a"), ("peft_r64", "r64"))
    }
    for name, diff in peft_check.items():
        if diff > 1e-4:
            raise SystemExit(f"merged-weight logits differ from PEFT's for {name}: {diff}")
    adapter_effect = {
        k: float(np.max(np.abs(ref[k] - ref["plain"])))
        for k in ("r8_a", "r8_b", "r64", "blend_a07_b03")
    }
    np.savez(out_dir / REFERENCE_FILE, **ref)
    print(f"reference logits: spread (std) {ref['plain'].std():.2f}; "
          f"adapter max|effect| {adapter_effect}; PEFT vs merged {peft_check}", flush=True)

    manifest: dict[str, Any] = {
        "generator": "tools/build_bench_models.py",
        "versions": {
            n: btm.package_version(n)
            for n in ("torch", "transformers", "peft", "litert-torch", "ai-edge-litert")
        },
        "config": cfg.to_json(),
        "hf": {
            "dir": HF_DIR,
            "parameters": int(n_params),
            "files": {
                p.name: btm.file_facts(p) for p in sorted((out_dir / HF_DIR).iterdir())
            },
        },
        "adapters": {
            s.name: {
                "rank": s.rank,
                "lora_alpha": s.alpha,
                "scale": s.alpha / s.rank,
                "seed": s.seed,
                "target_modules": list(PROJ.values()),
                "files": {
                    p.name: btm.file_facts(p) for p in sorted((out_dir / s.name).iterdir())
                },
            }
            for s in ADAPTERS
        },
        "reference_logits": {
            "file": REFERENCE_FILE,
            "tokens": tokens.tolist(),
            "arrays": sorted(ref),
            "adapter_max_abs_effect": adapter_effect,
            "peft_vs_merged_max_abs_diff": peft_check,
            "attn_implementation": "eager",
        },
        "tflite": {},
    }

    if not skip_tflite:
        lora_a = litert_lora_inputs(cfg, a, adapter_w[a.name], slot_rank=8)
        for file_name, quantize in ((F32_FILE, "none"), (INT8_FILE, "int8")):
            seconds = export(cfg, out_dir / HF_DIR, out_dir / file_name, quantize)
            print(f"exported {file_name} in {seconds:.1f} s", flush=True)
            check = check_tflite(out_dir / file_name, cfg, tokens, ref, lora_a)
            print(f"  vs transformers: {json.dumps(check)}", flush=True)
            if quantize == "none":
                worst = max(v["max_abs_diff"] for v in check.values())
                if worst > TFLITE_ATOL:
                    raise SystemExit(
                        f"{file_name}: logits differ from transformers by {worst} > {TFLITE_ATOL}"
                    )
            manifest["tflite"][file_name] = {
                "quantize": quantize,
                "export_seconds": round(seconds, 1),
                "kv_layout": "default",
                "output_logits_on_prefill": False,
                "vs_transformers": check,
                "signatures": btm.describe_signatures(out_dir / file_name),
                **btm.file_facts(out_dir / file_name),
            }
        total = sum(v["size_bytes"] for v in manifest["tflite"].values())
        manifest["tflite_total_bytes"] = total
        if total > 60e6:
            print(f"warning: .tflite files total {total / 1e6:.1f} MB (> 60 MB)", flush=True)

    manifest["build_seconds"] = round(time.perf_counter() - t0, 1)
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument(
        "--skip-tflite", action="store_true",
        help="only the HF checkpoint, the PEFT adapters and the reference logits",
    )
    args = parser.parse_args(argv)
    manifest = build(args.out_dir, BenchConfig(), skip_tflite=args.skip_tflite)
    for name, entry in manifest["tflite"].items():
        print(f"{name}: {entry['size_bytes'] / 1e6:.2f} MB sha256={entry['sha256'][:16]}...")
    print(f"total build time {manifest['build_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
