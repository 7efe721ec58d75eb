"""Tiny real models built on the fly: a byte-level BPE chat tokenizer and a random Llama/Qwen3.

    python -m specforge_core.models.tiny --out .cache/tiny-target     # tokenizer + model dir

Used by the fast tests and by ``make demo-tiny``: real transformers classes, no download.
Everything is deterministic (fixed seeds and corpus), so two builds give identical files.
"""

import argparse
import json
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a an of to in and is are was were be been it this that what which who how why when where "
    "you I we they he she my your our their can could would should will do does did not no yes "
    "please thanks hello hi good great time day year people way thing world life hand part child "
    "eye woman man place work week case point number group problem fact question answer capital "
    "city country France Paris river mountain water fire earth air music book story code python "
    "function value list model train data token draft target speed fast slow small large one two "
    "three four five six seven eight nine ten first last next make take give tell know think see "
    "come want look use find ask feel try leave call keep let begin seem help show hear play run "
    "move live believe bring happen write sit stand lose pay meet include continue set learn change"
).split()


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(_WORDS), (n_lines, 12), generator=g).tolist()
    lines = [" ".join(_WORDS[i] for i in row) + "." for row in idx]
    lines += [f"<|im_start|>{r}\n" for r in ("system", "user", "assistant", "tool")]
    return lines


def build_tokenizer(vocab_size: int = 512):
    """A ChatML byte-level BPE tokenizer trained on a fixed synthetic corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_target_config(vocab_size: int, arch: str = "llama", **overrides):
    """Config of a tiny target: hidden 128, 8 layers, GQA 4/2 heads (defaults capture [1,3,4])."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", 32)
        return Qwen3Config(**common)
    raise ValueError(f"unknown tiny arch {arch!r}; use 'llama' or 'qwen3'")


def build_tiny_target(out_dir: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write tokenizer + random-init causal LM (float32 safetensors) to ``out_dir``; return it."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = tiny_target_config(len(tok), arch=arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "tiny.json").write_text(json.dumps({"arch": arch, "seed": seed, **overrides}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge_core.models.tiny", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen3"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(build_tiny_target(args.out, arch=args.arch, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
