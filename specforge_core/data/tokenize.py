"""Render conversations with the target's own chat template, tokenize, and build loss masks.

The loss mask marks what the target itself generates in an assistant turn: everything after
the assistant header up to and including the end-of-turn token (``<|im_end|>``,
``<|eot_id|>``...). That is the assistant content, and where the template renders them its
reasoning block and tool calls. Headers, user/system/tool text, a template's default system
prompt and the whitespace after the end-of-turn token are not supervised.

How the turns are found, for any template: :class:`ChatRenderer` probes the template once with a
tiny conversation to learn the assistant header (the text the generation prompt adds, as far as
it agrees with an in-conversation header) and the end-of-turn token (the first special token the
template emits after an assistant message). Each rendered row is then scanned for
header … end-of-turn spans; for conversation rows their number must equal the number of
assistant messages. The batch is tokenized once (``encode_batch``, no re-encoding of prefixes)
and character spans become token spans through the encoding's character→token map.
"""

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from specforge_core.data.formats import BadRow, Row
from specforge_core.errors import DataError, ModelError

_SENTINEL = "\ue000probe-assistant-text\ue001"  # private-use code points: no template or data emits them


def load_tokenizer(cfg):
    """The tokenizer of ``cfg.model`` (``model.tokenizer`` or the target dir), template override applied."""
    from transformers import AutoTokenizer

    m = cfg.model
    src = m.tokenizer or m.target
    if not src:
        raise DataError("no tokenizer to tokenize with", where="model.target",
                        fix="set model.target (or model.tokenizer) to a Hugging Face directory")
    kwargs = {"trust_remote_code": m.trust_remote_code}
    if m.gguf_file and not m.tokenizer:
        kwargs["gguf_file"] = m.gguf_file
    try:
        tok = AutoTokenizer.from_pretrained(src, **kwargs)
    except (OSError, ValueError) as e:  # transformers reports a bad directory as either
        field = "model.tokenizer" if m.tokenizer else "model.target"
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        problem = (f"{src} is not a local directory, and could not be loaded as a Hub model id"
                   if not os.path.isdir(src) else f"cannot load a tokenizer from {src} ({detail})")
        gguf = " and the model.gguf_file named" if "gguf_file" in kwargs else ""
        raise ModelError(problem, where=field, fix=f"point {field} at a Hugging Face directory with "
                         f"tokenizer.json / tokenizer_config.json{gguf}") from None
    if m.chat_template:
        tok.chat_template = m.chat_template
    return tok


def effective_template(tokenizer, override: str | None = None) -> str | None:
    """The chat template that rendering uses: the configured override, else the tokenizer's own."""
    t = override or getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # named templates: the default one renders plain conversations
        t = t.get("default") or next(iter(t.values()), None)
    return t or None


def special_token_strings(tokenizer) -> list[str]:
    """Every special token's text (declared specials and added tokens marked special)."""
    out = set(tokenizer.all_special_tokens)
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok))
    return sorted((s for s in out if s), key=len, reverse=True)


