"""The model directory's tokenizer: tokenizer.json (HF `tokenizers`), chat template, stop tokens.

The engine itself works on token ids; the CLI and the HTTP server use this to wrap it.

    tok = load_tokenizer(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tok.decode(ids)
    prompt = tok.render_chat(messages, tools=tools, enable_thinking=False)

Chat templates render through engine/chat_template.py, as transformers renders them; the special
tokens named in tokenizer_config.json (bos, eos, unk, pad) are template variables there too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from engine.chat_template import render

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tok = _HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template = self._find_chat_template(model_dir, config)
        self.special_tokens = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))
        }
        self.eos_token = self.special_tokens.get("eos_token")
        self.eos_token_ids = self._find_eos_ids(model_dir)

    @staticmethod
    def _find_chat_template(model_dir: Path, config: dict) -> str | None:
        if (model_dir / "chat_template.jinja").exists():
            return (model_dir / "chat_template.jinja").read_text()
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            return named.get("default", next(iter(named.values()), None))
        return template

    def _find_eos_ids(self, model_dir: Path) -> tuple[int, ...]:
        """Stop ids: generation_config.json's eos_token_id, config.json's, and the eos token."""
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            value = _read_json(model_dir / name).get("eos_token_id")
            ids += value if isinstance(value, list) else [] if value is None else [value]
        if self.eos_token and (eos := self._tok.token_to_id(self.eos_token)) is not None:
            ids.append(eos)
        return tuple(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def to_json(self) -> str:
        """tokenizer.json's text, as the grammar engine reads it (engine/grammar.py)."""
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: ~4 s for 1 MB of text
        # with the tests' byte tokenizer), so the server's event loop runs on meanwhile.
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text; a template's refusal raises engine.chat_template.ChatTemplateError."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return render(
            self.chat_template,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **inputs: Any
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, **inputs))


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer(model_dir)
