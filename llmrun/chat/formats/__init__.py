"""Chat formats: one object per family that reads its output (whole and streamed: calls,
thought, content), gives the trigger that starts the lazy grammar of tool_choice "auto",
builds the grammar of a forced call in the family's own syntax, and writes past calls.

    fmt = formats.detect(template)       # by markers only that family's template writes
    pair = fmt.think_pair(template)      # what a thought lies between (None: no thinking)
    fmt.splitter(pair, inside, keep)     # (thinking, content) of the streamed text
    fmt.reader(plan)                     # the calls out of the content
    fmt.grammar(plan, special)           # "required" / a named tool; None for "auto"
    fmt.steering(plan, special)          # "auto": triggers and the grammar after them

The runner applies it (engine/host.py, engine/outputs.py); the engine sees only grammars,
triggers and markers. A template of no family here gets the default: the tolerant reader
(toolcalls/) and tools.py's Hermes, Llama 3, Mistral and JSON grammars. Adding a family is
a class and a line in FORMATS (and its tests).

    family          detected by                      reads / forces / steers
    harmony         <|channel|> and <|message|>      gpt-oss: analysis = thought, calls
                                                     to=functions.NAME, final = answer
    kimi-k2         <|tool_calls_section_begin|>     Kimi K2 sections, ids functions.NAME:N
    kimi-k3         <|open|>, <|close|>,             XTML: response, tools and think
                    <|end_of_msg|>                   sections of <|open|>/<|close|> tags
    deepseek-v3.1   NAME<｜tool▁sep｜> in a call      DeepSeek V3.1 sections; <think>
    deepseek-r1     type<｜tool▁sep｜>NAME in a call  DeepSeek R1/V3 sections, ```json
                                                     fenced arguments; <think>
    deepseek-v3.2   dsml_token, 'function_calls>     DSML invoke/parameter calls; <think>
    deepseek-v4     dsml_token, 'tool_calls>         the same, its block `tool_calls`
    minimax-m2      <minimax:tool_call>, <invoke     invoke/parameter calls; <think>
    minimax-m3      ]<]minimax[>[ and <invoke name=  invoke calls, XML-tree arguments behind
                                                     a namespace token; <mm:think>
    seed-oss        <seed:tool_call>                 Qwen3-Coder's calls in seed blocks;
                                                     <seed:think>
    apertus         <|tools_prefix|>                 [{"NAME": {...}}]; <|inner_prefix|>
    nemotron        <TOOLCALL>                       [{"name", "arguments"}]; <think>
    minimax-m1      <tool_calls> and {"name"         {"name", "arguments"} lines
    gigachat3       'function call', <|role_sep|>    one {"name", "arguments"} message
    gigachat3.1     <|function_call|>, <|role_sep|>  one {"name", "arguments"} after it
    lfm2            <|tool_list_start|> or "List     [NAME(k="v")] pythonic calls in
                    of tools: ["                     <|tool_call_start|>; <think>
    hunyuan         '<tool_calls{}>'.format(HYTK)    Tencent Hy3: GLM's calls, tags named
                                                     `:opensource`; <think:opensource>
    ling            <role>ASSISTANT</role>,          GLM's calls; a call also ends the
                    <arg_key>                        <think> the prompt opened
    glm             <arg_key> and <arg_value>        GLM 4.6/4.7 key/value calls; <think>
    qwen3-coder     <function= and <parameter=       Qwen3-Coder, Qwen 3.5 XML calls
    command-r7b     <|START_ACTION|> <|END_ACTION|>  Command R7B, Cohere2 MoE: a JSON list of
                                                     tool_name/parameters; <|START_THINKING|>
    command-r-plus  Action:\n```json, "tool_name"    Command R+: the list in a json fence
    granite         <|tool_call|>, <|start_of_role|> Granite 3.3: <|tool_call|>[...]; <think>,
                                                     answer in <response>
    apriel          <tool_calls>[, [BEGIN FINAL      Apriel 1.5/1.6: <tool_calls>[...]; the
                    RESPONSE]                        thought before [BEGIN FINAL RESPONSE]
    firefunction    functools[                       Firefunction v2: functools[...]
    functionary-v3.1 '<function=' + tool_call,       <function=NAME>{...}</function>; the
                    <|python_tag|>                   python tool's code after <|python_tag|>
    functionary-v3.2 >>>all, '>>>' + tool_call       >>>NAME\n{...} (the prompt's >>> first)
    gemma4          '<|tool_call>call:'              Gemma 4's own notation; <|channel>thought
    minicpm5        <function name=", <param name="  MiniCPM 5 XML calls, CDATA values
    solar-open      <|tool_call:begin|>              Solar Open: a section of JSON calls with
                                                     ids; <|think|>, answer in <|content|>
    muse-glimmer    <atem:function_calls>, <|eom|>   messages to=self (thought), to=user,
                                                     to=NAME: ATEM XML calls
    derived         probe renderings (derive.py)     a template of no family above whose
                                                     calls are JSON between markers of its
                                                     own (MiniMax M1's <tool_calls>, ...)

Templates that write Hermes <tool_call> JSON (Granite 4, MiMo-VL, Reka Edge, Bielik) or
Mistral's [TOOL_CALLS] (Ministral 3 and Magistral with [THINK]) are the default's
(tests/unit/chat/test_formats_corpus.py).
"""

