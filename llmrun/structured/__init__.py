"""Structured output's JSON Schema knowledge, in pure Python (no llguidance): which keywords
and formats the constraint engine enforces and where subschemas sit (keywords.py), a
client's schema rewritten as the engine should read it (prepare.py, numbers.py), and the
ceilings a request's schemas and raw grammar are held to before a runner is leased
(limits.py).

The daemon's checks (llmrun/bounds.py), the tool-call grammars (llmrun/chat/) and the
runner's compiler (llmrun/engine/constraint.py, which alone loads llguidance) all read
these, so what is checked is what is compiled.
"""