class ChatRenderer:
    """A chat template compiled once, with its assistant header and end-of-turn token.

    Renders exactly as ``tokenizer.apply_chat_template(..., tokenize=False, **template_kwargs)``
    does (same template, same special-token variables, ``template_kwargs`` such as Qwen3's
    ``enable_thinking`` on top: ``data.chat_template_kwargs``) without its per-call overhead; the
    probe below renders with them too. Raises :class:`DataError` when there is no template, or
    when the template has no recognisable assistant header or end-of-turn token (set
    ``model.chat_template`` to one that has).
    """

    def __init__(self, tokenizer, chat_template: str | None = None, template_kwargs: dict | None = None):
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = effective_template(tokenizer, chat_template)
        if template is None:
            raise DataError(
                "the tokenizer has no chat template and none is configured", where="model.chat_template",
                fix="set model.chat_template to the target's Jinja chat template "
                "(or give pre-tokenized rows with input_ids/loss_mask)",
            )
        self.template = template
        self._compiled = _compile_jinja_template(template)
        # as in apply_chat_template: the caller's variables override the special-token ones
        self._vars = {**{k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)},
                      **(template_kwargs or {})}
        self.header, self.end_of_turn = self._probe(special_token_strings(tokenizer))

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False) -> str:
        return self._compiled.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **self._vars
        )

    def _probe(self, specials: list[str]) -> tuple[str, str]:
        user = {"role": "user", "content": "What is the probe?"}
        fix = "set model.chat_template to a template with a fixed assistant header and end-of-turn token"
        try:
            u = self.render([user])
            g = self.render([user], add_generation_prompt=True)
            a = self.render([user, {"role": "assistant", "content": _SENTINEL}])
        except Exception as e:  # noqa: BLE001 - any template failure means the same thing here
            raise DataError(f"the chat template fails on a plain user/assistant exchange: {e}",
                            where="model.chat_template", fix=fix) from None
        at = a.find(_SENTINEL)
        if at < 0:
            raise DataError("the chat template drops assistant content", where="model.chat_template", fix=fix)
        in_conv = a[len(os.path.commonprefix([a, u])) : at]
        gen = g[len(os.path.commonprefix([g, u])) :]
        header = os.path.commonprefix([in_conv, gen]) if gen else in_conv
        if not header.strip():
            raise DataError("cannot find the assistant header the chat template emits",
                            where="model.chat_template", fix=fix)
        after = a[at + len(_SENTINEL) :]
        hits = [(after.find(s), s) for s in specials if s in after]
        if not hits:
            raise DataError("the chat template emits no special end-of-turn token after an assistant message",
                            where="model.chat_template", fix=fix)
        return header, min(hits, key=lambda h: (h[0], -len(h[1])))[1]

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """Character spans ``[start, end)``: after each assistant header through its end-of-turn token."""
        spans, pos = [], 0
        while (h := text.find(self.header, pos)) >= 0:
            start = h + len(self.header)
            e = text.find(self.end_of_turn, start)
            end = len(text) if e < 0 else e + len(self.end_of_turn)
            spans.append((start, end))
            pos = end
        return spans