from __future__ import annotations

from functools import lru_cache

from llmrun.chat.formats.base import DEFAULT, CallReader, Format, Splitter
from llmrun.chat.formats.derive import Derived, derive
from llmrun.chat.formats.functionary import FunctionaryV31, FunctionaryV32
from llmrun.chat.formats.gemma4 import Gemma4
from llmrun.chat.formats.harmony import Harmony
from llmrun.chat.formats.invoke import DeepSeekV4, DeepSeekV32, KimiK3, MiniMaxM2
from llmrun.chat.formats.jsonlist import (
    Apertus,
    Apriel,
    CommandR7B,
    CommandRPlus,
    Firefunction,
    GigaChat3,
    GigaChat31,
    Granite,
    MiniMaxM1,
    Nemotron,
)
from llmrun.chat.formats.minicpm import MiniCPM5
from llmrun.chat.formats.muse import MuseGlimmer
from llmrun.chat.formats.nested import MiniMaxM3
from llmrun.chat.formats.pythonic import LFM2
from llmrun.chat.formats.sections import DeepSeekR1, DeepSeekV31, KimiK2
from llmrun.chat.formats.solar import SolarOpen
from llmrun.chat.formats.xml import GLM, Hunyuan, Ling, QwenCoder, SeedOSS, convert

# In the order tried: the most distinctive markers first (Qwen3-Coder's and GLM's templates
# also write `<tool_call>`, which is the default's Hermes marker).
FORMATS: tuple[Format, ...] = (
    Harmony(), KimiK2(), KimiK3(), DeepSeekV31(), DeepSeekR1(), DeepSeekV32(), DeepSeekV4(),
    MiniMaxM3(), MiniMaxM2(), SeedOSS(), Apertus(), Nemotron(), MiniMaxM1(), GigaChat3(),
    GigaChat31(), LFM2(), Hunyuan(), Ling(), GLM(), QwenCoder(), CommandR7B(),
    CommandRPlus(), Granite(), Apriel(), Firefunction(), FunctionaryV31(), FunctionaryV32(),
    Gemma4(), MiniCPM5(), SolarOpen(), MuseGlimmer())
BY_NAME: dict[str, Format] = {f.name: f for f in (*FORMATS, DEFAULT)}
# Every family's markers: those that are special tokens of a vocabulary are rendered as text
CONTROL_MARKERS: tuple[str, ...] = tuple(dict.fromkeys(m for f in FORMATS for m in f.markers))


@lru_cache(maxsize=32)
def detect(template: str | None, probe: bool = True) -> Format:
    """The format of the family whose template `template` is; else, with `probe`, the one
    derived by rendering it (derive.py); else the default. The daemon asks without `probe`:
    it never renders a template (that is the confined runner's work), so what it says of a
    model comes from the template's text alone."""
    if template:
        for fmt in FORMATS:
            if fmt.matches(template):
                return fmt
        derived = derive(template) if probe else None
        if derived is not None:
            return derived
    return DEFAULT


__all__ = ["BY_NAME", "CONTROL_MARKERS", "DEFAULT", "FORMATS", "CallReader", "Derived",
           "Format", "Splitter", "convert", "detect"]
