"""The tiny random Llama ``pdgate live`` serves, made locally (nothing downloaded).

``python -m impl.sglang.live_model DIR`` (run by the live venv's Python: it needs
transformers and tokenizers) writes a 2-layer Llama with random weights from a fixed seed
and a word-level tokenizer over a fixed vocabulary, both saved with ``save_pretrained``,
so SGLang loads them like any model directory. Sizes: 4 attention heads and 2 KV heads,
so TP=2 splits them evenly.
"""
from __future__ import annotations

import sys
from pathlib import Path

SEED = 20
WORDS = 250          # plus the special tokens: vocab 256


def vocabulary() -> dict[str, int]:
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>"]
    words = specials + [f"w{i}" for i in range(WORDS)]
    return {w: i for i, w in enumerate(words)}


def write(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")     # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=3, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():            # larger logits: greedy choices far from ties
        model.lm_head.weight.mul_(8.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    fast.save_pretrained(folder)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m impl.sglang.live_model DIR", file=sys.stderr)
        return 2
    write(Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