@dataclass(slots=True)
class _Staged:
    """A chunk between rendering and tokenization: texts to encode and where their results go."""

    rows: list[Row]
    out: list
    texts: list[str] = field(default_factory=list)
    spans: list[list[tuple[int, int]]] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Tokenized:
    """One tokenized row: ``input_ids`` int32, ``loss_mask`` int8 (1 = supervised), both right-truncated."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    truncated: bool


class RowTokenizer:
    """Turns batches of :class:`Row` into :class:`Tokenized` rows (or :class:`BadRow` per problem).

    ``renderer`` is created on first need, so pre-tokenized data needs no chat template.
    """

    def __init__(self, tokenizer, *, max_length: int, train_only_last_turn: bool = False,
                 chat_template: str | None = None, chat_template_kwargs: dict | None = None):
        from tokenizers import Tokenizer

        if not getattr(tokenizer, "is_fast", False):
            raise DataError("the tokenizer is not a fast (Rust) tokenizer", where="model.tokenizer",
                            fix="use a tokenizer directory with tokenizer.json")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.train_only_last_turn = train_only_last_turn
        self._chat_template = chat_template
        self._chat_template_kwargs = chat_template_kwargs
        self._renderer: ChatRenderer | None = None
        # A private copy without the padding/truncation a tokenizer.json may carry.
        self._encoder = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self._encoder.no_padding()
        self._encoder.no_truncation()

    @property
    def markers(self) -> dict | None:
        """The assistant header and end-of-turn token in use, None if nothing was rendered."""
        r = self._renderer
        return None if r is None else {"header": r.header, "end_of_turn": r.end_of_turn}

    @property
    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer, self._chat_template, self._chat_template_kwargs)
        return self._renderer

    def __call__(self, rows: list[Row]) -> list[Tokenized | BadRow]:
        staged = self._stage(rows)
        return self._finish(staged, self._encode(staged))

    def pipelined(self, chunks: Iterator[list[Row]]) -> Iterator[tuple[list[Row], list[Tokenized | BadRow]]]:
        """``(rows, results)`` per chunk, like ``self(rows)``, with chunk k's tokenization running on
        a worker thread (the Rust encoder releases the GIL) while chunk k+1 is read and rendered."""
        with ThreadPoolExecutor(1, thread_name_prefix="encode") as pool:
            pending = None
            for rows in chunks:
                staged = self._stage(rows)
                job = pool.submit(self._encode, staged)
                if pending is not None:
                    yield pending[0].rows, self._finish(pending[0], pending[1].result())
                pending = (staged, job)
            if pending is not None:
                yield pending[0].rows, self._finish(pending[0], pending[1].result())

    def _stage(self, rows: list[Row]) -> "_Staged":
        st = _Staged(rows, [None] * len(rows))
        for i, row in enumerate(rows):
            if row.input_ids is not None:
                ids = np.asarray(row.input_ids[: self.max_length], dtype=np.int32)
                mask = np.asarray(row.loss_mask[: self.max_length], dtype=np.int8)
                if self.train_only_last_turn:
                    mask = _last_run_only(mask)
                st.out[i] = Tokenized(ids, mask, len(row.input_ids) > self.max_length)
                continue
            try:
                text = row.text if row.text is not None else self._render(row)
                row_spans = self.renderer.assistant_spans(text)
                if row.messages is not None:
                    n = sum(m["role"] == "assistant" for m in row.messages)
                    if len(row_spans) != n:
                        raise BadRow(
                            f"found {len(row_spans)} assistant headers in the rendered text for {n} assistant "
                            f"messages (does a message contain {self.renderer.header!r}?)",
                            where=row.where, fix="remove chat-template markup from message text, "
                            "or set data.on_bad_row=skip", reason="template_error",
                        )
            except BadRow as e:
                st.out[i] = e
                continue
            st.texts.append(text)
            st.spans.append(row_spans[-1:] if self.train_only_last_turn else row_spans)
            st.slots.append(i)
        return st

    def _encode(self, st: "_Staged") -> list:
        return self._encoder.encode_batch(st.texts, add_special_tokens=False) if st.texts else []

    def _finish(self, st: "_Staged", encodings: list) -> list[Tokenized | BadRow]:
        for i, enc, row_spans in zip(st.slots, encodings, st.spans):
            st.out[i] = self._masked(enc, row_spans)
        return st.out

    def _render(self, row: Row) -> str:
        try:
            return self.renderer.render(row.messages, row.tools)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - templates raise anything (raise_exception, KeyError...)
            raise BadRow(f"the chat template fails on this row: {e}", where=row.where,
                         fix="fix the row so the target's chat template accepts it, or set data.on_bad_row=skip",
                         reason="template_error") from None

    def _masked(self, enc, spans: list[tuple[int, int]]) -> Tokenized:
        full = len(enc.ids)
        n = min(full, self.max_length)
        ids = np.asarray(enc.ids[:n], dtype=np.int32)
        mask = np.zeros(n, dtype=np.int8)
        for start, end in spans:
            a = _token_at(enc, start, end, +1)
            b = _token_at(enc, end - 1, start - 1, -1)
            if a is not None and b is not None and a < n:
                mask[a : min(b + 1, n)] = 1
        return Tokenized(ids, mask, full > n)

    def prompt_ids(self, row: Row, tokenized: Tokenized) -> np.ndarray:
        """Token ids the acceptance evaluator generates from: the conversation up to its first
        assistant turn with the generation prompt; for text/pre-tokenized rows the tokens before
        the first supervised token."""
        if row.messages is None:
            first = np.flatnonzero(tokenized.loss_mask)
            return tokenized.input_ids[: first[0] if len(first) else 0].copy()
        k = next(i for i, m in enumerate(row.messages) if m["role"] == "assistant")
        text = self.renderer.render(row.messages[:k], row.tools, add_generation_prompt=True)
        ids = self._encoder.encode(text, add_special_tokens=False).ids
        return np.asarray(ids[: self.max_length], dtype=np.int32)


def _token_at(enc, char: int, stop: int, step: int) -> int | None:
    """Index of the token covering ``char``, walking towards ``stop`` past characters no token
    covers (whitespace some normalisers drop)."""
    while char != stop:
        t = enc.char_to_token(char)
        if t is not None:
            return t
        char += step
    return None


def _last_run_only(mask: np.ndarray) -> np.ndarray:
    """Keep only the last contiguous run of ones (the last assistant turn of a pre-tokenized row)."""
    ones = np.flatnonzero(mask)
    if not len(ones):
        return mask
    breaks = np.flatnonzero(np.diff(ones) > 1)
    start = ones[breaks[-1] + 1] if len(breaks) else ones[0]
    out = np.zeros_like(mask)
    out[start : ones[-1] + 1] = 1
    return out
