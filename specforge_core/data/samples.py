"""Real conversations for demos and benchmarks, from the ``chitchat-dataset`` package (offline).

    python -m specforge_core.data.samples --out .cache/chitchat.jsonl --rows 500
    python -m specforge_core.data.samples --out bench.jsonl --rows 20000 --min-chars 3400 --max-chars 6800

The package (PyPI ``chitchat-dataset==0.9.0``, MIT, in the ``dev`` extra) holds 7,168 real
human-human chats. Each chat becomes user/assistant alternation (its first speaker is the user; a
trailing user turn is dropped). ``min_chars`` makes longer conversations by joining the turns of
consecutive chats until the text reaches that many characters; chats are reused cyclically when
more rows are asked for than the package holds. Output is deterministic.
"""

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specforge_core.errors import DataError


def _chats() -> list[list[str]]:
    try:
        import chitchat_dataset
    except ImportError:
        raise DataError("the chitchat-dataset package is not installed", where="specforge_core.data.samples",
                        fix="pip install chitchat-dataset==0.9.0 (or install the dev extra)") from None
    raw = json.loads((Path(chitchat_dataset.__file__).parent / "dataset.json").read_text(encoding="utf-8"))
    chats = []
    for conv in raw.values():  # turns already alternate between the two senders
        turns = [" ".join(u["text"] for u in turn).strip() for turn in conv["messages"]]
        turns = turns[: len(turns) // 2 * 2]
        if turns and all(turns):
            chats.append(turns)
    return chats


def chitchat_conversations(n: int, min_chars: int = 0, max_chars: int | None = None) -> Iterator[list[dict]]:
    """``n`` conversations as ``[{"role": "user"|"assistant", "content"}, ...]`` of at least
    ``min_chars`` characters; ``max_chars`` cuts the few very long chats (at a user turn)."""
    chats = _chats()
    i = 0
    for _ in range(n):
        turns: list[str] = []
        while not turns or sum(map(len, turns)) < min_chars:
            turns += chats[i % len(chats)]
            i += 1
        if max_chars is not None:
            total = np.cumsum([len(t) for t in turns])
            keep = max(2, int(np.searchsorted(total, max_chars, side="right")) // 2 * 2)
            turns = turns[:keep]
        yield [{"role": "user" if k % 2 == 0 else "assistant", "content": t} for k, t in enumerate(turns)]


def write_chitchat_jsonl(path: str | Path, n: int, min_chars: int = 0, max_chars: int | None = None) -> Path:
    """Write ``n`` conversations as ``{"conversations": [...]}`` JSONL to ``path``; return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for conv in chitchat_conversations(n, min_chars, max_chars):
            f.write(json.dumps({"conversations": conv}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specforge_core.data.samples", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--min-chars", type=int, default=0, help="join chats until a conversation has this many chars")
    ap.add_argument("--max-chars", type=int, default=None, help="cut longer conversations (at a user turn)")
    args = ap.parse_args(argv)
    print(write_chitchat_jsonl(args.out, args.rows, args.min_chars, args.max_chars))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
