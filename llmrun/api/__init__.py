"""HTTP dialects: one package each (`ollama`, `openai` with the Responses API in
`openai.responses`, `anthropic`), each of the same files: `errors` (its error shape), `wire`
(its request bodies, whose `to_request` makes the internal `llmrun.request.ChatRequest`),
`stream` (its answers, whole or streamed), `routes`. Each offers the daemon one `Dialect`
record (`dialect.py`). What several share sits here: `events` (waiting for the first event),
`disconnect`, `images`, `validation`, and llama-server's token routes (`tokens`)."""
