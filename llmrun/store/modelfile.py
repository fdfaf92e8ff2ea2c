"""Ollama's Modelfile syntax: FROM, PARAMETER, TEMPLATE, SYSTEM, MESSAGE, LICENSE, ADAPTER.

FROM may appear twice, as Ollama allows: a model and its vision projector (an mmproj GGUF),
in either order. Which is which only the files' headers tell, so the store decides.

Values are a bare rest-of-line, a "quoted" string or a \"\"\"multi-line\"\"\" block; `#`
starts a comment line; instructions are case-insensitive. Every error names its line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_args

from pydantic import ValidationError

from llmrun.request import Message, Options

INSTRUCTIONS = ("from", "parameter", "template", "system", "message", "license", "adapter")
# Parameters of a model served by a remote engine (FROM http(s)://...): not sampling
# options, so they live apart from them (Modelfile.remote); remote_replica may repeat.
# remote_key names one of the keys the daemon's owner configured (LLMRUN_REMOTE_KEYS);
# remote_key_env, the older form, is taken only for a variable such a key reads.
REMOTE_PARAMETERS = ("remote_model", "remote_replica", "remote_key", "remote_key_env")
ROLES = ("system", "user", "assistant")
MAX_FROM = 2  # a model and its vision projector


class ModelfileError(ValueError):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"Modelfile line {line}: {message}")
        self.line = line


@dataclass
class Modelfile:
    from_: str = ""
    extra_from: list[str] = field(default_factory=list)  # a second FROM (a projector)
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    remote: dict[str, Any] = field(default_factory=dict)  # REMOTE_PARAMETERS given

    @property
    def froms(self) -> list[str]:
        """Every FROM, in the order written."""
        return [self.from_, *self.extra_from]

    def options(self) -> Options:
        return Options.model_validate(self.parameters)

    def render(self) -> str:
        """Print back as Modelfile text (parse(render(m)) == m)."""
        out = [f"FROM {ref}" for ref in self.froms]
        out += [f"ADAPTER {a}" for a in self.adapters]
        for name, value in [*self.remote.items(), *self.parameters.items()]:
            values = value if isinstance(value, list) else [value]
            out += [f"PARAMETER {name} {_quote(str(v))}" for v in values]
        if self.template is not None:
            out.append(f'TEMPLATE """{self.template}"""')
        if self.system is not None:
            out.append(f'SYSTEM """{self.system}"""')
        out += [f'MESSAGE {m.role} """{m.content}"""' for m in self.messages]
        out += [f'LICENSE """{lic}"""' for lic in self.license]
        return "\n".join(out) + "\n"


def _quote(value: str) -> str:
    if value == "" or value != value.strip() or any(c in value for c in "\n\"#"):
        return f'"""{value}"""'
    return value


def _param_type(name: str) -> type:
    annotation = Options.model_fields[name].annotation
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation  # type: ignore[return-value]


def _set_parameter(mf: Modelfile, line: int, name: str, value: str) -> None:
    name = name.strip().lower()
    if name in REMOTE_PARAMETERS:
        if not value:
            raise ModelfileError(line, f"parameter {name!r} needs a value")
        if name == "remote_replica":
            mf.remote.setdefault(name, []).append(value)
        else:
            mf.remote[name] = value
        return
    if name not in Options.model_fields:
        raise ModelfileError(line, f"unknown parameter {name!r}")
    if not value:
        raise ModelfileError(line, f"parameter {name!r} needs a value")
    kind = _param_type(name)
    if name == "stop":
        mf.parameters.setdefault("stop", []).append(value)
        return
    try:
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise ValueError
            parsed: Any = value.lower() == "true"
        else:
            parsed = kind(value)
        Options.model_validate({name: parsed})
    except (ValueError, ValidationError):
        raise ModelfileError(line, f"invalid value {value!r} for parameter {name}") from None
    mf.parameters[name] = parsed


def _unquote_inline(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def parse(text: str) -> Modelfile:
    mf = Modelfile()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        lineno = i + 1
        stripped = lines[i].strip()
        i += 1
        if not stripped or stripped.startswith("#"):
            continue
        word, _, rest = stripped.partition(" ")
        if "\t" in word:
            word, _, more = word.partition("\t")
            rest = f"{more} {rest}".strip()
        instruction = word.lower()
        if instruction not in INSTRUCTIONS:
            raise ModelfileError(lineno, f"unknown instruction {word!r}")
        rest = rest.strip()
        # multi-line value: from the first """ to the next """ (possibly many lines later)
        if '"""' in rest:
            head, _, after = rest.partition('"""')
            if '"""' in after:
                body, _, tail = after.partition('"""')
                if tail.strip():
                    raise ModelfileError(lineno, f'unexpected text after closing """: {tail!r}')
            else:
                parts = [after]
                while i < len(lines) and '"""' not in lines[i]:
                    parts.append(lines[i])
                    i += 1
                if i >= len(lines):
                    raise ModelfileError(lineno, 'unterminated """ block')
                last, _, tail = lines[i].partition('"""')
                if tail.strip():
                    raise ModelfileError(i + 1, f'unexpected text after closing """: {tail!r}')
                parts.append(last)
                i += 1
                body = "\n".join(parts)
            _apply(mf, lineno, instruction, head.strip(), body)
        else:
            _apply(mf, lineno, instruction, rest, None)
    if not mf.from_:
        raise ModelfileError(max(1, len(lines)), "a Modelfile needs a FROM instruction")
    return mf


def _apply(mf: Modelfile, line: int, instruction: str, text: str, block: str | None) -> None:
    """`text` is the line after the instruction; `block` the verbatim body of a triple-quoted
    value, which follows the argument name in `text` (PARAMETER, MESSAGE) or stands alone."""
    if instruction in ("parameter", "message"):
        name, _, inline = text.partition(" ")
        if block is None:
            block = _unquote_inline(inline.strip())
        if instruction == "parameter":
            _set_parameter(mf, line, name, block)
        else:
            _add_message(mf, line, name, block)
        return
    value = block if block is not None else _unquote_inline(text)
    if instruction == "from":
        if not value:
            raise ModelfileError(line, "FROM needs a model name or a path to a GGUF file")
        if mf.from_ and len(mf.froms) >= MAX_FROM:
            raise ModelfileError(line, "at most two FROM lines: a model and its vision "
                                       "projector (an mmproj GGUF)")
        if mf.from_:
            mf.extra_from.append(value)
        else:
            mf.from_ = value
    elif instruction == "template":
        mf.template = value
    elif instruction == "system":
        mf.system = value
    elif instruction == "license":
        mf.license.append(value)
    elif instruction == "adapter":
        if not value:
            raise ModelfileError(line, "ADAPTER needs a path to a LoRA GGUF file")
        mf.adapters.append(value)


def _add_message(mf: Modelfile, line: int, role: str, content: str) -> None:
    role = role.strip().lower()
    if role not in ROLES:
        raise ModelfileError(line, f"MESSAGE role must be one of {', '.join(ROLES)}")
    mf.messages.append(Message(role=role, content=content))  # type: ignore[arg-type]
