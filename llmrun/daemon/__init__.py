"""The daemon's HTTP layer: the ASGI app that lists every dialect once (`app`), who may
talk to it (`security`), how much (`limits`), and the process that serves it (`main`,
`pidfile`). It sits above `llmrun.api` and the service; nothing below imports it."""
