"""A tiny Llama with random weights and a locally built tokenizer, for the real-engine tier:
nothing comes from a hub. 1,000-word vocabulary (the tokenizer's equals the model's, so every
sampled id detokenizes), 2 layers, hidden 64, head_dim 32 (vLLM's CPU attention needs 32; its
bfloat16 AMX kernel crashes on these machines, so engines run it in float32).

``python -m tqueue.demos.tiny_model DIR`` writes it (about 1 MB, 4 s)."""

from __future__ import annotations

import sys
from pathlib import Path

from .._extras import require

VOCAB = 1000
BOS, EOS, PAD = 1, 2, 3


def make(out: str | Path) -> Path:
    """Write the model and its tokenizer to ``out`` (needs ``transformers`` and ``tokenizers``,
    which the ``vllm`` extra brings)."""
    tk = require("tokenizers", "vllm", by="tqueue.demos.tiny_model")
    hf = require("transformers", "vllm", by="tqueue.demos.tiny_model")

    out = Path(out)
    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(VOCAB - 4)]
    tok = tk.Tokenizer(tk.models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.decoder = tk.decoders.WordPiece(prefix="##")
    fast = hf.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    config = hf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    hf.LlamaForCausalLM(config).save_pretrained(out)
    fast.save_pretrained(out)
    hf.GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(out)
    return out


if __name__ == "__main__":
    make(sys.argv[1])
