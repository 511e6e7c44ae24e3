"""Reading a Hugging Face `config.json` strictly: a converter takes each field it maps,
names the ones that must hold a given value, and every field left over (one the engine
does not implement) is refused with a message naming it.

`ConfigFields.finish()` raises `UnsupportedConfigError` for the first field nobody took,
so a checkpoint whose config asks for a feature we do not have (a rope scaling type, an
attention bias, another activation) is never run approximately.
"""
from __future__ import annotations

from typing import Any, Iterable

from engine.errors import UnsupportedConfigError

_MISSING = object()

#: PretrainedConfig bookkeeping and training-only fields: they do not change inference.
GENERIC_IGNORED = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
    "output_router_logits", "router_aux_loss_coef", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "cross_attention_hidden_size", "auto_map",
    "keys_to_ignore_at_inference", "max_window_layers",
    "use_return_dict",
})


class ConfigFields:
    """The fields of one config dict (`where` names it in messages, e.g. "config.json")."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = dict(data)
        self.where = where
        self.used: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of `key` (its default when absent or null; a required field when no default)."""
        self.used.add(key)
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise UnsupportedConfigError(f"{self.where}: required field {key!r} is missing")
            return default
        return value

    def expect(self, key: str, *allowed: Any) -> Any:
        """`key` must be absent/null or one of `allowed` (the first is the default)."""
        self.used.add(key)
        value = self.data.get(key)
        if value is None:
            return allowed[0]
        if value not in allowed:
            raise UnsupportedConfigError(
                f"{self.where}: {key}={value!r} is not supported (supported: {', '.join(map(repr, allowed))})")
        return value

    def ignore(self, keys: Iterable[str]) -> None:
        self.used.update(keys)

    def finish(self) -> None:
        for key in sorted(self.data):
            if key not in self.used and key not in GENERIC_IGNORED:
                raise UnsupportedConfigError(
                    f"{self.where}: field {key}={self.data[key]!r} is not supported by this engine")
