"""A checkpoint's own tokenizer: tokenizer.json through the `tokenizers` library, its
special tokens and chat template from tokenizer_config.json (or chat_template.jinja /
chat_template.json), its stop tokens from generation_config.json.

Tokenization rule (the PIC key depends on it):
- The *anchor* is what the tokenizer's default encoding puts in front of any text (its
  post-processor's BOS, e.g. Gemma's `<bos>`; nothing for Qwen). It is found by encoding a
  probe text with and without special tokens; it must be at most one token and the
  default encoding must add nothing after the text (else the checkpoint is refused).
  `bos_id` is that token (or None), so the engine's `[BOS] + segments` layout equals the
  tokenizer's default encoding of a one-segment prompt.
- Each segment is encoded alone, with `add_special_tokens=False`: its ids do not depend
  on its neighbours (`encode(text)`). A prompt is `anchor + ids(seg 0) + ids(seg 1) ...`.
  A BPE merge across a segment boundary therefore never happens; that is the price of
  reusing a segment's tokens wherever it appears.
- Chat: the template is rendered as transformers renders it (sandboxed jinja2,
  trim_blocks / lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`, special
  tokens as strings); `chat_prompt` returns the rendered text with the anchor's text
  removed from its front when the template writes it (the engine adds the anchor).
- Stop tokens: generation_config.json's `eos_token_id` (an int or a list), else the
  tokenizer's `eos_token`. `eos_id` is the first, `stop_ids` all of them.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from engine.errors import TokenizerError
from engine.tokenizer import StreamDecoder, Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
PROBE = "probe text 0"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not readable JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _chat_template(directory: Path, tok_cfg: dict) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = tok_cfg.get("chat_template") or _read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def compile_chat_template(source: str):
    """A jinja2 template compiled the way transformers compiles chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it to
        mark assistant tokens for training masks)."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from e


class CheckpointTokenizer(Tokenizer):
    """The tokenizer of a Hugging Face checkpoint directory (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as e:  # pragma: no cover - tokenizers is a runtime dependency
            raise TokenizerError("a checkpoint's tokenizer needs the 'tokenizers' package") from e
        self.directory = Path(directory)
        path = self.directory / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{self.directory} has no {TOKENIZER_FILE}")
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type
            raise TokenizerError(f"cannot read {path}: {e}") from e
        cfg = _read_json(self.directory / TOKENIZER_CONFIG)
        self.special_text = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self._bos = self._anchor()
        self._stop = self._stop_ids(cfg)
        pad = self.special_text["pad_token"]
        self._pad = self._tok.token_to_id(pad) if pad else None
        source = _chat_template(self.directory, cfg)
        self.chat_template_source = source
        self._template = compile_chat_template(source) if source else None

    def _anchor(self) -> int | None:
        full = self._tok.encode(PROBE, add_special_tokens=True).ids
        plain = self._tok.encode(PROBE, add_special_tokens=False).ids
        n = len(full) - len(plain)
        if n < 0 or full[n:] != plain:
            raise TokenizerError(
                f"{self.directory / TOKENIZER_FILE}: its default encoding adds tokens after the text "
                f"({full} vs {plain}); only a leading BOS is supported")
        if n > 1:
            raise TokenizerError(
                f"{self.directory / TOKENIZER_FILE}: its default encoding adds {n} tokens in front of the text "
                f"({full[:n]}); only one (a BOS) is supported")
        return full[0] if n == 1 else None

    def _stop_ids(self, tok_cfg: dict) -> tuple[int, ...]:
        gen = _read_json(self.directory / GENERATION_CONFIG).get("eos_token_id")
        if isinstance(gen, int):
            return (gen,)
        if isinstance(gen, list) and gen and all(isinstance(i, int) for i in gen):
            return tuple(dict.fromkeys(gen))
        eos = self.special_text["eos_token"]
        eos_id = self._tok.token_to_id(eos) if eos else None
        return () if eos_id is None else (eos_id,)

    # ---------------------------------------------------------------- Tokenizer
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._stop[0] if self._stop else None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop

    @property
    def pad_id(self) -> int | None:
        return self._pad

    def special_ids(self) -> set[int]:
        return {i for i in (self._bos, self._pad, *self._stop) if i is not None}

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self._bos] if add_bos and self._bos is not None else []) + ids

    def encode_default(self, text: str) -> list[int]:
        """The tokenizer's own default encoding (special tokens added as it adds them)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def stream_decoder(self) -> StreamDecoder:
        """Incremental decoding through the `tokenizers` library's DecodeStream (constant
        work per token; a character split over tokens comes out whole)."""
        return _CheckpointStreamDecoder(self._tok)

    # --------------------------------------------------------------------- chat
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The chat template rendered over `messages` ({"role", "content"} dicts)."""
        import jinja2

        if self._template is None:
            raise TokenizerError(f"{self.directory} defines no chat template")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{k: v for k, v in self.special_text.items() if v is not None}, **extra)
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from e

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """`render_chat` without the anchor's text at its front (the engine adds the anchor
        token itself), so `[BOS] + encode(chat_prompt(m))` is the template's token sequence."""
        text = self.render_chat(messages, add_generation_prompt)
        bos = self.special_text["bos_token"]
        if self._bos is not None and bos and self._tok.token_to_id(bos) == self._bos and text.startswith(bos):
            text = text[len(bos):]
        return text


class _CheckpointStreamDecoder(StreamDecoder):
    def __init__(self, tok) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._tok, int(token_id)) or ""
        except Exception as e:  # tokenizers raises its own exception type for a bad id
            raise TokenizerError(f"token id {token_id} cannot be decoded: {e}") from e
        self._ids.append(int(token_id))
        self._emitted += len(piece)
        return piece

    def flush(self) -> str:
        """What the stream still holds back (bytes of an unfinished character, as
        `decode` renders them), so the pieces always join to `decode(ids)`."""
        return self._tok.decode(self._ids, skip_special_tokens=True)[self._emitted:]
